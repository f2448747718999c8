"""Does the demo's figure depend on the machine? The tiny target's teaching and the whole demo under CPU settings
that stand in for other machines: torch's kernels at a lower ISA (ATEN_CPU_CAPABILITY), MKL's
(MKL_ENABLE_INSTRUCTIONS), and the thread count (OMP_NUM_THREADS).

    .venv/bin/python benchmarks/demo_stability.py teach            # the taught target's weight hash per setting
    .venv/bin/python benchmarks/demo_stability.py demo [--settings native,avx2]   # the demo per setting

`teach` builds the demo target once per setting: one hash for all of them is what makes the demo's target the same
on every machine. It also builds it the old way (in this process's numerics, as Eyrie did before the teaching moved
to a child process with fixed numerics) to show the hazard. `demo` runs `eyrie run --config configs/demo.yaml` per
setting into a fresh run folder under --work (with its own target folder) and prints the acceptance length, per
position, drafts and the standard error. ATEN_CPU_CAPABILITY reaches the vLLM server through $EYRIE_PASS_ENV.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "native": {"OMP_NUM_THREADS": "2"},
    "native-1thread": {"OMP_NUM_THREADS": "1"},
    # Not ONEDNN_MAX_CPU_ISA: vLLM's CPU attention picks its brgemm path from the CPU itself, and on an AMX CPU
    # a oneDNN capped below AMX kills the server ("BFloat16 Brgemm VNNI format is only supported ... when `amx`").
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OMP_NUM_THREADS": "1",
        "EYRIE_PASS_ENV": "ATEN_CPU_CAPABILITY",
    },
    "default-isa": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "OMP_NUM_THREADS": "2",
        "EYRIE_PASS_ENV": "ATEN_CPU_CAPABILITY",
    },
}
OLD_WAY = """
import sys
from pathlib import Path
from eyrie.target.tiny.llama import build_llama
from eyrie.target.tiny.pretrain import weights_hash
p = Path(sys.argv[1]); p.mkdir(parents=True, exist_ok=True)
build_llama(p, seed=0, pretrain_steps=200)
print(weights_hash(p))
"""
NEW_WAY = """
import sys
from eyrie.target.tiny import build_target
from eyrie.target.tiny.pretrain import weights_hash
print(weights_hash(build_target("tiny-llama-chat", sys.argv[1])))
"""


def _env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(SETTINGS[name])
    return env


def teach(work: Path, settings: list[str], old_way: bool) -> list[dict]:
    rows = []
    for name in settings:
        for way, code in [("fixed numerics", NEW_WAY)] + ([("in-process (old)", OLD_WAY)] if old_way else []):
            out = work / f"teach-{name}-{'old' if code is OLD_WAY else 'new'}"
            shutil.rmtree(out, ignore_errors=True)
            t = time.time()
            done = subprocess.run(
                [sys.executable, "-c", code, str(out)], env=_env(name), capture_output=True, text=True, check=True
            )
            rows.append(
                {"setting": name, "teaching": way, "sha256": done.stdout.split()[-1][:16], "s": round(time.time() - t)}
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def demo(work: Path, settings: list[str], config: Path) -> list[dict]:
    rows = []
    for name in settings:
        run_dir, target = work / f"demo-{name}", work / f"target-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        text = config.read_text().replace(".cache/targets/tiny-llama-chat", str(target))
        cfg = work / f"demo-{name}.yaml"
        cfg.write_text(text)
        t = time.time()
        cmd = [str(ROOT / ".venv/bin/eyrie"), "run", "--config", str(cfg), "--run-dir", str(run_dir)]
        subprocess.run(cmd, env=_env(name), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        res = json.loads((run_dir / "evaluate" / "trained.json").read_text())
        pooled = res["statistics"]["pooled"]["acceptance_length"]
        rows.append(
            {
                "setting": name,
                "acceptance_length": res["acceptance_length"],
                "per_position": res["per_position_acceptance"],
                "drafts": res["drafts"],
                "prompts": res["prompts"],
                "se": pooled["se"],
                "ci95": pooled["ci95"],
                "s": round(time.time() - t),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["teach", "demo"])
    ap.add_argument("--settings", default="native,avx2", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--work", type=Path, default=Path("/tmp/eyrie-demo-stability"))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    ap.add_argument("--old-way", action="store_true", help="teach also in this process's numerics (the old way)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    settings = [s for s in args.settings.split(",") if s]
    rows = teach(args.work, settings, args.old_way) if args.what == "teach" else demo(args.work, settings, args.config)
    if args.what == "teach":
        fixed = {r["sha256"] for r in rows if r["teaching"] == "fixed numerics"}
        print(f"fixed-numerics teaching: {len(fixed)} distinct weight hash(es) over {len(settings)} settings")


if __name__ == "__main__":
    main()
