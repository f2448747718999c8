"""Preflight's vLLM imports made while a tiny target is taught (eyrie/stages/preflight/ahead.py): started only for a
target being built, once, and always finished before preflight imports anything itself."""

from __future__ import annotations

import sys
import threading
import time

import pytest

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
    home = tmp_path / ".cache" / "targets" / "tiny-llama-chat"  # where the demo keeps it
    wiring.ensure_target.fn(TargetConfig(model=str(home), tiny="tiny-llama-chat"))
    assert calls == ["ahead", ("build", "tiny-llama-chat")]
    home.mkdir(parents=True)
    (home / "config.json").write_text("{}")
    calls.clear()
    wiring.ensure_target.fn(TargetConfig(model=str(home), tiny="tiny-llama-chat"))  # built: nothing
    wiring.ensure_target.fn(TargetConfig(model=str(tmp_path / "real")))  # a real target: nothing
    assert calls == []


def test_a_copied_demo_config_never_builds_a_tiny_target_at_its_mistyped_path(tmp_path, monkeypatch):
    """A config copied from the demo keeps `target.tiny`; its mistyped model path is refused, naming the fix, not
    built and taught as a tiny model. The demo's own place builds, and EYRIE_BUILD_TINY=1 builds anywhere."""
    import tasks.prepare as wiring
    from eyrie.errors import ConfigError

    built = []
    monkeypatch.setattr(wiring, "import_ahead", lambda: None)
    monkeypatch.setattr(wiring, "build_target", lambda name, path: built.append(str(path)))
    monkeypatch.delenv("EYRIE_BUILD_TINY", raising=False)
    typo = TargetConfig(model=str(tmp_path / "models" / "Llama-3.1-8B-Instrct"), tiny="tiny-llama-chat")
    with pytest.raises(ConfigError, match="does not exist") as err:
        wiring.ensure_target.fn(typo)
    assert "remove target.tiny" in str(err.value) and built == []
    assert not wiring.may_build_tiny(TargetConfig(model=str(tmp_path / "tiny-llama"), tiny="tiny-llama-chat"))
    assert wiring.may_build_tiny(TargetConfig(model=".cache/targets/tiny-llama-chat", tiny="tiny-llama-chat"))
    monkeypatch.setenv("EYRIE_BUILD_TINY", "1")
    wiring.ensure_target.fn(typo)
    assert built == [typo.model]
