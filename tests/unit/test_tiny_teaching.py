"""The demo target's teaching runs with fixed CPU numerics, so every machine builds the same weights.

The full proof (200 steps under AVX-512 and AVX2 kernels, one and two threads: one hash) is
benchmarks/demo_stability.py; these check the parts that make it so, cheaply.
"""

from __future__ import annotations

import subprocess
import sys

from eyrie.target.tiny import build_target
from eyrie.target.tiny.pretrain import cpu_has_avx2, fixed_numerics_env, weights_hash


def test_fixed_numerics_replace_what_the_user_set():
    user = {"ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": "2", "MKL_ENABLE_INSTRUCTIONS": "AVX512", "X": "1"}
    env = fixed_numerics_env(user, avx2=True)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "AVX2"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and env["X"] == "1"
    bare = fixed_numerics_env(user, avx2=False)
    assert bare["ATEN_CPU_CAPABILITY"] == "default" and bare["MKL_CBWR"] == "COMPATIBLE"


def test_avx2_read_from_the_cpu_flags():
    assert cpu_has_avx2("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert not cpu_has_avx2("processor\t: 0\nflags\t\t: fpu sse2 avx\n")
    assert not cpu_has_avx2("")


def test_the_teaching_child_takes_the_fixed_numerics(tmp_path, monkeypatch):
    """The teaching runs where the user's ISA and thread settings cannot reach it: the same weights under two
    different outer settings, and a folder of an older recipe is built again."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"
    child = subprocess.run([sys.executable, "-c", probe], env=fixed_numerics_env(), capture_output=True, text=True)
    assert child.stdout.split() == (["AVX2", "1"] if cpu_has_avx2() else ["DEFAULT", "1"]), child.stderr
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / ".complete").write_text("tiny-llama-chat\n")  # an older recipe's marker
    (stale / "model.safetensors").write_bytes(b"old")
    hashes = []
    for path, isa, threads in [(tmp_path / "new", "default", "2"), (stale, "avx2", "1")]:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", isa)
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        hashes.append(weights_hash(build_target("tiny-llama-chat", path, pretrain_steps=3)))
    assert hashes[0] == hashes[1]
