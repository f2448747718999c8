"""Preflight's vLLM imports made while a tiny target is taught (eyrie/stages/preflight/ahead.py): started only for a
target being built, once, and always finished before preflight imports anything itself."""

from __future__ import annotations

import sys
import threading
import time

from eyrie.config import TargetConfig
from eyrie.stages.preflight import ahead


def test_the_imports_run_in_one_thread_that_preflight_waits_for(monkeypatch):
    monkeypatch.setattr(ahead, "_STATE", {})
    monkeypatch.setattr(ahead, "MODULES", ("wave", "no_such_module_here", "chunk"))
    parsers = []
    monkeypatch.setattr(ahead, "serve_parser", lambda: parsers.append("built"))
    for name in ("wave", "chunk"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    started = threading.Event()
    real = ahead._import_all

    def slow():
        started.set()
        time.sleep(0.3)
        real()

    monkeypatch.setattr(ahead, "_import_all", slow)
    ahead.import_ahead()
    ahead.import_ahead()  # once
    assert started.wait(5) and len([t for t in threading.enumerate() if t.name == "eyrie-preflight-imports"]) == 1
    ahead.wait_for_imports_ahead()
    assert not ahead._STATE["thread"].is_alive()
    assert "wave" in sys.modules and "chunk" not in sys.modules  # a failed import ends the list: preflight reports it
    assert parsers == []
    monkeypatch.setattr(ahead, "_STATE", {})
    monkeypatch.setattr(ahead, "MODULES", ("wave",))
    ahead.import_ahead()
    ahead.wait_for_imports_ahead()
    assert parsers == ["built"]  # all imported: vLLM's server parser built once, for preflight to reuse
    ahead.wait_for_imports_ahead()  # again, and with no thread at all: nothing to wait for
    monkeypatch.setattr(ahead, "_STATE", {})
    ahead.wait_for_imports_ahead()


def test_only_a_tiny_target_being_built_imports_ahead(tmp_path, monkeypatch):
    import tasks.prepare as wiring

    calls = []
    monkeypatch.setattr(wiring, "import_ahead", lambda: calls.append("ahead"))
    monkeypatch.setattr(wiring, "build_target", lambda name, path: calls.append(("build", name)))
    wiring.ensure_target.fn(TargetConfig(model=str(tmp_path / "t"), tiny="tiny-llama-chat"))
    assert calls == ["ahead", ("build", "tiny-llama-chat")]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    calls.clear()
    wiring.ensure_target.fn(TargetConfig(model=str(tmp_path / "t"), tiny="tiny-llama-chat"))  # built: nothing
    wiring.ensure_target.fn(TargetConfig(model=str(tmp_path / "real")))  # a real target: nothing
    assert calls == []
