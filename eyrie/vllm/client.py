"""The HTTP client of a server Eyrie started: hidden states for a prompt, generations, chat completions, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from eyrie.errors import ExtractionError, RequestRejected, ServerUnavailable
from eyrie.hidden_states.keyed import SAMPLE_KEY
from eyrie.run.files import atomic_write_json, read_json
from eyrie.vllm import phases
from eyrie.vllm.plugin import SKIP_HIDDEN_STATES
from eyrie.vllm.spec import GENERATION_CACHE_SALT

if TYPE_CHECKING:
    pass  # typing.Self is 3.11+; the package supports 3.10


def _backoff_s(attempt: int) -> float:
    """Seconds before a generation's retry `attempt` (1, 2, ...): 2, 4, 8, ... up to 30."""
    return min(2.0**attempt, 30.0)


class FirstAnswer:
    """Records once, in a server's `server.json`, when it first answered a request after it became ready: the
    `first request` and `ready to first answer` phases (`eyrie.vllm.phases.with_first_answer`). vLLM's log has no
    request lines, so the client that sent the request is the one that knows. Called after every answer; after the
    first it costs one attribute read."""

    def __init__(self, state_path: Path):
        self.state_path = Path(state_path)
        self.done = False
        self._lock = threading.Lock()

    def __call__(self, sent_at: float, answered_at: float) -> None:
        if self.done:
            return
        with self._lock:
            if self.done:
                return
            state = read_json(self.state_path)
            if not isinstance(state, dict):  # stopped, or never recorded: nothing to add to
                self.done = True
                return
            updated = phases.with_first_answer(state, sent_at, answered_at)
            if updated is None:
                self.done = phases.first_answer_recorded(state)  # recorded by another client; else try the next
                return
            try:
                atomic_write_json(self.state_path, updated)
            except OSError:  # advisory, as the other phases (a full disk must not fail a request that was answered)
                pass
            self.done = True


_WATCHED: dict[str, FirstAnswer] = {}  # base URL -> the server.json its first answer goes to, in this process


def watch_first_answer(base_url: str, state_path: Path) -> FirstAnswer:
    """From now on, the first answer any ServerClient of this process gets from `base_url` after the server became
    ready is recorded in `state_path` (the clients that extraction and regeneration build from the URL alone
    included). Called where the server is started or reused (tasks/serving.py)."""
    recorder = FirstAnswer(state_path)
    _WATCHED[base_url] = recorder
    return recorder


class ServerClient:
    """Talks to a server Eyrie started: hidden states for a prompt, generations, chat completions, Prometheus
    metrics."""

    def __init__(self, base_url: str, api_key: str | None = None, connections: int = 10):
        self.base_url = base_url
        self.session = requests.Session()
        # One pooled connection per request in flight: past the pool's size urllib3 opens and drops extra ones.
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=connections))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def _answered(self, sent_at: float) -> None:
        """After each answered request: the server's first answer once ready is recorded (`watch_first_answer`)."""
        if (recorder := _WATCHED.get(self.base_url)) is not None:
            recorder(sent_at, time.time())

    @staticmethod
    def _extract_body(token_ids: list[int], key: str | None = None) -> dict[str, Any]:
        """`key`: the one the file is made under, which Eyrie's connector records in it (eyrie.hidden_states.keyed)."""
        body: dict[str, Any] = {"model": "target", "prompt": token_ids, "max_tokens": 1, "return_token_ids": True}
        if key:
            body["kv_transfer_params"] = {SAMPLE_KEY: key}
        return body

    @staticmethod
    def _hidden_states_path(status: int, text: str, out: dict | None, token_ids: list[int]) -> str:
        """The checks of an extraction answer (`extract` and `async_extractor` alike); the file's path."""
        if status != 200 or out is None:
            raise ExtractionError(f"vLLM answered {status}: {text[:300]}")
        prompt_ids = out["choices"][0].get("prompt_token_ids")
        if prompt_ids is not None and prompt_ids != token_ids:
            raise ExtractionError("vLLM echoed different prompt token ids than were sent")
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ExtractionError(
                "vLLM's answer has no kv_transfer_params.hidden_states_path: is the server "
                "running the extract_hidden_states method with Eyrie's connector?"
            )
        return path

    def extract(self, token_ids: list[int], timeout_s: float, key: str | None = None) -> str:
        sent = time.time()
        body = self._extract_body(token_ids, key)
        r = self.session.post(self.base_url + "/v1/completions", json=body, timeout=timeout_s)
        ok = r.status_code == 200
        if ok:
            self._answered(sent)
        return self._hidden_states_path(r.status_code, "" if ok else r.text, r.json() if ok else None, token_ids)

    def extract_ranked(
        self, token_ids: list[int], timeout_s: float, top_k: int
    ) -> tuple[str, list[tuple[list[int], list[float]] | None]]:
        """`extract` that also asks the server for its own ranking at every prompt position, from the same forward
        pass that captured the states (`prompt_logprobs`): the capture proof's reference
        (eyrie.hidden_states.proof). Returns the file's path and, per position, None at position 0 (nothing
        predicts the first token) then (the server's `top_k` token ids, best first; their log-probabilities): the
        ranking at position p is the server's prediction of token p from tokens before it. Shards use `extract`,
        which asks for no ranking (no cost to extraction's throughput)."""
        sent = time.time()
        body = {**self._extract_body(token_ids), "prompt_logprobs": top_k}
        r = self.session.post(self.base_url + "/v1/completions", json=body, timeout=timeout_s)
        ok = r.status_code == 200
        if ok:
            self._answered(sent)
        out = r.json() if ok else None
        path = self._hidden_states_path(r.status_code, "" if ok else r.text, out, token_ids)
        assert out is not None  # checked by _hidden_states_path
        return path, self.ranking(out["choices"][0].get("prompt_logprobs"), len(token_ids), top_k)

    @staticmethod
    def ranking(
        prompt_logprobs: list[dict | None] | None, length: int, top_k: int
    ) -> list[tuple[list[int], list[float]] | None]:
        """vLLM's `prompt_logprobs` answer (per position None or {token id: {logprob, rank, decoded_token}}: the
        top `top_k` and the prompt's own token, which may rank below them) as [None, (ids best first, logprobs),
        ...]: the entries ranked within `top_k`, by log-probability (then rank)."""
        if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) != length:
            got = "none" if prompt_logprobs is None else f"{len(prompt_logprobs)} positions"
            raise ExtractionError(
                f"vLLM's answer carries no ranking for the {length} prompt positions (prompt_logprobs: {got})"
            )
        out: list[tuple[list[int], list[float]] | None] = [None]
        for entry in prompt_logprobs[1:]:
            if not isinstance(entry, dict) or not entry:
                raise ExtractionError("vLLM's prompt_logprobs has a position without a ranking")
            ranked = [
                (float(v["logprob"]), int(v.get("rank") or 0), int(k))
                for k, v in entry.items()
                if v.get("rank") is None or int(v["rank"]) <= top_k
            ]
            ranked.sort(key=lambda x: (-x[0], x[1]))
            ranked = ranked[:top_k]
            out.append(([t for _, _, t in ranked], [lp for lp, _, _ in ranked]))
        return out

    @contextlib.asynccontextmanager
    async def async_extractor(
        self, connections: int
    ) -> AsyncIterator[Callable[[list[int], float, str | None], Awaitable[str]]]:
        """`extract` as a coroutine, on one aiohttp session of `connections` pooled connections: what the extraction
        loop uses (eyrie.stages.extract), where a thread per request in flight spent several times the CPU per request
        (requests' layers and the GIL) on the cores the server needs."""
        import aiohttp  # a dependency of datasets (fsspec[http]) and of vLLM

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections),
            headers={k: v for k, v in self.session.headers.items() if k == "Authorization"},
        ) as session:

            async def extract(token_ids: list[int], timeout_s: float, key: str | None = None) -> str:
                sent = time.time()
                async with session.post(
                    self.base_url + "/v1/completions",
                    json=self._extract_body(token_ids, key),
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as r:
                    ok = r.status == 200
                    text = "" if ok else await r.text()
                    out = await r.json() if ok else None
                    if ok:
                        self._answered(sent)
                    return self._hidden_states_path(r.status, text, out, token_ids)

            yield extract

    @staticmethod
    def _generate_body(
        token_ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "target",
            "prompt": token_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "return_token_ids": True,
            "cache_salt": GENERATION_CACHE_SALT,
            "kv_transfer_params": {SKIP_HIDDEN_STATES: True},
        }
        if seed is not None:
            body["seed"] = seed
        return body

    @staticmethod
    def _generation(answer: dict, token_ids: list[int]) -> dict:
        """The answer of a 200: its generated ids and finish reason, or ServerUnavailable where it has none."""
        choice = answer["choices"][0]
        if choice.get("prompt_token_ids") not in (None, token_ids):
            raise ServerUnavailable("vLLM echoed different prompt token ids than were sent")
        if choice.get("finish_reason") not in ("stop", "length") or choice.get("token_ids") is None:
            # Aborted (a server shutting down) or a vLLM that does not return ids: not this row's fault.
            raise ServerUnavailable(
                f"vLLM answered finish_reason {choice.get('finish_reason')!r} with token_ids "
                f"{'missing' if choice.get('token_ids') is None else 'present'} (return_token_ids needs vLLM "
                ">= 0.10.2)"
            )
        return {"token_ids": list(choice["token_ids"]), "finish_reason": choice["finish_reason"]}

    def _generation_or_retry(self, status: int, payload: Any, token_ids: list[int], sent: float) -> dict | Exception:
        """A generation request's answer by its status, for both forms of `generate`: a 200's generation (`payload`
        its JSON), a 5xx's RequestRejected returned to be retried, a 4xx's raised (`payload` its text)."""
        if status >= 500:
            return RequestRejected(status, payload)
        if status != 200:
            raise RequestRejected(status, payload)
        self._answered(sent)
        return self._generation(payload, token_ids)

    def generate(
        self,
        token_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        timeout_s: float,
        retries: int = 2,
    ) -> dict:
        """One completion of a token-id prompt for the regenerate stage: `token_ids` (the ids vLLM generated, as it
        generated them) and `finish_reason`. On the extraction server it writes no hidden-states file (Eyrie's
        connector skips requests that ask it to) and its prefix-cache blocks carry a salt of their own, so an
        extraction request never reuses blocks a generation computed. A 5xx or a dropped connection is retried
        `retries` times; then a 4xx or 5xx raises RequestRejected (the row is counted) and no answer at all raises
        ServerUnavailable (the shard fails). `async_generator` is the same as a coroutine."""
        body = self._generate_body(token_ids, max_tokens, temperature, top_p, seed)
        failure: Exception = ServerUnavailable(f"no request was sent to {self.base_url}")
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(_backoff_s(attempt))
            sent = time.time()
            try:
                r = self.session.post(self.base_url + "/v1/completions", json=body, timeout=timeout_s)
            except requests.RequestException as err:
                failure = ServerUnavailable(f"no answer from vLLM at {self.base_url}: {err}")
                continue
            payload = r.json() if r.status_code == 200 else r.text
            out = self._generation_or_retry(r.status_code, payload, token_ids, sent)
            if isinstance(out, Exception):
                failure = out
                continue
            return out
        raise failure

    @contextlib.asynccontextmanager
    async def async_generator(self) -> AsyncIterator[Callable[..., Awaitable[dict]]]:
        """`generate` as a coroutine (same arguments, answers and errors), on one aiohttp session: what regeneration
        uses (eyrie.stages.regenerate.window), for the reason `async_extractor` gives. Its connections are not
        limited here: the caller bounds the requests in flight."""
        import aiohttp

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers={k: v for k, v in self.session.headers.items() if k == "Authorization"},
        ) as session:

            async def generate(
                token_ids: list[int],
                max_tokens: int,
                temperature: float,
                top_p: float,
                seed: int | None,
                timeout_s: float,
                retries: int = 2,
            ) -> dict:
                body = self._generate_body(token_ids, max_tokens, temperature, top_p, seed)
                failure: Exception = ServerUnavailable(f"no request was sent to {self.base_url}")
                for attempt in range(retries + 1):
                    if attempt:
                        await asyncio.sleep(_backoff_s(attempt))
                    sent = time.time()
                    try:
                        async with session.post(
                            self.base_url + "/v1/completions",
                            json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout_s),
                        ) as r:
                            status = r.status
                            # the JSON whatever the Content-Type header says
                            payload = await r.json(content_type=None) if status == 200 else await r.text()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                        failure = ServerUnavailable(f"no answer from vLLM at {self.base_url}: {err!r}")
                        continue
                    out = self._generation_or_retry(status, payload, token_ids, sent)
                    if isinstance(out, Exception):
                        failure = out
                        continue
                    return out
                raise failure

            yield generate

    def chat(self, messages: list[dict], max_tokens: int, timeout_s: float = 600) -> dict:
        body: dict[str, Any] = {"model": "target", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        sent = time.time()
        r = self.session.post(self.base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        self._answered(sent)
        return r.json()

    def metrics(self) -> str:
        r = self.session.get(self.base_url + "/metrics", timeout=30)
        r.raise_for_status()
        return r.text
