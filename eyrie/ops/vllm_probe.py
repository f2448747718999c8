"""`python -m eyrie.ops.vllm_probe`: what the flow asks of vLLM, answered in the environment that has it.

Run by the interpreter $EYRIE_VLLM_PYTHON names (`eyrie.run.vllm_python.probe`) when that is not the flow's own, so the
flow never imports vLLM. It reads one JSON request on stdin and writes one JSON answer as the last line of stdout
(everything vLLM and the libraries print goes to stderr). Requests, by `op`:

- `check_target` (`config`: the pipeline config as JSON, `serve`): preflight's verdict on the target, this vLLM and
  the config (`eyrie.stages.preflight.check.check_target`), as the report's fields;
- `drafter_flags`: the speculators config keys this vLLM's EAGLE-3 adapter reads (`eyrie.stages.export`).

An error is answered as {"error": "..."}; a crash exits non-zero with its traceback on stderr.
"""

from __future__ import annotations

import json
import os
import sys


def answer(request: dict) -> dict:
    op = request.get("op")
    if op == "check_target":
        from eyrie.config import PipelineConfig
        from eyrie.stages.preflight.check import check_target

        config = PipelineConfig.model_validate(request["config"])
        return {"report": check_target(config, bool(request.get("serve", True))).as_dict()}
    if op == "drafter_flags":
        from eyrie.stages.export import flags_vllm_reads

        return {"flags": sorted(flags_vllm_reads())}
    return {"error": f"unknown probe request {op!r}: this environment's Eyrie may be another version than the flow's"}


def main() -> None:
    from eyrie.run.vllm_python import answer_here

    answer_here()  # this interpreter is the vLLM environment, whatever $EYRIE_VLLM_PYTHON names (a wrapper of it)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's and the libraries' prints go to stderr; the answer alone to stdout
    sys.stdout = sys.stderr
    result = answer(json.loads(sys.stdin.read() or "{}"))
    out.write(json.dumps(result) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
