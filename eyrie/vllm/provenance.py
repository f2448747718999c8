"""What a measurement was measured under: the vLLM version, the model runner, the attention backend and the serving
arguments of the server that measured it (`served_under`).

Two acceptance figures compare only when they were measured under the same of these (vLLM's own acceptance test
reruns its reference at every change for this reason): a new vLLM, the other model runner (V1 or V2, which vLLM
picks from what is installed), another attention backend (which vLLM picks from the hardware and the environment)
or another output-shaping argument (dtype, context, eager or compiled, tensor parallelism, `server_args` and
`server_env` as `eyrie.run.identity` counts them) changes the numerics and so the acceptance, by a few percent or by
more. The runner and the backend are what vLLM chose, read from the server's own log (its last start); where the
log does not name one (vLLM's CPU platform logs no attention backend for a model without MLA, it has one), it is
recorded as None, the same for every server of that build.
"""

from __future__ import annotations

import importlib.metadata
import re

from eyrie.vllm.phases import LOAD_START, last_start

VERSION = (re.compile(r"LLM engine \(v([^)\s]+)\)"), re.compile(r"\bversion (\d+\.\d+[^\s]*)"))
# "[cpu_model_runner.py:68] Starting to load model ..." (V1: gpu_model_runner, cpu_model_runner, ...; V2: the
# model_runner.py of vllm/v1/worker/gpu)
RUNNER = re.compile(r"\[([a-z0-9_]*model_runner)\.py:\d+\][^\n]*" + re.escape(LOAD_START))
RUNNER_V1_FALLBACK = re.compile(r"using the V1 model runner instead", re.IGNORECASE)
# "Using FLASH_ATTN attention backend out of potential backends: [...]", "Using CPU_MLA backend.",
# "Using TRITON_ATTN backend (selected via --attention-backend)."
BACKEND = re.compile(r"\bUsing ([A-Z][A-Z0-9_]+) (?:attention )?backend\b")
# Reporting only: how the acceptance is returned, not what is computed.
REPORTING_FLAGS = ("--per-request-spec-decode-metrics",)

FIELDS = ("vllm_version", "model_runner", "attention_backend", "serving")


def installed_vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def serving_arguments(spec) -> dict:
    """The spec's arguments that shape what the server computes (not its host, port, key, memory or scheduling)."""
    from eyrie.run.identity import SCHEDULING_FLAGS, output_server_args, output_server_env

    return {
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "enforce_eager": spec.enforce_eager,
        "num_speculative_tokens": spec.num_speculative_tokens if spec.drafter else None,
        "server_args": output_server_args(spec.server_args, SCHEDULING_FLAGS | set(REPORTING_FLAGS)),
        "server_env": output_server_env(spec.server_env),
    }


def served_under(log_text: str, spec) -> dict:
    """The vLLM version, model runner, attention backend(s) and serving arguments of the server whose log (its last
    start) is `log_text`, started from `spec`."""
    text, _, _ = last_start(log_text)
    version = next((m.group(1) for rx in VERSION if (m := rx.search(text))), None) or installed_vllm_version()
    runner = None
    if m := RUNNER.search(text):
        runner = m.group(1)
        if runner != "model_runner" and RUNNER_V1_FALLBACK.search(text):
            runner += " (V1; vLLM fell back from V2)"
        elif runner == "model_runner":
            runner = "model_runner (V2)"
    backends = list(dict.fromkeys(BACKEND.findall(text)))
    return {
        "vllm_version": version,
        "model_runner": runner,
        "attention_backend": ", ".join(backends) if backends else None,
        "serving": serving_arguments(spec),
    }


def differences(a: dict | None, b: dict | None) -> list[str]:
    """What differs between two `served_under` records, each as 'field: a vs b'; a record missing (a measurement
    from before they were kept) differs in every field."""
    if a is None or b is None:
        if a is None and b is None:
            return []
        return ["one measurement records no server (made before Eyrie recorded it)"]
    out = []
    for name in FIELDS:
        if name == "serving":
            sa, sb = a.get("serving") or {}, b.get("serving") or {}
            out += [f"{k}: {sa.get(k)!r} vs {sb.get(k)!r}" for k in sorted({*sa, *sb}) if sa.get(k) != sb.get(k)]
        elif a.get(name) != b.get(name):
            out.append(f"{name}: {a.get(name)!r} vs {b.get(name)!r}")
    return out
