"""Reading rows: local .jsonl/.json/.parquet files or a hub dataset, and the source's fingerprint."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eyrie.config import DataConfig
from eyrie.errors import DataError
from eyrie.run.files import sha256_file, sha256_json
from eyrie.stages.prepare.rows import RowError
from eyrie.target.hub import hub_commit

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"data.source {path} holds no .jsonl, .json or .parquet files")
    return files


def _local_source(cfg: DataConfig) -> Path:
    path = Path(cfg.source)
    if not path.exists():
        raise DataError(
            f"data.source {path} does not exist: give a local .jsonl/.json/.parquet file or folder, "
            "or a Hugging Face dataset id"
        )
    return path


def _is_local(source: str) -> bool:
    return os.path.exists(source) or source.endswith(LOCAL_SUFFIXES) or source.startswith((".", "/"))


def iter_rows(cfg: DataConfig) -> Iterator[Any]:
    """Raw rows from local files or the hub. A jsonl line that is not JSON is yielded as a RowError (counted)."""
    if _is_local(cfg.source):
        path = _local_source(cfg)
        for f in _local_files(path):
            if f.suffix == ".jsonl":
                with open(f, encoding="utf-8", errors="replace") as fh:
                    for n, line in enumerate(fh, 1):
                        if line.strip():
                            try:
                                yield json.loads(line)
                            except ValueError as err:
                                yield RowError("malformed_json", f"{f.name}:{n}: {err}")
            elif f.suffix == ".json":
                try:
                    data = json.loads(f.read_text(encoding="utf-8"))
                except ValueError as err:
                    raise DataError(f"{f} is not valid JSON ({err}): fix the file or convert it to jsonl") from None
                if not isinstance(data, list):
                    raise DataError(f"{f} must hold a JSON list of conversations, got {type(data).__name__}")
                yield from data
            else:
                import pyarrow.parquet as pq

                yield from pq.read_table(f).to_pylist()
    else:
        import datasets
        from huggingface_hub import snapshot_download

        try:
            # The repo's files at exactly this revision (the run pins it to a commit), read by datasets with the
            # hub's own subset and split resolution: the rows match the key, online or from the cache.
            snapshot = snapshot_download(
                cfg.source,
                repo_type="dataset",
                revision=cfg.revision,
                local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1",
            )
            ds = datasets.load_dataset(snapshot, name=cfg.subset, split=cfg.split)
        except Exception as err:  # the hub client raises many types; all mean "cannot read this source"
            raise DataError(
                f"cannot load dataset {cfg.source!r} (split {cfg.split!r}, revision {cfg.revision or 'main'!r}): {err}"
            ) from None
        yield from ds


def is_hub_source(cfg: DataConfig) -> bool:
    return not _is_local(cfg.source)


def source_fingerprint(cfg: DataConfig) -> str:
    """Content hash of local files; a hub dataset's id, subset, split and the commit its revision resolves to."""
    if not is_hub_source(cfg):
        path = _local_source(cfg)
        return sha256_json(
            [(str(f.relative_to(path)) if f != path else f.name, sha256_file(f)) for f in _local_files(path)]
        )
    return sha256_json(["hub", cfg.source, cfg.subset, cfg.split, hub_commit(cfg.source, "dataset", cfg.revision)])
