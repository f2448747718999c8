"""extract: one shard's hidden states through the vLLM extraction server, each file validated, then a manifest.

Files follow speculators' format (`hs_<i>.safetensors` with `hidden_states` [T, n_layers, H] and `token_ids` [T],
i the row index in the prepared dataset), all in one folder, so speculators' own loader reads them. The shard's
manifest, written last and atomically, records every file's checksum: it is the proof the shard is complete. It also
records each file's stat (size, mtime_ns, inode), so a later run trusts an unchanged file without reading it.

Modules, one job each:

- `plan`: the shard keys and the plan (which shards are pending, the server's spec);
- `shard`: one shard's extraction (`extract_shard`);
- `checks`: one file checked against its prepared sample;
- `manifest`: the files' records and the shard manifest, `shard_complete`;
- `window`: the requests in flight to one server, shared by the shards extracting from it;
- `answered`: the connector's files (its writer's lock, writeback, staging).

Import from the modules. The package re-exports only what callers outside the stages still import from it
(the fan-out, the pipeline and the sharded-stage skeleton, benchmarks, the lead's tests).
"""

from eyrie.run.folder import sample_path
from eyrie.stages.extract.answered import _wait_and_release, clean_staging
from eyrie.stages.extract.checks import load_checked
from eyrie.stages.extract.manifest import file_record, write_manifest
from eyrie.stages.extract.plan import ExtractionPlan, online_plan, shard_key
from eyrie.stages.extract.shard import extract_shard

__all__ = [
    "ExtractionPlan",
    "_wait_and_release",
    "clean_staging",
    "extract_shard",
    "file_record",
    "load_checked",
    "online_plan",
    "sample_path",
    "shard_key",
    "write_manifest",
]
