"""A fully cached `eyrie run` at scale: the checks it makes on a run folder of 200,000 hidden-state files.

Builds, under --dir (default .cache/bench/cached-rerun; reused by later calls with the same sizes), a finished run
folder as Eyrie leaves it:

- `prepare/shards.json` and `prepare/manifest.json`;
- `extract/hidden_states/hs_<i>.safetensors`: real safetensors files (`hidden_states` [T, L, H] bf16, `token_ids`
  [T]), small on purpose (--tokens): what is measured is the cost per file;
- `extract/shards/shard-*.json`, written by Eyrie's own `file_record` and `write_manifest`, keyed by `shard_key` on
  a stand-in target folder (a config.json) so that `ExtractionPlan` finds every shard complete;
- the vocab, train, export and evaluate manifests (vocab's and export's list files).

Then it times, old (hash every file) beside new (stat only), the checks of a fully cached run, by calling the exact
functions the flow calls:

- flows/pipeline.py, under the run lock: `remove_staging(run.root, skip=run.write_once_folders)`;
  old: `remove_staging(run.root)` as it was (rglob over the whole folder);
- flows/extract.py: `plan.pending(extraction.verify_checksums)`, then `plan.is_complete(s)` for the shards that ran
  (none); old: `shard_complete` as it was (kept below as `old_shard_complete`), re-hashing every file, then every
  shard's files stat'ed again;
- tasks/caching.py: the cache policy's `eyrie.run.manifest.finished_manifest` for each stage (its manifest, a stat per
listed file);

and `eyrie status` (`run_status`, which now stats every listed file) and `eyrie verify` (`verify_run`, report only).
Not timed: Prefect (its temporary server, the task runs of the cached shards) and preflight (the vLLM import): a
full `eyrie run` needs a real target and data; --flow adds a run of the real extraction flow under Prefect on this
folder (with every shard complete it runs no task per shard).

With --cold each read-based measurement (old check, verify) starts with the hidden-state files dropped from the page
cache (posix_fadvise DONTNEED, per file, no root needed); inodes stay cached. Prints a table; writes
`<dir>/bench.json`.

    .venv/bin/python benchmarks/cached_rerun.py                    # 200,000 files, 256 per shard
    .venv/bin/python benchmarks/cached_rerun.py --files 20000 --cold --flow
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save

from eyrie import FORMAT_VERSION
from eyrie.config import DataConfig, ExtractionConfig, PipelineConfig, TargetConfig
from eyrie.ops.status import run_status
from eyrie.ops.verify import default_workers, verify_run
from eyrie.run.files import atomic_write_json, read_json, sha256_file, sha256_json
from eyrie.run.folder import RunFolder, remove_staging, sample_path
from eyrie.run.manifest import finished_manifest, list_files
from eyrie.stages import RUN_FOLDER_STAGES
from eyrie.stages.extract import ExtractionPlan, file_record, shard_key, write_manifest
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import Shard, load_shards
from eyrie.target.metadata import target_identity

LAYERS = [2, 4, 5, 8]  # captured ids of an 8-layer stand-in target
HIDDEN = 64


def old_remove_staging(folder: Path) -> int:
    """`remove_staging` before this change: every name under the run folder is listed and matched."""
    n = 0
    for p in folder.rglob(".*.tmp"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def old_shard_complete(manifest_path: Path, key: str, hidden_dir: Path, verify_checksums: bool = False) -> bool:
    """`shard_complete` before this change: with verify_checksums (the default config) every file is re-hashed."""
    m = read_json(manifest_path)
    if not m or m.get("key") != key:
        return False
    for idx, rec in m["files"].items():
        p = sample_path(hidden_dir, int(idx))
        try:
            if p.stat().st_size != rec["bytes"]:
                return False
        except OSError:
            return False
        if verify_checksums and sha256_file(p) != rec["sha256"]:
            return False
    return True


def synthetic_config(root: Path, shard_size: int) -> PipelineConfig:
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN}))
    return PipelineConfig(
        name="cached-rerun-bench",
        target=TargetConfig(model=str(target)),
        data=DataConfig(source=str(root / "data.jsonl"), shard_size=shard_size),
        extraction=ExtractionConfig(layer_ids=LAYERS[:-1]),
    )


def synthetic_report(config: PipelineConfig) -> dict:
    return PreflightReport(
        architecture="LlamaForCausalLM",
        vllm_class="LlamaForCausalLM",
        eagle3_path="native",
        eagle3_reason="stand-in target of benchmarks/cached_rerun.py",
        language_model=None,
        num_layers=8,
        hidden_size=HIDDEN,
        vocab_size=512,
        aux_layer_ids=LAYERS[:-1],
        captured_layer_ids=LAYERS,
        vllm_version="n/a",
        max_model_len=config.max_model_len,
    ).as_dict()


def build(root: Path, files: int, shard_size: int, tokens: int) -> tuple[PipelineConfig, dict]:
    """The finished run folder (reused when one of the same sizes is complete); returns its config and report."""
    want = {"files": files, "shard_size": shard_size, "tokens": tokens, "format": FORMAT_VERSION}
    config = synthetic_config(root, shard_size)
    report = synthetic_report(config)
    stamp = root / "bench-build.json"
    if read_json(stamp) == want:
        return config, report
    run = RunFolder(root / "run")
    shutil.rmtree(run.root, ignore_errors=True)
    stamp.unlink(missing_ok=True)
    run.ensure()
    t0 = time.perf_counter()
    shards = [
        Shard(i, start, min(start + shard_size, files), sha256_json(["bench", start])[:16], tokens * shard_size)
        for i, start in enumerate(range(0, files, shard_size))
    ]
    atomic_write_json(run.prepare / "shards.json", [s.__dict__ for s in shards])
    atomic_write_json(run.manifest("prepare"), {"stage": "prepare", "key": "bench", "num_shards": len(shards)})
    run.hidden_states.mkdir(parents=True)
    hs = torch.randn(tokens, len(LAYERS), HIDDEN).to(torch.bfloat16)
    for i in range(files):
        ids = torch.arange(i, i + tokens)
        sample_path(run.hidden_states, i).write_bytes(save({"hidden_states": hs, "token_ids": ids}))
        if i % 20000 == 0:
            print(f"  wrote {i:,}/{files:,} files ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    plan = ExtractionPlan(config, run, PreflightReport(**report), shards)
    tid = target_identity(config.target)
    for s in shards:
        assert plan.keys[s.name] == shard_key(tid, LAYERS, s)
        recs = {str(i): file_record(sample_path(run.hidden_states, i), tokens) for i in range(s.start, s.stop)}
        write_manifest(
            plan.manifest_path(s),
            {
                "stage": "extract",
                "shard": s.name,
                "key": plan.keys[s.name],
                "fingerprint": s.fingerprint,
                "rows": [s.start, s.stop],
                "num_layers": len(LAYERS),
                "hidden_size": HIDDEN,
                "files": recs,
                "reused_samples": 0,
                "extracted_samples": len(recs),
            },
        )
    run.vocab.mkdir()
    for name in ("d2t-32.npy", "t2d-512.npy"):
        (run.vocab / name).write_bytes(os.urandom(4096))
    vocab_files = list_files(run.vocab, run.vocab.glob("*.npy"))
    atomic_write_json(run.manifest("vocab"), {"stage": "vocab", "key": "bench", "files": vocab_files})
    atomic_write_json(run.manifest("train"), {"stage": "train", "key": "bench", "checkpoint": "n/a"})
    (run.export / "drafter").mkdir(parents=True)
    (run.export / "drafter" / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (run.export / "drafter" / "config.json").write_text("{}")
    export_files = list_files(run.export, (run.export / "drafter").iterdir())
    atomic_write_json(run.manifest("export"), {"stage": "export", "key": "bench", "files": export_files})
    atomic_write_json(run.manifest("evaluate"), {"stage": "evaluate", "results": {}})
    atomic_write_json(stamp, want)
    print(f"  built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return config, report


def drop_page_cache(hidden: Path) -> None:
    for entry in os.scandir(hidden):
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".cache/bench/cached-rerun", help="where the run folder is built (and kept)")
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--shard-size", type=int, default=256, help="data.shard_size (Eyrie's default: 256)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per sample file (the file size follows)")
    ap.add_argument("--repeats", type=int, default=3, help="median of this many timings")
    ap.add_argument("--workers", type=int, default=None, help="eyrie verify's workers (default: its own)")
    ap.add_argument("--cold", action="store_true", help="drop the hidden states from the page cache before reads")
    ap.add_argument("--flow", action="store_true", help="also time the real extraction flow (Prefect) twice")
    args = ap.parse_args()

    root = Path(args.dir).resolve()
    config, report = build(root, args.files, args.shard_size, args.tokens)
    run = RunFolder(root / "run")
    shards = load_shards(run.prepare)
    plan = ExtractionPlan(config, run, PreflightReport(**report), shards)
    rehash = config.extraction.verify_checksums
    size = sum(e.stat().st_size for e in os.scandir(run.hidden_states))
    cold = (lambda: drop_page_cache(run.hidden_states)) if args.cold else None
    r = args.repeats

    rows: list[tuple[str, float, float]] = []
    # flows/pipeline.py, first thing under the lock.
    t_old, _ = timed(lambda: old_remove_staging(run.root), r)
    t_new, _ = timed(lambda: remove_staging(run.root, skip=run.write_once_folders), r)
    rows.append(("remove_staging (pipeline)", t_old, t_new))
    # flows/extract.py: which shards must run. Old: every file re-hashed (the page cache as --cold says).
    t_old, ok = timed(
        lambda: all(
            old_shard_complete(plan.manifest_path(s), plan.keys[s.name], run.hidden_states, True) for s in shards
        ),
        r,
        cold,
    )
    assert ok, "the old check found a shard incomplete"
    t_new, pending = timed(lambda: plan.pending(rehash), r)
    assert pending == [], f"{len(pending)} shards pending: the built folder is not complete"
    rows.append((f"extract: plan.pending ({len(shards)} shards)", t_old, t_new))
    # flows/extract.py after the (cached) tasks: old, every manifest re-checked against its files (by size); new,
    # only the shards that ran (none in a cached run).
    t_old, ok = timed(
        lambda: all(old_shard_complete(plan.manifest_path(s), plan.keys[s.name], run.hidden_states) for s in shards), r
    )
    assert ok
    ran = {s.name for s in pending}
    t_new, missing = timed(lambda: [s for s in shards if s.name in ran and not plan.is_complete(s)], r)
    assert missing == []
    rows.append(("extract: final re-check of the manifests", t_old, t_new))
    # tasks/caching.py: each stage's done check (its manifest and a stat of every file it lists).
    t_new, _ = timed(lambda: [finished_manifest(run.manifest(st), None) for st in RUN_FOLDER_STAGES], r)
    rows.append(("stage manifests (done)", t_new, t_new))
    total_old = sum(o for _, o, _ in rows)
    total_new = sum(n for _, _, n in rows)
    t_status, status = timed(lambda: run_status(run), r)
    assert status["stages"]["extract"] == "done", status["stages"]
    workers = args.workers or default_workers()
    t_verify, vreport = timed(lambda: verify_run(run.root, workers=workers, report_only=True, progress=False), 1, cold)
    assert vreport.ok, vreport.summary()

    print(f"\nrun folder {run.root}: {args.files:,} hidden-state files ({size / 2**20:.0f} MiB), {len(shards)} shards")
    print(
        f"page cache: {'hidden states dropped before each read' if args.cold else 'warm (files just read or written)'}"
    )
    print(f"\n{'check of a fully cached run':<44} {'old: hash all':>14} {'new: stat':>11}")
    for name, old, new in rows:
        print(f"{name:<44} {old:>12.2f} s {new:>9.2f} s")
    print(f"{'total':<44} {total_old:>12.2f} s {total_new:>9.2f} s")
    print(f"\neyrie status (stats every listed file): {t_status:.2f} s")
    print(
        f"eyrie verify: {vreport.files:,} files, {vreport.bytes / 2**20:.0f} MiB in {t_verify:.1f} s with {workers} "
        f"workers = {vreport.files / t_verify:,.0f} files/s, {vreport.bytes / t_verify / 2**30:.3f} GiB/s"
    )
    out = {
        "files": args.files,
        "shards": len(shards),
        "bytes": size,
        "cold": args.cold,
        "repeats": r,
        "checks": [{"check": n, "old_s": round(o, 3), "new_s": round(nw, 3)} for n, o, nw in rows],
        "total_old_s": round(total_old, 3),
        "total_new_s": round(total_new, 3),
        "status_s": round(t_status, 3),
        "verify": {"s": round(t_verify, 3), "workers": workers, "files": vreport.files, "bytes": vreport.bytes},
    }
    if args.flow:
        out["flow"] = time_flow(config, run, report)
    (root / "bench.json").write_text(json.dumps(out, indent=2) + "\n")


def time_flow(config: PipelineConfig, run: RunFolder, report: dict) -> dict:
    """The real extraction flow on the built folder, twice, in Prefect's temporary server (started by the first
    call). With a fresh PREFECT_HOME the first call has no cache records: each shard's task runs and finds its manifest
    complete, without a server; the second finds every task cached. Neither starts vLLM. Reported per call: the wall
    time of the call and the flow run's own run time (Prefect's record: from its start to its end, in the server)."""
    # Prefect's state stays in the repository's ignored .cache unless the caller chose a home (the Makefile does).
    # Prefect 3.7 keeps task results (the cache records) in ~/.prefect/storage whatever PREFECT_HOME says: set it too.
    home = os.environ.setdefault("PREFECT_HOME", str(Path(".cache/prefect").resolve()))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(Path(home) / "storage"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.client.orchestration import get_client

    from flows.extract import extract_flow

    calls = []
    for label in ("first", "second"):
        t0 = time.perf_counter()
        state = extract_flow(config, str(run.root), report, return_state=True)
        wall = time.perf_counter() - t0
        assert state.is_completed(), state.message
        with get_client(sync_client=True) as client:
            fr = client.read_flow_run(state.state_details.flow_run_id)
        calls.append(
            {"call": label, "wall_s": round(wall, 2), "flow_run_s": round(fr.total_run_time.total_seconds(), 2)}
        )
    n = len(load_shards(run.prepare))
    for c in calls:
        wall, inner = c["wall_s"], c["flow_run_s"]
        print(f"extraction flow ({n} shards, all complete), {c['call']} call: {wall:.1f} s, its flow run {inner:.1f} s")
    return {"shard_tasks": n, "calls": calls}


if __name__ == "__main__":
    main()
