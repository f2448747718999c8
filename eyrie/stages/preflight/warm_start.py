"""Preflight's check of the warm-start base an earlier run recorded in the run folder.

A warm start keeps, per data, the base it first trained from (`train/warm_start.json`, written by
`eyrie.stages.promote.choose_base`: the data's id, the base's folder), so a re-run of the same data trains the same
way after its own drafter was promoted. Deleted since (a pruned promotion folder), that base would be found missing
only after regeneration and extraction, at the vocab or train stage. Here, after prepare and before anything loads,
the record is judged against this run's data: its id is rebuilt from the prepare key and the extraction keys the
shard manifests on disk hold. When it matches (the record would be used) and the base is gone, the run is refused with
what to do. A record for other data is replaced by the run, and refuses nothing.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.config import PromotionConfig, RegenerateConfig, TrainConfig
from eyrie.run.files import read_json, sha256_json
from eyrie.run.folder import RunFolder

RECORD = "warm_start.json"  # in the train folder (flows/pipeline.py passes `run.train / "warm_start.json"`)


def data_id_on_disk(run: RunFolder, train: TrainConfig, regenerate: RegenerateConfig, prepare_key: str) -> str | None:
    """The data id the pipeline gives `choose_base` (`sha256_json([prepare key, extraction keys])`), rebuilt from
    the shard manifests on disk for the shards extraction reads; None when a shard has no manifest (its extraction
    has not run with these shards, so no earlier record can be for them) or the run is online (no manifests)."""
    if train.hidden_states == "online":
        return None
    source = run.stage("regenerate") if regenerate.enabled else run.prepare
    shards = read_json(source / "shards.json")
    if not isinstance(shards, list) or not shards:
        return None
    keys = []
    for shard in shards:
        manifest = read_json(run.shard_manifests / f"shard-{int(shard['index']):05d}.json")
        if not isinstance(manifest, dict) or not manifest.get("key"):
            return None
        keys.append(manifest["key"])
    return sha256_json([prepare_key, keys])


def check_recorded_base(
    promotion: PromotionConfig,
    train: TrainConfig,
    regenerate: RegenerateConfig,
    run_dir: Path,
    prepare_key: str | None,
) -> list[str]:
    """A warm-start base this run would take from the record and that no longer exists: refused, with the fix.
    `train` and `regenerate`: which data the run's id is made of (`data_id_on_disk`)."""
    if not (promotion.dir and promotion.warm_start) or prepare_key is None:
        return []
    run = RunFolder(run_dir)
    path = run.train / RECORD
    record = read_json(path)
    if not isinstance(record, dict) or not record.get("base"):
        return []
    base = Path(record["base"])
    if (base / "config.json").is_file():
        return []
    if record.get("data") != data_id_on_disk(run, train, regenerate, prepare_key):
        return []  # recorded for other data: this run records its own base
    return [
        f"the warm-start base {base}, which an earlier run of this data chose and recorded in {path}, no longer "
        "exists (a pruned promotion folder?): restore it to train as that run did, or delete "
        f"{path} to warm-start from the current drafter ({promotion.dir}/current; training then starts "
        "again under a new key), or set promotion.warm_start: false to train from scratch"
    ]
