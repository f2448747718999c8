"""What the README and the docs name, checked against the code: every repository file and test they name exists,
every `eyrie` command and option they show is one the CLI has, every `make` target is in the Makefile, every
`section.key` they mention is a field of PipelineConfig, the stage pages follow the stage registry, and every
relative link lands on a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

DOCS = REPO / "docs"
# Every page a user reads: the README, the docs site, the benchmark pages.
PAGES = {
    p.relative_to(REPO).as_posix(): p.read_text()
    for p in [REPO / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
}
README = PAGES["README.md"]
ALL = "\n".join(PAGES.values())
# Repository paths in backticks: `eyrie/target/metadata.py`, `tests/e2e/test_refusals.py`, `configs/demo.yaml`...
TOP = "eyrie|tasks|flows|tests|configs|deployments|infra|benchmarks|docs"
PATHS = sorted(set(re.findall(rf"`((?:{TOP})/[\w./-]+)`", ALL)))
STAGE_PAGES = ["preflight"]  # preflight is no stage of the registry (it runs before and between them) but has a page


@pytest.mark.parametrize("path", PATHS)
def test_named_files_exist(path):
    # A glob-like name (`train/<key>/...`, `hs_<i>.safetensors`) is a run-folder path, not a repository one.
    if "<" in path or "*" in path:
        pytest.skip("a pattern, not a file")
    assert (REPO / path.rstrip("/")).exists(), f"the docs name {path}, which does not exist"


def test_docs_name_files_at_all():
    assert len(PATHS) > 40  # the pattern above still finds the docs' file names


def _commands():
    from flows.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]


def test_cli_page_shows_every_command():
    shown = {c for c in re.findall(r"^eyrie ([a-z-]+)", PAGES["docs/cli.md"], re.M)}
    assert shown == set(_commands()), "docs/cli.md's `eyrie` commands differ from the CLI's"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_shown_commands_and_options_exist(page):
    commands = _commands()
    for command, rest in re.findall(r"^eyrie ([a-z-]+)(.*)$", PAGES[page], re.M):
        assert command in commands, f"{page} shows `eyrie {command}`, which the CLI does not have"
        options = set(re.findall(r"(--[a-z-]+)", rest.split("#")[0]))
        known = {o for a in commands[command]._actions for o in a.option_strings}
        assert options <= known, f"{page}: eyrie {command} shows {options - known}"


def test_make_targets():
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"(?:^|`)make ([a-z-]+)", ALL, re.M)):
        assert re.search(rf"^{target}:", makefile, re.M), f"the docs show `make {target}`, not in the Makefile"


def test_named_config_keys_are_fields():
    """`extraction.storage`, `train.hidden_states`, ...: each dotted name whose first part is a config section must
    name a field of that section (and of a nested section, for three parts)."""
    from eyrie.config import PipelineConfig

    sections = {
        n: f.annotation for n, f in PipelineConfig.model_fields.items() if hasattr(f.annotation, "model_fields")
    }
    checked = 0
    for section, key in re.findall(rf"(?<![\w./<-])({'|'.join(sections)})\.([a-z_]+)\b", ALL):
        if key in ("yaml", "py", "json", "md"):  # a file name (`configs/demo.yaml`), not a key
            continue
        assert key in sections[section].model_fields, f"the docs name {section}.{key}, which is not a config field"
        checked += 1
    assert checked > 30


def test_until_and_stage_pages_follow_the_stage_registry():
    """One page per stage, named after it, in the site's nav in pipeline order, and in the stage index's table."""
    import yaml

    from eyrie.stages import STAGES, UNTIL

    assert f"[--until {'|'.join(UNTIL)}]" in PAGES["docs/cli.md"]
    order = STAGE_PAGES + [s.name for s in STAGES]
    pages = sorted(p.stem for p in (DOCS / "stages").glob("*.md") if p.stem != "index")
    assert pages == sorted(order), "one page per stage, named after it"
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    (stages,) = [entry["Stages"] for entry in nav if isinstance(entry, dict) and "Stages" in entry]
    listed = [Path(e if isinstance(e, str) else next(iter(e.values()))).stem for e in stages]
    assert [s for s in listed if s != "index"] == order, "mkdocs.yml lists the stage pages out of pipeline order"
    table = re.findall(r"^\| \[(\w+)\]\(", PAGES["docs/stages/index.md"], re.M)
    assert table == order, "docs/stages/index.md's table is out of pipeline order"


def _slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_\[\]()]", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


@pytest.mark.parametrize("page", sorted(PAGES))
def test_relative_links_land(page):
    here = (REPO / page).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", PAGES[page]):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (here / path) if path else REPO / page
        assert dest.exists(), f"{page} links to {target}: no such file"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page} links to {target}: no such heading"


def test_every_page_is_reachable():
    """A page left out of mkdocs.yml's nav is built but found by nobody."""
    nav = (REPO / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w/.-]+\.md)", nav))
    missing = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - listed
    assert not missing, f"pages not in mkdocs.yml's nav: {sorted(missing)}"
