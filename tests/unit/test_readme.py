"""The README's claims that the code can check: every file and test it names exists, every `eyrie` command and
option it shows is one the CLI has, every `make` target it shows is in the Makefile, and every config key in its
configuration table is a field of PipelineConfig."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()
# Repository paths in backticks: `eyrie/target/metadata.py`, `tests/e2e/test_refusals.py`, `configs/demo.yaml`...
PATHS = sorted(
    set(re.findall(r"`((?:eyrie|tasks|flows|tests|configs|deployments|infra|benchmarks)/[\w./-]+)`", README))
)


@pytest.mark.parametrize("path", PATHS)
def test_named_files_exist(path):
    # A glob-like name (`train/<key>/...`, `hs_<i>.safetensors`) is a run-folder path, not a repository one.
    if "<" in path or "*" in path:
        pytest.skip("a pattern, not a file")
    assert (REPO / path.rstrip("/")).exists(), f"README names {path}, which does not exist"


def test_readme_names_files_at_all():
    assert len(PATHS) > 20  # the pattern above still finds the README's file names


def test_cli_surface():
    from flows.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    shown = re.findall(r"^eyrie ([a-z-]+)(.*)$", README, re.M)
    assert {c for c, _ in shown} == set(commands), "README's `eyrie` commands differ from the CLI's"
    for command, rest in shown:
        options = set(re.findall(r"(--[a-z-]+)", rest.split("#")[0]))
        known = {o for a in commands[command]._actions for o in a.option_strings}
        assert options <= known, f"eyrie {command}: README shows {options - known}"


def test_make_targets():
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"^make ([a-z-]+)", README, re.M)):
        assert re.search(rf"^{target}:", makefile, re.M), f"README shows `make {target}`, not in the Makefile"


def test_configuration_table_keys():
    from eyrie.config import PipelineConfig

    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", README, re.M)
    sections = {name: field.annotation for name, field in PipelineConfig.model_fields.items()}
    checked = 0
    for section, keys in rows:
        if section not in sections or not hasattr(sections[section], "model_fields"):
            continue
        fields = sections[section].model_fields
        for key in re.findall(r"`(\w+)`(?: \(|,|$)", keys):
            assert key in fields, f"README's configuration table names {section}.{key}, which is not a field"
            checked += 1
    assert checked > 30


def test_until_and_stage_table_follow_the_stage_registry():
    from eyrie.stages import STAGES, UNTIL

    assert f"[--until {'|'.join(UNTIL)}]" in README
    table = README[README.index("## What happens where") :]
    table_stages = re.findall(r"^\| (\w+) \| ", table.split("\n\n", 2)[1], re.M)
    assert [s for s in table_stages if s not in ("stage", "preflight")] == [s.name for s in STAGES]
