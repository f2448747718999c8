"""speculators' dataset with its on-missing `generate` path pointed at Eyrie's extraction server (see
eyrie.stages.train.online).

What differs from speculators' stock `ArrowDataset`:

- the model: speculators passes the verifier's path as the model name and refuses a server serving another name;
  Eyrie serves the target as `target` (`--served-model-name`), so that is the name checked;
- the API key: speculators always sends `EMPTY`; Eyrie's server requires a key off loopback
  (`extraction.api_key_env`), read here from the variable it names, which the trainer inherits;
- a batch's samples are asked for concurrently (`__getitems__`, `extraction.concurrency` in flight), each through
  speculators' own per-sample path; speculators asks for them one after another, a round trip each;
- the wait for the connector's writer polls every 2 ms instead of 100 ms (speculators' `wait_for_lock`), with the
  same 10 s limit: the connector's writer thread finishes the file around the time the answer arrives, and a
  100 ms poll that just missed it costs up to 100 ms of a sample's round trip.

The class lives at module level so spawned loader workers unpickle it by name.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from hs_connectors import transfer
from speculators.train.data import ArrowDataset

SERVED_MODEL_NAME = "target"  # eyrie.vllm.spec.ServerSpec.arguments: --served-model-name target


def wait_for_lock(lock_path: str, timeout: float = 10.0, poll_interval: float = 0.002) -> None:
    """hs_connectors' `wait_for_lock` (take the writer's lock once it lets go, then remove the lock file), polling
    every 2 ms rather than 100 ms."""
    fd = os.open(lock_path, os.O_RDWR)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"Timed out waiting for lock: {lock_path}") from None
                time.sleep(poll_interval)
    finally:
        os.close(fd)
    os.remove(lock_path)


# Module level, so a spawned loader worker (which imports this module to unpickle its dataset) has them too.
transfer.wait_for_lock = wait_for_lock
logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line in train.log per sample and epoch


class OnlineDataset(ArrowDataset):
    # Set on the class by eyrie.stages.train.entry before the loaders are built.
    api_key_env: str | None = None
    concurrency: int = 8

    def __init__(self, *args, **kwargs):
        kwargs["model"] = SERVED_MODEL_NAME
        super().__init__(*args, **kwargs)
        # Instance attributes: they travel to spawned workers with the dataset.
        self.api_key_env = type(self).api_key_env
        self.concurrency = type(self).concurrency
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pool"] = None  # threads do not pickle; each worker makes its own
        return state

    def __getitems__(self, indices: list[int]) -> list:
        """A packed batch's samples (torch's loader calls this when defined), each from speculators' own
        `__getitem__`, `concurrency` at a time, in order."""
        if len(indices) < 2 or self.concurrency < 2:
            return [self[i] for i in indices]
        if not self.client:
            self._setup_client()  # once, before the threads share it
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="eyrie-online")
        return list(self._pool.map(self.__getitem__, indices))

    def _setup_client(self):
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        client = openai.OpenAI(base_url=self.vllm_endpoint, api_key=key or "EMPTY", max_retries=0)
        served = [m.id for m in client.models.list().data]
        if self.model not in served:
            raise ValueError(
                f"the server at {self.vllm_endpoint} serves {served}, not {self.model!r}: is it Eyrie's extraction "
                "server for this target?"
            )
        self.transfer.setup()
        self.client = client
