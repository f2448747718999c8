"""Train stage, offline vs online hidden states (issue 13, item 3), on a run folder the demo made.

Both train the same config (the demo's, or --config) on the same data and vocabulary into fresh folders:

- offline: the run's extracted files (`extract/hidden_states`); the bytes written for them are what extraction
  wrote (their total size; the stage writes each file once, renamed from staging on the same filesystem);
- online: Eyrie's extraction server (target + extract_hidden_states + Eyrie's connector) with its storage path on
  tmpfs; the trainer asks it for every sample as it trains (eyrie/stages/train/online.py).

Reported per mode: training tokens/s (every training sample's tokens x epochs over the trainer's wall time, and
speculators' own logged `profile/tokens_per_s`), bytes written to persistent storage (the server's and the
trainer's `write_bytes` from /proc, which tmpfs never adds to; checkpoints count in both), hidden-state bytes left
on disk, and the predicted acceptance length from the last epoch's validation.

    .venv/bin/python benchmarks/online_hidden_states.py [--run-dir runs/demo] [--config configs/demo.yaml]
        [--epochs N] [--modes offline,online] [--out benchmarks/results/online-hidden-states.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def group_write_bytes(pgid: int) -> int:
    """write_bytes (what reached the block layer, so never tmpfs) summed over a process group's live members."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getpgid(int(d.name)) != pgid:
                continue
            io = (d / "io").read_text()
        except (OSError, ProcessLookupError):
            continue
        m = re.search(r"^write_bytes: (\d+)$", io, re.M)
        total += int(m.group(1)) if m else 0
    return total


def logged_tokens_per_s(log: Path) -> float | None:
    vals = [float(v) for v in re.findall(r"profile/tokens_per_s=([0-9.e+]+)", log.read_text(errors="replace"))]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default="runs/demo")
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--modes", default="offline,online")
    ap.add_argument("--work", default="/tmp/eyrie-online-bench")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from eyrie.config import load_config
    from eyrie.hidden_states.staging import leftover_bytes, staging_dir
    from eyrie.run.folder import RunFolder
    from eyrie.stages.preflight import run_preflight
    from eyrie.stages.prepare import load_seq_lens
    from eyrie.stages.regenerate import extraction_source
    from eyrie.stages.train.data import TrainingData
    from eyrie.stages.train.trainer import run_training
    from eyrie.stages.vocab import mapping_paths
    from eyrie.vllm.process import VllmServer
    from eyrie.vllm.spec import ServerSpec

    run = RunFolder(Path(args.run_dir).resolve())
    base = load_config(args.config)
    if args.epochs:
        base = base.model_copy(update={"train": base.train.model_copy(update={"epochs": args.epochs})})
    report = run_preflight(base, run.root, serve=False)
    data_dir = extraction_source(run, base.regenerate)
    seq_lens = load_seq_lens(data_dir)
    d2t, t2d = mapping_paths(run.vocab, base.vocab.draft_vocab_size)
    train_rows = int(len(seq_lens) * (1 - base.train.val_fraction))
    tokens_per_epoch = sum(min(s, base.train.max_seq_len) for s in seq_lens[:train_rows])
    work = Path(args.work)
    results = {}
    for mode in args.modes.split(","):
        config = base.model_copy(update={"train": base.train.model_copy(update={"hidden_states": mode})})
        out = work / mode
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        server_url, server, pgid, hidden = None, None, None, run.hidden_states
        if mode == "online":
            hidden = staging_dir(out)
            spec = ServerSpec.from_config(config, layer_ids=report.captured_layer_ids, storage_path=str(hidden))
            server = VllmServer(work / "server")
            t = time.perf_counter()
            server_url = server.ensure(spec, config.extraction.startup_timeout_s).base_url
            print(f"server up in {time.perf_counter() - t:.1f} s at {server_url}", flush=True)
            pgid = os.getpgid(server.state["pid"])
        before_server = group_write_bytes(pgid) if pgid else 0
        before_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock
        t = time.perf_counter()
        try:
            manifest = run_training(
                config,
                out,
                f"bench-{mode}",
                TrainingData(data_dir / "dataset", hidden, d2t, t2d, report.aux_layer_ids, report.target_facts),
                seq_lens,
                server_url=server_url,
            )
            seconds = time.perf_counter() - t
            trainer_written = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock - before_children) * 512
            server_written = group_write_bytes(pgid) - before_server if pgid else 0
            left = leftover_bytes(hidden) if mode == "online" else None
        finally:
            if server:
                server.stop()
                shutil.rmtree(hidden, ignore_errors=True)  # the tmpfs staging folder (empty: every file was read)
        offline_files = sum(p.stat().st_size for p in run.hidden_states.glob("*.safetensors"))
        val = (manifest["history"] or [{}])[-1]
        results[mode] = {
            "epochs": config.train.epochs,
            "train_seconds": round(seconds, 1),
            "tokens_per_s": round(tokens_per_epoch * config.train.epochs / seconds, 1),
            "logged_tokens_per_s_median": logged_tokens_per_s(Path(manifest["log"])),
            "hidden_state_bytes_written": offline_files if mode == "offline" else server_written,
            "hidden_state_bytes_left_on_disk": offline_files if mode == "offline" else left,
            "server_write_bytes_during_training": server_written if mode == "online" else None,
            "trainer_write_bytes": trainer_written,
            "predicted_acceptance_length": val.get("predicted_acceptance_length"),
            "val_full_acc": [val.get(f"full_acc_{i}_epoch") for i in range(config.train.ttt_steps)],
        }
        print(mode, json.dumps(results[mode]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
