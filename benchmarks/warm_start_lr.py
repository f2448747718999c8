"""Warm-start learning rate: from a trained drafter, train again on the same data at several learning rates and
print the predicted acceptance length (1 + validation accuracy of positions 1-3) after each epoch.

The drafter and data come from the optimizer A/B's run (`benchmarks/train_throughput.py ab`): first train a drafter
from scratch there, then start from its last checkpoint here (CPU, ~15 s a rate on the demo data):

    .venv/bin/python benchmarks/train_throughput.py ab --root runs/ab-cpu --ab-device cpu --ab-lr 0.01 \
        --ab-epochs 10 --optimizers adamw
    .venv/bin/python benchmarks/warm_start_lr.py runs/ab-cpu/ab/adamw/k/checkpoints/9 --lrs 0.01,0.003,0.001

Each rate trains exactly as a warm-started pipeline run does (`eyrie.train.run_training` with `warm_start`), with
`promotion.warm_start_lr_scale` set to 1 so that `--lrs` are the rates used.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyrie.config import load_config  # noqa: E402
from eyrie.prepare import load_seq_lens  # noqa: E402
from eyrie.train import run_training  # noqa: E402
from eyrie.vocab import mapping_paths  # noqa: E402

NUM = r"([-+0-9.eE]+)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", help="the checkpoint to start from")
    ap.add_argument("--lrs", default="0.01,0.003,0.001")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--ab-run", default="runs/gpu-ab/run", help="the run whose data trained the drafter")
    ap.add_argument("--ab-config", default="runs/gpu-ab/demo.yaml")
    ap.add_argument("--ab-target", default="runs/gpu-ab/target")
    args = ap.parse_args()
    run = Path(args.ab_run).resolve()
    base = load_config(Path(args.ab_config))
    report = json.loads((run / "preflight.json").read_text())
    d2t, t2d = mapping_paths(run / "vocab", base.vocab.draft_vocab_size)
    root = Path(tempfile.mkdtemp(prefix="eyrie-warm-start-"))
    try:
        for lr in map(float, args.lrs.split(",")):
            config = base.model_copy(
                update={
                    "train": base.train.model_copy(
                        update={"optimizer": "adamw", "epochs": args.epochs, "device": "cpu", "lr": lr}
                    ),
                    "target": base.target.model_copy(update={"model": str(Path(args.ab_target).resolve())}),
                    "promotion": base.promotion.model_copy(update={"warm_start_lr_scale": 1.0}),
                }
            )
            out = root / str(lr)
            t0 = time.time()
            run_training(
                config,
                out,
                "k",
                run / "prepare" / "dataset",
                run / "extract" / "hidden_states",
                d2t,
                t2d,
                report["aux_layer_ids"],
                report["target_facts"],
                load_seq_lens(run / "prepare"),
                warm_start=Path(args.drafter).resolve(),
                log=lambda m: None,
            )
            log = (out / "k" / "train.log").read_text(errors="replace")
            epochs = [
                {k: float(v) for k, v in re.findall(r"val/(\w+?)_epoch=" + NUM, block)}
                for block in re.split(r"Validation epoch \d+/\d+ started", log)[1:]
            ]
            acc = [[round(e.get(f"full_acc_{i}", 0.0), 3) for i in range(3)] for e in epochs]
            print(
                json.dumps(
                    {
                        "lr": lr,
                        "wall_s": round(time.time() - t0, 1),
                        "al": [round(1 + sum(a), 3) for a in acc],
                        "acc": acc,
                    }
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
