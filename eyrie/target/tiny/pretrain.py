"""Teach a tiny target the bundled demo conversations, so its greedy outputs are regular and a drafter has
something to learn (a random target's next token is noise, and acceptance would mean nothing).

The teaching is chaotic: 200 AdamW steps amplify a last-bit difference in any kernel into different weights. CPU
kernels differ from machine to machine (torch's vectorised kernels are picked by the CPU's ISA, AVX-512 or AVX2;
MKL's GEMMs by the CPU and the thread count), so the same seed taught on an AVX-512 Intel and on an AMD EPYC gave
two different targets, and the demo two different figures. So the teaching runs in a child process with fixed
numerics (`fixed_numerics_env`): torch's kernels at AVX2 (or the scalar default on a CPU without it), MKL's
conditional numerical reproducibility at the same branch, one thread. The weights are then the same bytes on every
x86 machine with AVX2 (`python -m eyrie.target.tiny.pretrain PATH` builds one and prints its hash).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def pretrain_on_demo_data(
    model, tokenizer, steps: int = 200, seq_len: int = 128, batch_size: int = 8, lr: float = 3e-3, seed: int = 0
) -> list[float]:
    """Causal-LM training on the chat-rendered demo conversations; returns the loss curve (every 50 steps)."""
    import torch

    from eyrie.target.tiny.demo_data import conversations

    stream: list[int] = []
    for row in conversations():
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(stream)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    curve = []
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        batch = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            curve.append(round(loss.item(), 4))
    model.eval()
    return curve


def cpu_has_avx2(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and " avx2" in line for line in cpuinfo.splitlines())


def fixed_numerics_env(environ: dict[str, str] | None = None, avx2: bool | None = None) -> dict[str, str]:
    """The environment whose CPU numerics are the same on every x86 machine of the same class (AVX2, or none):
    these variables must be set before torch and MKL load, hence a child process. They replace any the user set
    (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, thread counts), which would change the
    teaching's result."""
    env = dict(os.environ if environ is None else environ)
    avx2 = cpu_has_avx2() if avx2 is None else avx2
    env.update(
        ATEN_CPU_CAPABILITY="avx2" if avx2 else "default",
        MKL_CBWR="AVX2" if avx2 else "COMPATIBLE",
        MKL_ENABLE_INSTRUCTIONS="AVX2" if avx2 else "SSE4_2",
        ONEDNN_MAX_CPU_ISA="AVX2" if avx2 else "SSE41",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        MKL_DYNAMIC="FALSE",
    )
    return env


def build_taught_llama(path: Path, seed: int = 0, pretrain_steps: int = 200, **overrides) -> None:
    """Build the taught tiny Llama into `path` in a child process with fixed numerics (see the module's text)."""
    cmd = [sys.executable, "-m", "eyrie.target.tiny.pretrain", str(path), "--seed", str(seed)]
    cmd += ["--steps", str(pretrain_steps), "--overrides", json.dumps(overrides)]
    done = subprocess.run(cmd, env=fixed_numerics_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"teaching the tiny target into {path} failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )


def weights_hash(path: Path) -> str:
    import hashlib

    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()


def _main(argv: list[str] | None = None) -> None:
    import argparse

    from eyrie.target.tiny.llama import build_llama

    ap = argparse.ArgumentParser(description="Teach the tiny Llama the demo conversations (fixed numerics).")
    ap.add_argument("path", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--overrides", default="{}", help="LlamaConfig fields, as JSON")
    args = ap.parse_args(argv)
    if os.environ.get("MKL_CBWR") is None:  # run by hand: re-enter with the fixed numerics
        build_taught_llama(args.path, args.seed, args.steps, **json.loads(args.overrides))
    else:
        args.path.mkdir(parents=True, exist_ok=True)
        build_llama(args.path, seed=args.seed, pretrain_steps=args.steps, **json.loads(args.overrides))
    print(weights_hash(args.path))


if __name__ == "__main__":
    _main()
