"""Imported first by the benchmarks that start vLLM: the Makefile's cache locations (inside the repo's ignored
.cache), offline, a small CPU KV cache; each only where the caller's environment does not set it already."""

import os
from pathlib import Path

for _var, _value in {
    "HF_HOME": ".cache/hf",
    "VLLM_CACHE_ROOT": ".cache/vllm",
    "TORCHINDUCTOR_CACHE_DIR": ".cache/inductor",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}.items():
    os.environ.setdefault(_var, str(Path(_value).resolve()) if _value.startswith(".") else _value)
