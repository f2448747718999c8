"""Capture one sample per target in ONE process: vLLM's engine built in-process from each extraction server's own
arguments, one target after the other (tests/integration/test_extraction_correctness.py runs it in the background;
`capture` runs it to its end, for test_capture_contracts.py).

A server start on two cores costs two interpreters importing torch and vLLM (its API server and its engine core,
45-100 s in the suite); here the imports are paid once and each further target costs its engine's build (4-9 s).
The engine is the one a server runs: the same arguments (parsed by the installed vLLM's `vllm serve` parser), the
same model runner, Eyrie's plugin (connector, compatibility layer, the CPU platform's in-process model inspection)
loaded by vLLM itself. What a server adds, its HTTP front end, is the same for every target: the test keeps one
target on a real server.

    python tests/engine_capture.py JOBS.json RESULTS.jsonl

JOBS.json: [{"name", "arguments": [server arguments], "token_ids": [...]}]. One line per job in RESULTS.jsonl, as
it finishes: {"name", "path"} (the file the connector wrote) or {"name", "error"} (this target could not be built
in this process: the extraction-correctness test starts a server for it, and the jobs after it in a fresh process).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _flush(llm, path: str, timeout_s: float = 120) -> None:
    """Step the engine until the connector has written `path` whole. A server's engine loop keeps stepping after it
    answers, and the connector saves a finished request's states on a later step; `generate` stops stepping once
    the answer is out."""
    from eyrie.stages.extract.answered import _wait_and_release

    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the connector wrote no {path} within {timeout_s:.0f} s")
        llm.llm_engine.step()
        time.sleep(0.01)
    _wait_and_release(path)


def main(jobs_path: str, results_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    from eyrie.stages.preflight.installed_vllm import parse_server_arguments
    from eyrie.vllm.plugin.fork import scan_only_plain_namespaces

    # Kimi's vision processor imports numba, whose llvmlite objects vLLM 0.32's kernel scan cannot read.
    scan_only_plain_namespaces()

    with open(jobs_path) as f:
        jobs = json.load(f)
    with open(results_path, "a") as out:
        for job in jobs:
            try:
                engine_args = EngineArgs.from_cli_args(parse_server_arguments(job["arguments"]))
                llm = LLM(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)})
                try:
                    (answer,) = llm.generate(
                        [TokensPrompt(prompt_token_ids=job["token_ids"])], SamplingParams(max_tokens=1), use_tqdm=False
                    )
                    if list(answer.prompt_token_ids) != job["token_ids"]:
                        raise RuntimeError("the engine saw other prompt token ids than were sent")
                    path = (answer.kv_transfer_params or {})["hidden_states_path"]
                    _flush(llm, path)
                    result = {"name": job["name"], "path": path}
                finally:
                    del llm
                    gc.collect()  # frees the engine's KV cache before the next target's
                    destroy_model_parallel()
                    destroy_distributed_environment()
            except Exception:  # noqa: BLE001  (reported to the test, which serves this target instead)
                # A failed build can leave this process unfit for the next (vLLM 0.32's kernel scan breaks on any
                # module it imported, numba's for one): stop here, the caller goes on in a fresh process.
                out.write(json.dumps({"name": job["name"], "error": traceback.format_exc(limit=8)[-3000:]}) + "\n")
                return 3
            out.write(json.dumps(result) + "\n")
            out.flush()
    return 0


def capture(jobs: list[dict], root: Path, env: dict, timeout_s: float = 900) -> dict[str, dict]:
    """Run this script over `jobs` in a process of its own, to its end: each job's line by name (a build that
    failed stops the process: the jobs after it have none). Its output is in `root/engine.log`."""
    import subprocess

    root.mkdir(parents=True, exist_ok=True)
    (root / "jobs.json").write_text(json.dumps(jobs))
    results = root / "results.jsonl"
    with open(root / "engine.log", "wb") as log:
        subprocess.run(
            [sys.executable, __file__, str(root / "jobs.json"), str(results)],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    return read_results(results)


def read_results(path: Path) -> dict[str, dict]:
    """The jobs' lines written to `path` so far, by name (a line still being written has no newline yet)."""
    text = path.read_text() if path.exists() else ""
    return {r["name"]: r for r in map(json.loads, text.split("\n")[:-1])}


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (the offline engine's)
    sys.exit(main(*sys.argv[1:]))
