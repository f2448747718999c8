"""docs/operations/sizing.md is generated from preflight's disk estimate: it is current, its targets are the published
configs' shapes, its figures are the ones preflight computes for a real target's metadata, and a change to the
numbers makes it stale."""

from __future__ import annotations

import json
import shutil

from conftest import REPO, config_dict

from eyrie.config import parse_config
from eyrie.ops import sizing
from eyrie.stages.preflight import run_preflight
from eyrie.target.tiny.tokenizer import build_tokenizer

FIXTURES = REPO / "tests" / "fixtures" / "production"


def test_the_page_is_current():
    current = sizing.PAGE.read_text()
    assert sizing.page(current) == current, "docs/operations/sizing.md is stale: run `python -m eyrie.ops.sizing`"
    assert sizing.main(["--check"]) == 0


def test_the_targets_are_the_published_shapes():
    """The rows whose config.json is stored here hold its layer count and hidden size."""
    fixtures = {"Kimi-K2.5": "kimi-k2.5", "Llama-3.1-405B": "llama-3.1-405b-instruct"}
    rows = {t.name: t for t in sizing.TARGETS}
    for name, folder in fixtures.items():
        config = json.loads((FIXTURES / folder / "config.json").read_text())
        config = config.get("text_config", config)  # Kimi-K2.5 wraps its text model
        assert (rows[name].layers, rows[name].hidden_size) == (config["num_hidden_layers"], config["hidden_size"])


def _cell(text: str, target: str, column: int) -> str:
    row = next(line for line in text.splitlines() if line.startswith(f"| {target} |"))
    return row.split("|")[column + 1].strip()


def test_the_page_figure_is_preflights_estimate(tmp_path):
    """Preflight's disk estimate for Llama-3.1-405B's metadata with fp8 hidden states, for 1,000 prepared tokens, is
    the page's bytes per token for that target and dtype, times 1,000."""
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama-3.1-405b-instruct", folder)
    build_tokenizer(folder)
    data = config_dict(folder, max_length=2048, vocab={"draft_vocab_size": 32000})
    data["target"]["tensor_parallel_size"] = 8
    data["extraction"].update(unproven_aux_layers="warn", hidden_states_dtype="float8_e4m3fn", min_free_disk_gib=0)
    report = run_preflight(parse_config(data), tmp_path / "run", tokens=1000, raise_on_failure=False, serve=False)
    page = sizing.PAGE.read_text()
    columns = ["layers", "hidden size", "aux ids", *(f"{d} bytes/token" for d in sizing.DTYPES)]
    per_token = int(_cell(page, "Llama-3.1-405B", columns.index("float8_e4m3fn bytes/token") + 1).replace(",", ""))
    assert report.estimated_bytes == 1000 * per_token == 1000 * (4 * 16384 + 4 + 8)  # values, fp8 scale, token id


def test_a_changed_figure_makes_the_page_stale(monkeypatch, tmp_path):
    page = tmp_path / "sizing.md"
    page.write_text(sizing.PAGE.read_text())
    assert sizing.main(["--check", "--page", str(page)]) == 0
    monkeypatch.setattr(sizing, "TARGETS", (*sizing.TARGETS, sizing.Target("Another", 40, 5120)))
    assert sizing.main(["--check", "--page", str(page)]) == 1
    assert sizing.main(["--page", str(page)]) == 0 and "| Another | 40 | 5,120 |" in page.read_text()
    assert page.read_text().split(sizing.MARKER)[0] == sizing.PAGE.read_text().split(sizing.MARKER)[0]
