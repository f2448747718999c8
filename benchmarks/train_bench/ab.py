"""ab: optimizer A/B on a carried Eyrie run folder (validation accuracy per position against wall-clock)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from train_bench.common import NUM, emit


def cmd_ab(args) -> None:
    from eyrie.config import load_config
    from eyrie.stages.prepare import load_seq_lens
    from eyrie.stages.train.data import TrainingData
    from eyrie.stages.train.trainer import run_training
    from eyrie.stages.vocab import mapping_paths

    run = Path(args.ab_run).resolve()
    base = load_config(Path(args.ab_config))
    report = json.loads((run / "preflight.json").read_text())  # what the pipeline hands the train stage
    facts, aux = report["target_facts"], report["aux_layer_ids"]
    d2t, t2d = mapping_paths(run / "vocab", base.vocab.draft_vocab_size)
    warm = Path(args.ab_warm_start).resolve() if args.ab_warm_start else None
    lrs = [float(x) for x in args.ab_lr.split(",")] if args.ab_lr else [None]
    for opt, lr in ((o, r) for o in args.optimizers.split(",") for r in lrs):
        train = base.train.model_copy(
            update={
                "optimizer": opt,
                "epochs": args.ab_epochs,
                "device": args.ab_device,
                **({"lr": lr} if lr else {}),
            }
        )
        config = base.model_copy(
            update={
                "train": train,
                "target": base.target.model_copy(update={"model": str(Path(args.ab_target).resolve())}),
                # a warm start at exactly the rate asked for (the pipeline scales train.lr down for one)
                "promotion": base.promotion.model_copy(update={"warm_start_lr_scale": 1.0}),
            }
        )
        out = Path(args.root) / "ab" / (opt if len(lrs) == 1 else f"{opt}-{lr}")
        shutil.rmtree(out, ignore_errors=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        os.environ["COLUMNS"] = "2000"  # one log line per record
        t0 = time.time()
        manifest = run_training(
            config,
            out,
            "k",
            TrainingData(run / "prepare" / "dataset", run / "extract" / "hidden_states", d2t, t2d, aux, facts),
            load_seq_lens(run / "prepare"),
            warm_start=warm,
            log=lambda m: None,
        )
        wall = time.time() - t0
        # speculators keeps val_metrics.json only for epochs that improved the validation loss; its log has
        # every epoch's. Seconds: from run_training's call to the epoch's checkpoint.
        log = (out / "k" / "train.log").read_text(errors="replace")
        vals = [
            dict((k, float(v)) for k, v in re.findall(r"val/(\w+?)_epoch=" + NUM, block))
            for block in re.split(r"Validation epoch \d+/\d+ started", log)[1:]
        ]
        start = t0
        rows = []
        for h in manifest["history"]:
            ck = out / "k" / "checkpoints" / str(h["epoch"]) / "model.safetensors"
            v = vals[h["epoch"]] if h["epoch"] < len(vals) else {}
            rows.append(
                {
                    "epoch": h["epoch"],
                    "s": round(ck.stat().st_mtime - start, 1),
                    "loss": v.get("loss"),
                    **{k: round(x, 4) for k, x in v.items() if k.startswith("full_acc")},
                }
            )
        emit(
            args,
            {
                "what": "ab",
                "optimizer": opt,
                "lr": train.lr,
                "warm_start": str(warm) if warm else None,
                "device": manifest["device"],
                "epochs": args.ab_epochs,
                "wall_s": round(wall, 1),
                "global_step": manifest["global_step"],
                "epochs_table": rows,
            },
        )
