"""The stage's keys and plan: the shards to regenerate, their keys, and the server."""

from __future__ import annotations

from eyrie.config import PipelineConfig
from eyrie.errors import RegenerationError
from eyrie.run.folder import RunFolder
from eyrie.stages.prepare import Shard, load_shards, tokenizer_fingerprint
from eyrie.stages.regenerate.shard import STAGE, shard_complete


def shard_key(template: str, shard: Shard, config: PipelineConfig) -> str:
    """A regenerated shard's identity (`eyrie.run.identity.STAGES["regenerate.shard"]`): the prepared shard's
    content (ids and conversations), the target (weights, tokenizer and generation config files, dtype,
    output-shaping server arguments), its template, the sampling and the length cap of a row."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed(
        "regenerate.shard",
        config,
        shard={
            "ids": shard.fingerprint,
            "conversations": shard.conversations,
            "rows": [shard.start, shard.stop],
        },
        template=template,
    )


def stage_key(shard_keys: dict[str, str], config: PipelineConfig) -> str:
    """The assembled output's identity: its shards' keys and what assembly keeps."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed("regenerate", config, shards=shard_keys)


class RegenerationPlan:
    """The shards to regenerate (prepare's), their keys, and the server: the extraction server itself, with the
    very spec extraction starts (so the target loads once for both stages)."""

    def __init__(self, config: PipelineConfig, run: RunFolder, report, node: str | None = None):
        from eyrie.stages.extract import ExtractionPlan
        from eyrie.target.metadata import load_tokenizer

        self.config = config
        self.run = run
        self.dir = run.stage(STAGE)
        self.shards = load_shards(run.prepare)
        if not self.shards:
            raise RegenerationError(f"{run.prepare / 'shards.json'} lists no shards: run the prepare stage first")
        server = ExtractionPlan(config, run, report, [], node=node)
        self.spec, self.server_dir, self.staging = server.spec, server.server_dir, server.staging
        template = tokenizer_fingerprint(load_tokenizer(config.target))
        self.keys = {s.name: shard_key(template, s, config) for s in self.shards}
        self.key = stage_key(self.keys, config)

    def is_complete(self, shard: Shard) -> bool:
        return shard_complete(self.dir, shard, self.keys[shard.name])

    def pending(self) -> list[Shard]:
        return [s for s in self.shards if not self.is_complete(s)]
