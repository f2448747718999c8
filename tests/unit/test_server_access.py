"""Who may reach a server Eyrie starts (issue 22, item 5): loopback unless the operator asks otherwise, and beyond it
only with an API key that then guards every route vLLM serves, not only the prefixes vLLM's own key check guards.

The route test builds the installed vLLM's own app in-process from the exact arguments Eyrie starts a server with
(no engine, no model: about 2 s once preflight's tests have imported vLLM's parser) and sends every route it has,
with every method, a request without the key. tests/e2e/test_faults.py repeats it against a running server."""

from __future__ import annotations

import typing

import pytest

from eyrie.config import is_loopback, parse_config
from eyrie.errors import ConfigError, ExtractionError
from eyrie.vllm.plugin.auth import KEY_ENV, MIDDLEWARE
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec

KEY = "k3y-" + "x" * 28


def _spec(**kw) -> ServerSpec:
    return ServerSpec(model="/m", layer_ids=[1, 2], storage_path="/s", **kw)


def test_loopback():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "node-17", "example.org"):
        assert not is_loopback(host), host


def test_a_server_beyond_loopback_needs_a_key_in_the_config_and_at_launch(tmp_path, monkeypatch):
    base = {"target": {"model": "m"}, "data": {"source": "d"}}
    with pytest.raises(ConfigError, match="exposes the server beyond loopback"):
        parse_config({**base, "extraction": {"host": "0.0.0.0"}})
    parse_config({**base, "extraction": {"host": "127.0.0.2"}})  # loopback, keyless: fine
    # A spec made some other way is refused at launch too, before anything starts or is written.
    with pytest.raises(ExtractionError, match="would answer anyone on the network"):
        VllmServer(tmp_path / "server").launch(_spec(host="0.0.0.0"))
    assert not (tmp_path / "server").exists()


def test_the_guard_is_passed_exactly_when_there_is_a_key():
    assert MIDDLEWARE not in _spec().arguments(8000)
    args = _spec(api_key_env="EYRIE_TEST_KEY").arguments(8000)
    assert args[args.index("--middleware") + 1] == MIDDLEWARE
    assert not any(KEY in a for a in args)  # the key's value is never on the command line


def _vllm_app(monkeypatch, spec: ServerSpec):
    """The installed vLLM's app, with every task's and the dev mode's routes, from Eyrie's arguments for `spec`."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.tasks import SupportedTask

    from eyrie.stages.preflight import parse_server_arguments

    monkeypatch.setenv(KEY_ENV, KEY)  # as VllmServer.launch passes it
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the most routes vLLM can expose
    args = parse_server_arguments(spec.arguments(8000))
    return build_app(args, supported_tasks=typing.get_args(SupportedTask))


def _requests(app) -> list[tuple[str, str]]:
    from starlette.routing import Mount, Route, WebSocketRoute

    out = []
    for r in app.routes:
        path = r.path.replace("{", "").replace("}", "")  # /v1/responses/{response_id} -> a concrete path
        if isinstance(r, WebSocketRoute):
            out.append(("WEBSOCKET", path))
        elif isinstance(r, Mount):
            out += [("GET", path), ("GET", path + "/")]
        elif isinstance(r, Route):
            out += [(m, path) for m in sorted(r.methods or ())]
    return out + [("GET", "/no-such-route"), ("OPTIONS", "/v1/completions"), ("OPTIONS", "/invocations")]


def test_every_route_of_the_vllm_app_refuses_a_request_without_the_key(monkeypatch):
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    app = _vllm_app(monkeypatch, _spec(api_key_env="EYRIE_TEST_KEY", host="0.0.0.0"))
    requests = _requests(app)
    paths = {p for _, p in requests}
    # vLLM's own check leaves these open (it guards /v1, /v2, /inference and /cohere only): the reason for the guard.
    assert {"/invocations", "/health", "/metrics", "/tokenize", "/ping", "/load", "/version"} <= paths
    assert len(requests) > 40
    client = TestClient(app, raise_server_exceptions=False)
    answered = {}
    for method, path in requests:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            if method == "WEBSOCKET":
                with pytest.raises(WebSocketDisconnect), client.websocket_connect(path, headers=headers):
                    pass
                continue
            status = client.request(method, path, headers=headers).status_code
            if status != 401:
                answered[(method, path, tuple(headers.values()))] = status
    assert answered == {}
    # With the key a request passes the guard (here vLLM, with no engine behind it, then fails in its handler).
    assert client.get("/version", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/health", headers={"Authorization": f"Bearer {KEY}"}).status_code != 401
