"""A hidden-states connector that works on CPU as well as GPU.

vLLM's `ExampleHiddenStatesConnector` copies device-to-host through a CUDA stream into pinned memory, which crashes
the CPU engine on its first request ("pin_memory=True requires a CUDA or other accelerator backend"). When the KV
cache lives on the host there is nothing to copy asynchronously: index it directly and hand the tensor to the same
writer thread pool. On an accelerator the stock path runs unchanged.

It names each request's file itself (`eyrie-<random>.safetensors` in its storage folder), never after the request id
a client sets (vLLM's default, which a `../` in a `request_id` or X-Request-Id turned into a write anywhere).

It also honours a per-request switch (`kv_transfer_params: {"eyrie_skip_hidden_states": true}`): the regenerate
stage generates on the extraction server, and its requests need no hidden-states file.

With `EYRIE_HIDDEN_STATES_DTYPE=float8_e4m3fn` in the server's environment (`extraction.hidden_states_dtype`) it writes
speculators' fp8 format (eyrie/hidden_states/encoding.py): quantized in the writer thread, after the copy, as
speculators'
own FP8HiddenStatesConnector does, on CPU and on an accelerator alike.

A request that names the key its file is made under (`kv_transfer_params: {"eyrie_sample_key": <key>}`, what
extraction sends) gets a file that records it in its safetensors metadata (eyrie/hidden_states/keyed.py): the key
rides from the scheduler, which names the file, to the writer in the file's name.

Two of vLLM 0.26's own bookkeeping errors are kept out on every version the plugin supports (0.32 fixed both
upstream; the GPU build of the lent H200 is 0.26): `request_finished` raised KeyError for a request with no file (one
that asked for none, or was aborted before it was scheduled), and `get_finished` reported such requests as sent, so
the scheduler freed blocks it had freed already (`assert req_id in self.requests`).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.v1.core.sched.output import SchedulerOutput

from eyrie.hidden_states.encoding import BFLOAT16, DTYPES, ENV, FP8, encode, fp8_unavailable
from eyrie.hidden_states.keyed import SAMPLE_KEY, key_from_name, key_metadata, name_with_key
from eyrie.run.folder import server_file_name
from eyrie.vllm.plugin import SKIP_HIDDEN_STATES


class _Done:
    """Stands in for the CUDA event of a copy that already happened (host memory, synchronous)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class EyrieHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        dtype = os.environ.get(ENV) or BFLOAT16
        if dtype not in DTYPES:
            raise ValueError(f"{ENV}={dtype!r}; expected one of {', '.join(DTYPES)}")
        if dtype == FP8 and (why := fp8_unavailable()):
            raise RuntimeError(f"{ENV}={dtype}, but {why}")
        self._hidden_states_dtype = dtype

    def _write_tensors(self, tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None) -> None:  # type: ignore[override]
        """vLLM's writer (a static method there), in the configured dtype and with the key its name carries in its
        metadata (`key_from_name`): the file is whole before the lock goes."""
        try:
            event.synchronize()
            metadata = key_metadata(key_from_name(filename))
            save_file(encode(tensors, self._hidden_states_dtype), filename, metadata=metadata)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the client may read the file now

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """As vLLM's, except that a request asking for no hidden states (generation on the extraction server, for the
        regenerate stage) gets no file: without a recorded filename it has no lock file, `request_finished` saves
        nothing for it and its blocks are freed at once."""
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
            named = isinstance(meta, ExampleHiddenStatesConnectorMetadata)
            if ((extra or {}).get("kv_transfer_params") or {}).get(SKIP_HIDDEN_STATES):
                self._request_filenames.pop(new_req.req_id, None)
                if named:
                    meta.new_req_filenames.pop(new_req.req_id, None)  # type: ignore[attr-defined]
            elif new_req.req_id in self._request_filenames:
                # vLLM names the file after the request id, which a client sets (`request_id`, X-Request-Id): `../`
                # in it wrote anywhere the server's user may. The connector names every file itself, in its
                # storage folder, and ignores a `hidden_states_path` a request asks for.
                # The key the request's file is made under rides in its name to the writer (`_write_tensors`).
                key = ((extra or {}).get("kv_transfer_params") or {}).get(SAMPLE_KEY)
                filename = os.path.join(self._storage_path, name_with_key(server_file_name(), key))
                self._request_filenames[new_req.req_id] = filename
                if named:
                    meta.new_req_filenames[new_req.req_id] = filename  # type: ignore[attr-defined]
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request with no file (it asked for none, or was aborted before it was scheduled) saves nothing and
        holds no blocks back."""
        if request.request_id not in self._request_filenames:
            self._pending_saves.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's, told only of the finished requests whose save is submitted now or in flight: a request that
        delayed nothing (no file) must not be reported as sent, its blocks are free already."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        saving = {p.req_id for p in getattr(meta, "pending_saves", ())} | set(self._req_copy_events)
        for req_id in finished_req_ids - saving:
            lock_fd = self._lock_fds.pop(req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)
        return super().get_finished(finished_req_ids & saving)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # clone: the blocks are freed (and reused) once get_finished reports the request done.
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, "duplicate hidden-states request id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done: Any = _Done()  # in the slot vLLM's writer keeps a CUDA event in
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
