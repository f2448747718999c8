"""The regenerated shards assembled as one dataset in prepare's format."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import Counter
from pathlib import Path

from eyrie.errors import RegenerationError
from eyrie.run.faults import fault_point
from eyrie.run.files import atomic_write_json, fsync_path, fsync_tree, read_json, sha256_json
from eyrie.run.manifest import files_under, finished_manifest, list_files
from eyrie.stages.prepare import Shard
from eyrie.stages.regenerate.shard import SERVER_LOSSES, STAGE, shard_paths


def assemble(stage_dir: Path, prepare_dir: Path, shards: list[Shard], keys: dict[str, str], key: str, cfg) -> dict:
    """The regenerated shards as one dataset in prepare's format, with its token counts, shard plan and stats.
    Reuses a finished assembly with `key`. Each shard's rows file is checked against its manifest's sha256 here,
    where it is read anyway; a changed one loses its manifest, so the next run regenerates that shard."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch

    if manifest := finished_manifest(stage_dir / "manifest.json", key):
        return manifest
    tables, out_shards, start = [], [], 0
    totals: Counter = Counter()
    failed: Counter = Counter()
    temperatures: Counter = Counter()
    row_variants: list[str] = []  # each dataset row's chat-template variant (regenerate.template_mix)
    examples: dict = {}
    dropped_capped = 0
    warnings: list[str] = []  # each shard's rows lost to server errors: they reach the run's warnings
    for shard in shards:
        rows_path, manifest_path = shard_paths(stage_dir, shard)
        m = read_json(manifest_path)
        if not m or m.get("key") != keys[shard.name]:
            raise RegenerationError(f"{shard.name} has no finished manifest with its key: regenerate it first")
        data = rows_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != m["sha256"]:
            manifest_path.unlink(missing_ok=True)
            raise RegenerationError(
                f"{rows_path} changed since its shard finished (sha256 differs): its manifest is removed, run "
                "again to regenerate that shard"
            )
        import io

        table = pq.read_table(io.BytesIO(data))
        if cfg.length_capped == "drop":
            capped = table.column("length_capped")
            dropped_capped += pc.sum(capped).as_py() or 0
            table = table.filter(pc.invert(capped))
        n = table.num_rows
        for k, v in m["stats"].items():
            if isinstance(v, int) and not isinstance(v, bool):
                totals[k] += v
        failed.update(m["stats"]["failed"])
        temperatures.update(m["stats"].get("temperatures", {}))
        if "template_variant" in table.column_names:
            row_variants += table.column("template_variant").to_pylist()
        else:  # written before template mixes: the template's own rendering
            row_variants += ["default"] * n
        for reason, ex in m["stats"]["examples"].items():
            examples.setdefault(reason, f"{shard.name} {ex}")
        if lost := sum(m["stats"]["failed"].get(r, 0) for r in SERVER_LOSSES):
            warnings.append(
                f"regenerate: {lost} of {m['stats']['rows_in']} conversations of {shard.name} were lost to server "
                f"errors ({m['stats']['examples'].get('server_error', 'see the server log')}); this run's data lacks "
                "them, the next run retries them"
            )
        if n:
            ids = table.column("input_ids").to_pylist()
            # Named as the prepared shard it came from: a prepared shard unchanged keeps its extraction shard.
            out_shards.append(Shard(shard.index, start, start + n, sha256_json(ids)[:16], sum(map(len, ids))).__dict__)
            start += n
            tables.append(table.select(["input_ids", "loss_mask"]))
    if not tables:
        raise RegenerationError(
            f"no conversation was regenerated ({dict(failed) or 'every answer was length-capped and dropped'}); "
            f"examples: {examples}. See {stage_dir}/shards/*.json and the server log"
        )
    table = pa.concat_tables(tables)
    table = table.append_column("seq_len", pc.list_value_length(table.column("input_ids")).cast(pa.int64()))

    for stale in stage_dir.glob("dataset.staging-*"):  # left by a run killed mid-assembly
        shutil.rmtree(stale, ignore_errors=True)
    staging = stage_dir / f"dataset.staging-{os.getpid()}"
    _save_table(staging, table, prepare_dir)
    ids = pc.list_flatten(table.column("input_ids")).to_numpy()
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy()
    counts = np.bincount(ids[mask == 1])
    torch.save({int(t): int(c) for t, c in enumerate(counts) if c}, staging / "token_freq.pt")
    fsync_tree(staging)  # `datasets` does not fsync: the files on disk before the manifest vouches for them
    if (stage_dir / "dataset").exists():
        shutil.rmtree(stage_dir / "dataset")
    os.replace(staging, stage_dir / "dataset")
    fsync_path(stage_dir)
    stats = {
        **{k: totals[k] for k in ("rows_in", "rows_out", "turns", "generated_tokens", "tokens", "loss_tokens")},
        **{k: totals[k] for k in ("length_capped", "truncated", "dropped_history_text", "requests")},
        "rows_used": table.num_rows,
        "dropped_length_capped": dropped_capped,
        "failed": dict(sorted(failed.items())),
        "examples": examples,
        "temperatures": dict(sorted(temperatures.items())),
        "template_variants": dict(sorted(Counter(row_variants).items())),  # of the rows used
    }
    stats["tokens"] = int(pc.sum(table.column("seq_len")).as_py())
    stats["loss_tokens"] = int(mask.sum())
    atomic_write_json(stage_dir / "shards.json", out_shards)
    atomic_write_json(stage_dir / "stats.json", stats)
    listed = [*files_under(stage_dir / "dataset"), stage_dir / "shards.json"]
    if getattr(cfg, "template_mix", None):
        # The dataset keeps prepare's columns: each row's variant beside it, in its order, so the training data
        # can be compared with evaluation per variant.
        atomic_write_json(stage_dir / "template_variants.json", row_variants)
        listed.append(stage_dir / "template_variants.json")
    files = list_files(stage_dir, listed)
    prepare_manifest = read_json(prepare_dir / "manifest.json") or {}
    manifest = {
        "stage": STAGE,
        "key": key,
        "prepare_key": prepare_manifest.get("key"),
        "num_samples": table.num_rows,
        "num_shards": len(out_shards),
        "stats": stats,
        "files": files,
        "warnings": warnings,
    }
    fault_point("regenerate.before-manifest")
    atomic_write_json(stage_dir / "manifest.json", manifest)
    return manifest


def _save_table(path: Path, table, prepare_dir: Path) -> None:
    """Save with `datasets` exactly as prepare saved its dataset: its column types, torch format."""
    from datasets import Dataset, load_from_disk

    ds = Dataset(table).cast(load_from_disk(str(prepare_dir / "dataset")).features)
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))
