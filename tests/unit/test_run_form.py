"""The deployments' run form (deployments/form.py, deployments/prefect.yaml): every field at every depth has a
`position` in the declaration order of eyrie/config.py (pipeline order), whatever order a server returns the keys in,
and the production deployments carry the production preset as their parameters."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO

import eyrie.config as config_module
from deployments.form import flow_parameter_schema, with_positions
from eyrie.config import PipelineConfig, load_config

PREFECT_YAML = REPO / "deployments" / "prefect.yaml"
ENTRYPOINTS = sorted({d["entrypoint"] for d in yaml.safe_load(PREFECT_YAML.read_text())["deployments"]})


def _objects(node, path="$"):
    """Every object schema with `properties`, at every depth, with where it is."""
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict):
            yield path, node
            for name, prop in node["properties"].items():
                yield from _objects(prop, f"{path}.{name}")
        for key, value in node.items():
            if key not in ("properties", "default", "enum", "examples", "const"):
                yield from _objects(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _objects(item, f"{path}[{i}]")


def _scrambled(node):
    """The schema as PostgreSQL's JSONB hands it back: every object's keys sorted by length, then bytes."""
    if isinstance(node, dict):
        return {k: _scrambled(node[k]) for k in sorted(node, key=lambda k: (len(k), k))}
    if isinstance(node, list):
        return [_scrambled(v) for v in node]
    return node


def _form_order(props: dict) -> list[str]:
    """The order Prefect's UI lays the properties out in: by `position`, a missing one counting as 0 (a stable sort:
    ties keep the order the keys came in)."""
    return [k for k, _ in sorted(props.items(), key=lambda kv: kv[1].get("position", 0))]


@pytest.fixture(scope="module")
def pipeline_schema():
    return flow_parameter_schema("flows/pipeline.py:pipeline_flow", REPO)


def test_every_field_of_every_model_has_its_declaration_position(pipeline_schema):
    definitions = pipeline_schema["definitions"]
    assert "PipelineConfig" in definitions and "TargetConfig" in definitions
    for name, model_schema in definitions.items():
        model = getattr(config_module, name)  # each definition is a model of eyrie/config.py
        declared = [f.alias or n for n, f in model.model_fields.items()]
        props = model_schema["properties"]
        assert [props[k]["position"] for k in declared] == list(range(len(declared))), name
        # Laid out by position, the form reads in declaration order however the server orders the keys.
        assert _form_order(_scrambled(props)) == declared, name
    # The pipeline's sections in pipeline order.
    assert _form_order(_scrambled(definitions["PipelineConfig"]["properties"])) == list(PipelineConfig.model_fields)
    assert _form_order(_scrambled(pipeline_schema["properties"])) == ["config", "run_dir", "until"]


@pytest.mark.parametrize("entrypoint", ENTRYPOINTS)
def test_every_property_at_every_depth_has_a_position_in_written_order(entrypoint):
    schema = flow_parameter_schema(entrypoint, REPO)
    objects = list(_objects(schema))
    assert len(objects) > 5, entrypoint  # the parameters and the config's models
    for where, obj in objects:
        positions = [p.get("position") for p in obj["properties"].values() if isinstance(p, dict)]
        assert positions == list(range(len(positions))), (entrypoint, where, positions)
    # A round trip through JSON keeps them (they are data, not dict order).
    assert json.loads(json.dumps(_scrambled(schema))) == _scrambled(schema)


def test_with_positions_keeps_given_positions_and_leaves_data_alone():
    schema = {
        "properties": {
            "b": {"position": 7, "type": "string"},
            "a": {"type": "object", "properties": {"y": {}, "x": {"items": {"properties": {"q": {}, "p": {}}}}}},
            # a default is data: a dict in it named `properties` is not a schema
            "c": {"default": {"properties": {"k": {}}}},
        }
    }
    out = with_positions(schema)
    assert out["properties"]["b"]["position"] == 7  # Prefect's own, for the flow's parameters
    assert [out["properties"][k]["position"] for k in ("a", "c")] == [1, 2]
    assert [v["position"] for v in out["properties"]["a"]["properties"].values()] == [0, 1]
    assert [v["position"] for v in out["properties"]["a"]["properties"]["x"]["items"]["properties"].values()] == [0, 1]
    assert out["properties"]["c"]["default"] == {"properties": {"k": {}}}
    assert "position" not in schema["properties"]["a"]  # a copy


def test_production_deployments_carry_the_production_preset():
    from deployments.setup import load_prefect_file
    from eyrie.config import parse_config

    nodes, deployments = load_prefect_file()
    preset = load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")
    by = {(d["entrypoint"], d["name"]): d for d in deployments}
    production = [d for (_, name), d in by.items() if name == "production"]
    assert len(production) == 3
    for d in production:
        params = d["parameters"]
        assert parse_config(params["config"]) == preset, d["entrypoint"]
        assert params["run_dir"] == "/data/runs/kimi", d["entrypoint"]
    assert by["flows/pipeline.py:pipeline_flow", "production"]["parameters"]["until"] == "evaluate"
    assert by["flows/fanout.py:extract_fanout_flow", "production"]["parameters"]["queues"] == nodes
    # The weekly schedule runs the deployment's own parameters.
    (weekly,) = by["flows/pipeline.py:pipeline_flow", "production"]["schedules"]
    assert weekly["parameters"] == by["flows/pipeline.py:pipeline_flow", "production"]["parameters"]


def test_a_deployment_preset_that_does_not_validate_is_refused_before_anything_is_written(tmp_path):
    from deployments.setup import SetupError, load_prefect_file

    raw = yaml.safe_load(PREFECT_YAML.read_text())
    raw["deployments"][1]["parameters"] = {**raw["deployments"][1]["parameters"], "config": {"target": {}}}
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SetupError, match=r"deployment 'production' \(flows/extract.py:extract_run_flow\) parameters"):
        load_prefect_file(path)
