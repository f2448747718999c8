"""Online hidden states (`train.hidden_states: online`): the trainer asks the running extraction server for each
sample's hidden states as it trains, and nothing is kept on disk.

It is speculators' own on-missing `generate` path (`speculators.train.data.ArrowDataset` with `--on-missing
generate`), pointed at Eyrie's extraction server: the request is the one Eyrie's extraction sends (`/v1/completions`
with the prompt as token ids, `max_tokens` 1, `return_token_ids`), Eyrie's connector (a subclass of vLLM's example
hidden-states connector) answers with `kv_transfer_params.hidden_states_path`, and speculators' `FileTransfer` waits
on the file's lock, loads it, checks token ids, shape and finiteness, and deletes the file and its lock. The only
differences from speculators' stock client are in `eyrie.stages.train.online_dataset`: the served model name (`target`)
and the
server's API key.

The server writes those transient files to its storage path, which in online mode is on tmpfs (`/dev/shm`, or
`$EYRIE_ONLINE_TMPFS`), so no hidden-state byte reaches a persistent disk. Requests in flight when a trainer is
killed leave files behind; `clean` removes them before the trainer (re)starts and after it ends.

Resuming is the offline mode's: speculators' checkpoint (epoch, step, optimizer) plus its data order, which is a
function of the seed and the epoch (the packing sampler), so a resumed run skips the batches it trained on without
asking the server for them and asks for the rest in the same order. The server is reused when it is still up (it
runs in its own process group and outlives a killed flow) and started again otherwise.

This module imports nothing heavy: the flow and the unit tests use it without torch or speculators.
"""

from __future__ import annotations

from pathlib import Path

# train_entry's switch: replace speculators' dataset with eyrie.stages.train.online_dataset.OnlineDataset.
ONLINE_FLAG = "--eyrie-online"
# ... and the variable holding the server's API key, when it has one (the key itself never goes on a command line).
API_KEY_ENV_FLAG = "--eyrie-online-api-key-env"
CONCURRENCY_FLAG = "--eyrie-online-concurrency"  # a packed batch's samples asked for at once (extraction.concurrency)


def endpoint(base_url: str) -> str:
    """speculators' `--vllm-endpoint` (the OpenAI client's base URL) for a server's base URL."""
    return base_url.rstrip("/") + ("" if base_url.rstrip("/").endswith("/v1") else "/v1")


def online_args(
    base_url: str, staging: Path, request_timeout_s: float, api_key_env: str | None, concurrency: int = 8
) -> list[str]:
    """The trainer's arguments for online hidden states (replacing the offline `--on-missing raise`).

    `--hidden-states-path` is the server's tmpfs staging folder: speculators first looks there for a cached
    `hs_<i>.safetensors`, which never exists (the server names files by request id), and then generates."""
    args = [
        "--hidden-states-path",
        str(staging),
        "--on-missing",
        "generate",
        "--vllm-endpoint",
        endpoint(base_url),
        "--request-timeout",
        str(request_timeout_s),
        # A sample that failed every attempt (3 HTTP retries, 3 whole round trips) fails the run, which resumes from
        # its checkpoint: speculators' default (20 in a row) trains on without up to 19 samples, silently.
        "--max-consecutive-generation-failures",
        "1",
        ONLINE_FLAG,
        CONCURRENCY_FLAG,
        str(concurrency),
    ]
    if api_key_env:
        args += [API_KEY_ENV_FLAG, api_key_env]
    return args
