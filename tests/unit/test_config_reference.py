"""docs/configuration.md is generated from PipelineConfig: it is current, it lists every field, and a field added to
the config (or a description changed) makes it stale, so the check in this file fails until it is regenerated."""

from __future__ import annotations

from pydantic import Field

from eyrie.config import PipelineConfig, TrainConfig
from eyrie.ops import config_reference as ref


def test_the_page_is_current():
    current = ref.PAGE.read_text()
    assert ref.page(current) == current, "docs/configuration.md is stale: run `python -m eyrie.ops.config_reference`"
    assert ref.main(["--check"]) == 0


def test_every_field_is_listed_with_its_description():
    text = ref.render()
    for section, field in PipelineConfig.model_fields.items():
        for model in ref._models(field.annotation):
            for name, inner in model.model_fields.items():
                assert f"| `{section}.{name}` |" in text
                assert ref._cell(inner.description or "") in text


def test_a_new_field_makes_the_page_stale(monkeypatch, tmp_path):
    class Train(TrainConfig):
        new_knob: int = Field(7, description="A knob added after the page was written.")

    class Config(PipelineConfig):
        train: Train = Train()

    page = tmp_path / "configuration.md"
    page.write_text(ref.PAGE.read_text())
    monkeypatch.setattr(ref, "PipelineConfig", Config)
    assert ref.main(["--check", "--page", str(page)]) == 1
    assert ref.main(["--page", str(page)]) == 0  # regenerated: the prose above the marker kept, the knob listed
    text = page.read_text()
    assert text.startswith(ref.PAGE.read_text().split(ref.MARKER)[0])
    assert "| `train.new_knob` | int | `7` | A knob added after the page was written. |" in text
    assert ref.main(["--check", "--page", str(page)]) == 0


def test_types_as_a_config_author_writes_them():
    from typing import Literal

    assert ref.type_name(Literal["files", "packed"]) == '"files" or "packed"'
    assert ref.type_name(list[int] | None) == "list of int or null"
    assert ref.type_name(dict[str, str]) == "map of str to str"
