"""Train-stage throughput on one GPU: Eyrie's exact train command against the bare EAGLE-3 model step.

At Kimi-K2.5 dimensions (hidden 7168, target vocabulary 163840, draft vocabulary 32000, packed 4096 tokens, TTT 3)
this builds a synthetic run folder in the layout Eyrie's stages write, then measures, in one run:

  step    the bare model step: speculators' Eagle3DraftModel at the draft geometry Eyrie builds
          (`eyrie.target.drafter.draft_layer_config`), bf16 weights, fused AdamW, flex attention, eager loss,
          synthetic
          GPU-resident inputs (as ../shared/bench/eagle3_train_step.py). `--master fp32 --clip --opt X` gives the
          trainer's own math (fp32 weights under bf16 autocast, gradient clipping, optimizer X) on the same inputs;
          `--trainer-norms` adds the two norms speculators' CLI turns on for eagle3, `--shifted-docs` packs the
          documents as the trainer's batches hold them (2047 tokens each after the shift, then padding, so their
          boundaries miss flex attention's 128-token blocks), `--eyrie-patches` applies eyrie.stages.train.entry's
          sync-free accuracy and loss scalars, `--bf16-weights` (with `--master fp32`) its bfloat16 working copies
          of the float32 weights (BF16_WEIGHTS). `--iters` steps are timed (20: a 2 s burst; the trainer's window
          is 20-25 s at the GPU's sustained clock); GPU clocks and power (nvidia-smi, and NVML's energy
          counter: `energy_W`, `joules_per_step`) are sampled over them. The tensors the drafter borrows from the
          target (embedding, both heads) are finite, as the trainer's (`--verifier-weights finite`); built bare,
          speculators leaves them NaN, and a step on NaN draws ~470 W against ~680 W, so the GPU keeps ~1930 MHz
          under its 700 W cap instead of ~1650: `--verifier-weights finite,nan` (all's default) times both in one
          process, `bare-nan` being the bare step as measured up to 2026-12-01.
  eyrie   the command `eyrie.stages.train.trainer.training_command()` builds from the Kimi preset pointed at the
  synthetic target,
          run as Eyrie runs it (a subprocess with its trainer-options.json), reading the hidden-state files; tokens/s
          between logged steps after warm-up (real tokens, as speculators counts them), the time from launch to
          the first step and where it went, GPU utilisation, clocks and CPU load sampled alongside. The same argv
          goes through `_bench_entry` (`--exact`: the command itself), whose hooks change nothing the trainer
          does: start-up marks (imports, build, loaders, first batch, first step), the loop's wait for each batch,
          host time per step and collector pauses every 25 steps, and with `--profile START,STEPS` a
          torch.profiler window analysed by `analyse_trace` (GPU busy and idle, kernel time by kind, host syncs,
          the largest idle gaps and what the training thread did meanwhile; the trace comes back gzipped).
          `--off NAME` turns off one of train.speed's choices (gpu_feed, sync_free_metrics, ...),
          `--on NAME` turns one on (DEFERRED_MASK_COMPILE, ONE_KV_LENGTH, EAGER_ROTARY, ONE_POINTWISE_CONFIG, ...),
          `--cold` empties the compile caches first; the measurement also gives how busy the cores were from launch
          to the first step (`startup_cpu_busy`).
          `--optimizer` sets `train.optimizer`; everything else is the preset's. `--inmem` swaps speculators' data
          loaders for one pinned batch served from memory (same trainer, model and optimizer): the trainer without
          its loader. A second launch on the same run folder is a retry: torch.compile's cache
          (`<run>/train/compile-cache`, where eyrie.stages.train.entry puts it) is then warm.
  loader  speculators' train loader as Eyrie's command configures it, drained with no model: batches/s it can
          deliver (with eyrie.stages.train.entry's GPU patches, `--off` as above).
  ab      optimizer A/B on a carried Eyrie run folder (the demo's extracted hidden states): `run_training` with
          each optimizer, validation accuracy per position per epoch against wall-clock seconds.

`all` runs gen, step and eyrie (each optimizer in --optimizers) and prints the rates and their ratio (to the bare
step on finite tensors, and to it on NaN). With `--profile START,STEPS` both the bare step and the trainer write
`kernels_<name>.json` (every GPU kernel by full name: launches and ms per step, with the window's SM clock and
power) and `keyavg_<name>.txt` (torch.profiler's key_averages table) beside the logs, and `all` ends with
`compare`: the trainer's window against the bare step's, kernel by kind, by family and by name, also at the bare
step's clock (`compare --compare A.json B.json` does it for any two tables). The trainer's first step also logs
where torch.compile's time went (`compile`: dynamo's phase totals, each compiled frame and its slowest kernels).
Every measurement is one JSON line on stdout and in --results.

Runs on a GPU machine with torch, transformers, safetensors, numpy, pyarrow and PyYAML but neither speculators nor
vLLM and no network: speculators and its needs travel as wheels in the ignored folder `.whl/`, which
`benchmarks/train_throughput.sh` installs into a private folder first. `--tiny` shrinks every dimension so the
plumbing can be checked on a CPU (no pip, no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from train_bench.ab import cmd_ab
from train_bench.common import emit
from train_bench.entry_hooks import _bench_entry
from train_bench.eyrie import cmd_eyrie
from train_bench.gen import cmd_gen
from train_bench.loader import cmd_loader
from train_bench.profiling import cmd_compare
from train_bench.step import cmd_step


def cmd_all(args) -> None:
    root = Path(args.root)
    if not (root / "eyrie.yaml").exists() or args.regen:
        cmd_gen(args)
    # the bare step in its own process, so none of its GPU memory is held while the trainer runs
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "step",
        "--root",
        str(root),
        "--results",
        args.results,
        "--iters",
        str(args.iters),
        "--tag",
        "bare",
        "--verifier-weights",
        args.verifier_weights or "finite,nan",
        "--log-dir",
        args.log_dir,
    ]
    argv += (["--tiny"] if args.tiny else []) + (["--profile", args.profile] if args.profile else [])
    r = subprocess.run(argv, capture_output=True, text=True)
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    steps = {x.get("verifier_weights"): x for x in lines if x.get("what") == "step"}
    if r.returncode or not steps:
        raise SystemExit(f"the bare step failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    for x in steps.values():
        print(json.dumps(x), flush=True)
    bare = steps.get("finite") or next(iter(steps.values()))
    runs = [cmd_eyrie(args, opt) for opt in args.optimizers.split(",")]
    emit_summary(args, bare, runs, steps.get("nan"))
    compare_profiles(args, runs)


def compare_profiles(args, runs: list[dict]) -> None:
    """With --profile: each trainer's window against the bare step's (finite weights), and the bare step on NaN
    against it, kernel by kernel (compare_tables); text beside the logs, a record in the results."""
    logs = Path(args.log_dir)
    base = logs / "kernels_step_bare.json"
    if not base.exists():
        return
    tag = "_" + args.tag if args.tag else ""
    others = [logs / "kernels_step_bare-nan.json"] + [logs / f"kernels_eyrie_{r['optimizer']}{tag}.json" for r in runs]
    for other in others:
        if other.exists():
            args.compare = [str(base), str(other)]
            cmd_compare(args)


def emit_summary(args, bare: dict, runs: list[dict], bare_nan: dict | None = None) -> None:
    summary = {"what": "summary", "bare_step_tokens_per_s": bare["tokens_per_s"]}
    if bare_nan:  # the bare step as first measured: speculators' NaN placeholders for the borrowed tensors
        summary["bare_step_on_nan_tokens_per_s"] = bare_nan["tokens_per_s"]
    for r in runs:
        tag = f"eyrie_{r['optimizer']}"
        summary[tag + "_tokens_per_s"] = r.get("tokens_per_s")
        summary[tag + "_ratio_to_bare"] = (
            round(r["tokens_per_s"] / bare["tokens_per_s"], 3) if r.get("tokens_per_s") else None
        )
        if bare_nan:
            summary[tag + "_ratio_to_bare_on_nan"] = (
                round(r["tokens_per_s"] / bare_nan["tokens_per_s"], 3) if r.get("tokens_per_s") else None
            )
        summary[tag + "_first_step_s"] = r.get("first_step_s")
        summary[tag + "_compile_cache_warm"] = r["compile_cache_files_before"] > 0
    emit(args, summary)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_bench_entry":
        _bench_entry(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["all", "gen", "step", "eyrie", "loader", "ab", "compare"])
    p.add_argument(
        "--root",
        default=os.path.expanduser("~/eyrie-train-throughput"),
        help="run folder (put it on a disk, not tmpfs)",
    )
    p.add_argument("--results", default="")
    p.add_argument("--log-dir", default="/tmp/eyrie-train-throughput-logs")
    p.add_argument("--tiny", action="store_true", help="tiny dimensions: a CPU check of the plumbing")
    p.add_argument("--tag", default="")
    p.add_argument("--regen", action="store_true")
    # gen
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument(
        "--hs-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"], help="gen: the hidden-state files'"
    )
    p.add_argument("--distinct", type=int, default=64, help="distinct hidden-state files (others are links)")
    # step
    p.add_argument("--opt", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--master", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--clip", action="store_true")
    p.add_argument("--attn", default="simple_flex_attention")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--trainer-norms", action="store_true", help="norm_before_fc and norm_output, as the trainer")
    p.add_argument("--shifted-docs", action="store_true", help="documents as the trainer packs them (2047 + pad)")
    p.add_argument("--eyrie-patches", action="store_true", help="eyrie.stages.train.entry's sync-free metrics and loss")
    p.add_argument("--bf16-weights", action="store_true", help="with --master fp32: eyrie's bf16 working weights")
    p.add_argument(
        "--verifier-weights",
        default=None,
        help="step: the borrowed embedding and heads, finite (default) or nan (speculators' placeholder), or both in "
        "one process: finite,nan (all's default)",
    )
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare: two kernels_*.json tables, B against A")
    # eyrie
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--optimizers", default="adamw,muon")
    p.add_argument("--warmup-steps", type=int, default=50, help="first logged step of the timed window")
    p.add_argument("--window-s", type=float, default=45.0)
    p.add_argument("--startup-s", type=float, default=300.0)
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--loader-batches", type=int, default=60, help="loader: batches timed after 8 of warm-up")
    p.add_argument("--inmem", action="store_true", help="the trainer fed one batch from memory (no loader)")
    p.add_argument("--exact", action="store_true", help="Eyrie's command itself, without _bench_entry's hooks")
    p.add_argument("--profile", default="", help="START,STEPS: a torch.profiler window from step START")
    p.add_argument("--off", action="append", default=[], help="a train.speed choice to turn off (gpu_feed, ...)")
    p.add_argument("--on", action="append", default=[], help="a train.speed choice to turn on (one_kv_length, ...)")
    p.add_argument(
        "--cold",
        action="store_true",
        help="eyrie: empty every compile cache first (<run>/train/compile-cache, ~/.triton, /tmp/torchinductor_*)",
    )
    # ab
    p.add_argument("--ab-run", default="runs/gpu-ab/run")
    p.add_argument("--ab-config", default="runs/gpu-ab/demo.yaml")
    p.add_argument("--ab-target", default="runs/gpu-ab/target")
    p.add_argument("--ab-epochs", type=int, default=10)
    p.add_argument("--ab-device", default="cuda")
    p.add_argument("--ab-lr", default="", help="train.lr of the A/B runs, or several: 0.01,0.001")
    p.add_argument("--ab-warm-start", default="", help="a drafter checkpoint every A/B run starts from (a warm start)")
    args = p.parse_args()
    if args.what == "step":
        cmd_step(args)
    elif args.what == "eyrie":
        cmd_eyrie(args)
    elif args.what == "loader":
        cmd_loader(args)
    elif args.what == "compare":
        cmd_compare(args)
    else:
        {"all": cmd_all, "gen": cmd_gen, "ab": cmd_ab}[args.what](args)


if __name__ == "__main__":
    main()
