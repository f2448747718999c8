"""What the README and the docs name, checked against the code: every repository file and test they name exists,
every `eyrie` command and option they show is one the CLI has, every `make` target is in the Makefile, every
`section.key` they mention is a field of PipelineConfig, the stage pages follow the stage registry, and every
relative link lands on a file (and heading) that exists."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

DOCS = REPO / "docs"
# Every page a user reads: the README, the docs site, the benchmark pages.
PAGES = {
    p.relative_to(REPO).as_posix(): p.read_text()
    for p in [
        REPO / "README.md",
        *sorted(DOCS.rglob("*.md")),
        *sorted((REPO / "benchmarks").glob("*.md")),
        REPO / "infra" / "README.md",
    ]
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
    if subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0:
        pytest.skip("a file the operator makes, which git ignores (infra/.env)")
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
    text = re.sub(r"[`*\[\]()]", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _with_snippets(text: str) -> str:
    """A page as the docs site renders it: each `--8<-- "path"` line (pymdownx.snippets, base path the repository)
    replaced by that file."""
    return re.sub(r'^--8<-- "([^"]+)"$', lambda m: (REPO / m.group(1)).read_text(), text, flags=re.M)


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
            headings = re.findall(r"^#+ (.+)$", _with_snippets(dest.read_text()), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page} links to {target}: no such heading"


def test_every_page_is_reachable():
    """A page left out of mkdocs.yml's nav is built but found by nobody."""
    nav = (REPO / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w/.-]+\.md)", nav))
    missing = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - listed
    assert not missing, f"pages not in mkdocs.yml's nav: {sorted(missing)}"


# ---------------------------------------------------------------------------------------------------------------
# What the docs say, and where: the product only, each figure once, the operator's guide and the security page in
# the site, an install that works where the docs say it does.

RESULTS = PAGES["benchmarks/RESULTS.md"]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_pages_speak_of_the_product_not_of_how_it_was_built(page):
    """No session numbers, no "this session", no development machine: a reader has none of those."""
    for pattern in (r"\bsessions? \d+", r"\bthis session\b", r"\bdevelopment (?:VM|machine)\b"):
        found = re.findall(rf".{{0,40}}{pattern}.{{0,20}}", PAGES[page], re.I)
        assert not found, f"{page}: {found}"


def _current_figures() -> list[list[str]]:
    """The rows of the table under `## Current figures`, the first section of benchmarks/RESULTS.md."""
    sections = re.split(r"^## ", RESULTS, flags=re.M)
    assert sections[1].startswith("Current figures\n"), "benchmarks/RESULTS.md must open with its current figures"
    assert sections[2].startswith("History\n"), "the history follows the current figures"
    rows = [line for line in sections[1].splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == ["what", "figure", "date", "machine", "commit", "command"], header
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def test_results_open_with_one_screen_of_current_figures_each_with_date_machine_commit_command():
    rows = _current_figures()
    assert 5 <= len(rows) <= 15, "one screen"
    for what, figure, date, machine, commit, command in rows:
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", date), (what, date)
        assert machine, what
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), (what, commit)
        assert command.startswith("`") and command.count("`") >= 2, (what, command)
        assert re.search(r"\*\*[^*]*\d[^*]*\*\*", figure), (what, "the figure, in bold")
    # Every named commit is one of this repository's.
    known = subprocess.run(["git", "log", "--format=%h %H"], cwd=REPO, capture_output=True, text=True).stdout
    if known:  # a checkout without its history (an sdist) cannot tell
        assert all(any(h.startswith(r[4]) for h in known.split()) for r in rows), "a commit not in this history"


SUMMARY_PAGES = ("README.md", "docs/index.md", "docs/getting-started.md")


def test_each_current_figure_has_one_source():
    """The summary pages link to benchmarks/RESULTS.md's current figures rather than repeat them (three spellings of
    one figure drift apart). A bare number (a loss of 3.21 is no acceptance length) is not taken for a figure."""
    assert "(benchmarks/RESULTS.md#current-figures)" in README
    figures = {f for row in _current_figures() for f in re.findall(r"\*\*([^*]+)\*\*", row[1])}
    figures = {f for f in figures if not re.fullmatch(r"[\d.,]+", f)}
    assert len(figures) >= 5
    repeated = sorted(
        (name, f)
        for f in figures
        for name in SUMMARY_PAGES
        if re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", PAGES[name])
    )
    assert not repeated, f"figures repeated outside benchmarks/RESULTS.md (link to it instead): {repeated}"


def test_the_operators_guide_is_in_the_docs_site():
    """infra/README.md points to the guide in the site (built, searched, link-checked) instead of holding it."""
    import yaml

    infra = PAGES["infra/README.md"]
    assert "(../docs/operations/setup.md)" in infra and len(infra.splitlines()) < 30
    nav = json.dumps(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert "operations/setup.md" in nav and "operations/security.md" in nav


def test_eyrie_pass_env_is_in_the_configuration_and_security_pages():
    """Every variable eyrie/run/environment.py reads from the operator is documented where a config is written and
    where secrets are discussed."""
    from eyrie.run.environment import PASS_ENV

    prose = PAGES["docs/configuration.md"].split("<!-- Generated from")[0]
    assert f"`{PASS_ENV}`" in prose and "(operations/security.md#eyrie_pass_env)" in prose
    security = PAGES["docs/operations/security.md"]
    assert f"### `{PASS_ENV}`" in security and f"{PASS_ENV}=HF_TOKEN" in security


def test_the_postgresql_install_shown_works_on_the_documented_distributions():
    """`apt-get install postgresql-16` fails on stock Debian 12 (it ships 15): a page installs the distribution's
    `postgresql`, as .ci/ensure-postgres does, or names a version only beside the PostgreSQL apt repository (PGDG)."""
    ci = (REPO / ".ci" / "ensure-postgres").read_text()
    assert re.search(r"apt-get install[^\n]*\spostgresql$", ci, re.M)
    shown = 0
    for page, text in PAGES.items():
        for line in re.findall(r"apt-get install[^\n`]*", text):
            if versioned := re.search(r"\bpostgresql-(\d+)\b", line):
                assert "apt.postgresql.org" in text, f"{page}: `{line}` needs the PGDG repository ({versioned[0]})"
            shown += "postgresql" in line
    assert shown, "the docs show how to install PostgreSQL"
    assert re.search(r"^sudo apt-get install -y postgresql$", PAGES["docs/operations/setup.md"], re.M)
