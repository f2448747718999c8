"""The hidden-states connector's request bookkeeping, for requests that have no file (they asked for none, or were
aborted before they were scheduled): vLLM 0.26's own connector raised KeyError on them in `request_finished` and
reported them as sent in `get_finished`, which made its scheduler free their blocks twice. Pure bookkeeping: the
connector object is made without a server (no KV cache, no writer thread)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)

from eyrie.vllm.plugin.connector import EyrieHiddenStatesConnector


def _connector(tmp_path) -> EyrieHiddenStatesConnector:
    c = object.__new__(EyrieHiddenStatesConnector)  # the bookkeeping only: no vLLM config, no KV cache
    c._request_filenames = {"saved": str(tmp_path / "saved.safetensors")}
    c._pending_saves = {}
    c._req_copy_events = {}
    c._lock_fds = {}
    c._connector_metadata = None
    return c


def test_a_request_without_a_file_saves_nothing_and_holds_no_blocks(tmp_path):
    c = _connector(tmp_path)
    c._pending_saves["skipped"] = "left over"
    request = SimpleNamespace(request_id="skipped", kv_transfer_params={}, prompt_token_ids=[1, 2, 3])

    assert c.request_finished(request, [0, 1]) == (False, None)
    assert "skipped" not in c._pending_saves
    assert c._request_filenames == {"saved": str(tmp_path / "saved.safetensors")}  # others untouched


def test_a_request_with_a_file_is_saved_as_vllm_saves_it(tmp_path):
    c = _connector(tmp_path)
    request = SimpleNamespace(request_id="saved", kv_transfer_params={}, prompt_token_ids=[5, 6, 7], all_token_ids=[])

    delay, params = c.request_finished(request, [3, 4])

    assert delay is True and params == {"hidden_states_path": str(tmp_path / "saved.safetensors")}
    pending = c._pending_saves["saved"]
    assert pending.block_ids == [3, 4] and pending.token_ids.tolist() == [5, 6, 7]


def test_only_requests_with_a_save_reach_vllms_finished_report(tmp_path, monkeypatch):
    told = []

    def told_of(self, finished_req_ids):
        told.append(finished_req_ids)
        return None, None

    monkeypatch.setattr(ExampleHiddenStatesConnector, "get_finished", told_of)
    c = _connector(tmp_path)
    meta = ExampleHiddenStatesConnectorMetadata()
    meta.pending_saves = [PendingSave("new", "f.safetensors", None, [0])]  # type: ignore[arg-type]
    c._connector_metadata = meta
    c._req_copy_events["in-flight"] = object()
    lock_fd = os.open(tmp_path / "aborted.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    c._lock_fds["aborted"] = lock_fd

    c.get_finished({"new", "in-flight", "skipped", "aborted"})

    assert told == [{"new", "in-flight"}]
    assert c._lock_fds == {}  # the aborted request's lock is released, not leaked
    with pytest.raises(OSError):
        os.fstat(lock_fd)
