"""The configuration reference (docs/configuration.md), generated from PipelineConfig: one table per section, each
field with its type, default and description as eyrie/config.py declares them, so the docs cannot drift from the
code. The page's own prose lives above a marker line and is kept; everything below it is rewritten.

    python -m eyrie.ops.config_reference           # rewrite docs/configuration.md
    python -m eyrie.ops.config_reference --check   # exit 1 if it is stale (tests/unit/test_config_reference.py)
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from eyrie.config import PipelineConfig
from eyrie.ops import generated_page

MARKER = "<!-- Generated from eyrie/config.py by `python -m eyrie.ops.config_reference`: edit above this line. -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds (`list[TemperatureShare] | None` holds TemperatureShare)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models(a)]


def type_name(annotation: Any) -> str:
    """A type as a config author writes it: `int`, `"files"` or `"packed"`, `list of int`, `... or null`."""
    origin = get_origin(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(annotation))
    if origin is list:
        return f"list of {type_name(get_args(annotation)[0])}"
    if origin is dict:
        key, value = get_args(annotation)
        return f"map of {type_name(key)} to {type_name(value)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"`{annotation.__name__}`"
    if hasattr(annotation, "__origin__") or hasattr(annotation, "__metadata__"):  # Annotated (PositiveInt, ...)
        return type_name(get_args(annotation)[0]) if get_args(annotation) else str(annotation)
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        lines.append(
            f"| `{prefix}{name}` | {_cell(type_name(field.annotation))} | {_cell(default_text(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return lines


def render() -> str:
    """The generated part of the page: top-level keys, then one section per config section, nested models after
    the section that holds them."""
    out = ["", MARKER, "", "## Top level", ""]
    top = {n: f for n, f in PipelineConfig.model_fields.items() if not _models(f.annotation)}
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in top.items():
        lines.append(
            f"| `{name}` | {_cell(type_name(field.annotation))} | {_cell(default_text(field))} | "
            f"{_cell(field.description or '')} |"
        )
    out += lines
    seen: set[type[BaseModel]] = set()
    for name, field in PipelineConfig.model_fields.items():
        for model in _models(field.annotation):
            out += _section(model, f"{name}.", f"`{name}`", field.description or model.__doc__, seen)
    return "\n".join(out) + "\n"


def _section(model: type[BaseModel], prefix: str, title: str, about: str | None, seen: set) -> list[str]:
    if model in seen:
        return []
    seen.add(model)
    out = ["", f"## {title}", ""]
    if about:
        out += [" ".join(about.split()), ""]
    out += _table(model, prefix)
    for name, field in model.model_fields.items():
        for inner in _models(field.annotation):
            title = f"`{prefix}{name}` entries (`{inner.__name__}`)"
            out += _section(inner, "", title, inner.__doc__, seen)
    return out


def page(current: str) -> str:
    """`current` with everything below the marker replaced by the generated reference."""
    head = current.split(MARKER)[0].rstrip("\n") + "\n"
    return head + render()


def main(argv: list[str] | None = None) -> int:
    return generated_page.main(argv, PAGE, page, "# Configuration\n", "eyrie.ops.config_reference", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
