"""An asyncio loop in a thread of its own, on which blocking code runs coroutines: the stages' request windows, whose
requests to one server share one loop and one HTTP session whichever shard's thread sends them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the loop and wait for it (cancelled if this thread stops waiting)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def stop(self) -> None:
        """The loop stops and its thread ends (whatever still runs on it is dropped)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
