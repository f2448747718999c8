"""The deployments' run form: every field, at every depth, in pipeline order.

Prefect's UI lays out a deployment's run form from its parameter schema, sorting each object's properties by their
`position` key (a property without one counts as 0, and ties keep the order the API returned the keys in). Prefect
gives the flow's own parameters a position, not the fields of the models they are typed with (the `definitions` of
`PipelineConfig`, `TargetConfig`, ...). Their order then comes from the server's JSON column: PostgreSQL's JSONB
returns an object's keys sorted by length, so the form read Data, Name, Train, Vocab, Target, ... and inside Target
`tiny`, `dtype`, `model`. `with_positions` gives every property the place it has in the schema pydantic wrote, which
is the field declaration order of eyrie/config.py, itself the pipeline's order (target, data, regenerate, extraction,
vocab, train, evaluate, promotion). deployments/setup.py stores the schema with positions after `prefect deploy`.

Prefect's forms (the default UI and the experimental one, 3.7) have no way to collapse a nested section: each model is
drawn as a card, open. The deployments carry a preset's parameters (deployments/prefect.yaml), so the form opens
filled with a config that runs rather than empty.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

# Keys whose values are data (a default config, an enum's values), not schemas: never walked for `properties`.
_DATA_KEYS = frozenset({"default", "examples", "enum", "const"})


def with_positions(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` in which each property of each object schema, at every depth (the parameters, every model
    in `definitions`/`$defs`, inline objects), has a `position`: its index among its siblings in the order they were
    written. A position already there (Prefect's, for the parameters) is kept."""
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        props = node.get("properties")
        if isinstance(props, dict):
            for i, prop in enumerate(props.values()):
                if isinstance(prop, dict):
                    prop.setdefault("position", i)
                    walk(prop)
        for key, value in node.items():
            if key not in _DATA_KEYS and key != "properties":
                walk(value)

    walk(out)
    return out


def flow_parameter_schema(entrypoint: str, root: Path) -> dict[str, Any]:
    """The parameter schema `prefect deploy` stores for `entrypoint` (a path under `root`, `:`, the flow's function),
    made by the same Prefect function, with every property's position (`with_positions`)."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    path, _, func = entrypoint.rpartition(":")
    flow = load_flow_from_entrypoint(f"{root / path}:{func}")
    return with_positions(parameter_schema(flow).model_dump_for_openapi())
