"""The stage's keys and plan: the shards to regenerate, their keys, and the server."""

from __future__ import annotations

from eyrie.config import PipelineConfig
from eyrie.errors import RegenerationError
from eyrie.run.files import read_json
from eyrie.run.folder import RunFolder
from eyrie.stages.prepare import Shard, load_shards, remembered_tokenizer_fingerprint
from eyrie.stages.regenerate.conversation import template_mix
from eyrie.stages.regenerate.shard import STAGE, has_losses, lost_rows, shard_complete, shard_paths


def shard_key(template: str, shard: Shard, config: PipelineConfig) -> str:
    """A regenerated shard's identity (`eyrie.run.identity.STAGES["regenerate.shard"]`): the prepared shard's
    content (ids and conversations), the target (weights, tokenizer and generation config files, dtype,
    output-shaping server arguments), its template (with the switches of each variant `regenerate.template_mix`
    draws: a variant's `chat_template_kwargs` changed in `evaluate.template_variants` renders other rows), the
    sampling and the length cap of a row. The whole config: the key is computed from the declaration's dotted
    paths."""
    from eyrie.target.metadata import stage_key as keyed

    switches = template_mix(config.regenerate, config.evaluate)  # raises ConfigError on a name no variant declares

    return keyed(
        "regenerate.shard",
        config,
        shard={
            "ids": shard.fingerprint,
            "conversations": shard.conversations,
            "rows": [shard.start, shard.stop],
        },
        template={"tokenizer": template, "variants": switches} if switches else template,
    )


def stage_key(
    shard_keys: dict[str, str], config: PipelineConfig, lost: dict[str, list[int] | None] | None = None
) -> str:
    """The assembled output's identity: its shards' keys and what assembly keeps. `lost`: the rows each shard lost
    to server errors (left out of its rows file until a later run retries them), so an assembly made without them
    is not reused once they are back (None: it lost some, unnamed); a shard that lost none keys as its key alone.
    The whole config: the key is computed from the declaration's dotted paths."""
    from eyrie.target.metadata import stage_key as keyed

    lost = lost or {}
    shards = {name: {"key": k, "lost": lost[name]} if lost.get(name, []) != [] else k for name, k in shard_keys.items()}
    return keyed("regenerate", config, shards=shards)


class RegenerationPlan:
    """The shards to regenerate (prepare's), their keys, and the server: the extraction server itself, with the
    very spec extraction starts (so the target loads once for both stages). The whole config: the keys and the
    server's spec (`eyrie.vllm.spec.ServerSpec.for_extraction`) are computed from identity's dotted paths."""

    def __init__(self, config: PipelineConfig, run: RunFolder, report, node: str | None = None):
        from eyrie.stages.extract.plan import ExtractionPlan

        self.config = config
        self.run = run
        # What regenerate_shard renders each variant with (its `variants`); first, so a name no variant declares is
        # refused before anything else is done.
        self.variants = template_mix(config.regenerate, config.evaluate)
        self.dir = run.stage(STAGE)
        self.shards = load_shards(run.prepare)
        if not self.shards:
            raise RegenerationError(f"{run.prepare / 'shards.json'} lists no shards: run the prepare stage first")
        server = ExtractionPlan(config, run, report, [], node=node)
        self.spec, self.server_dir, self.staging = server.spec, server.server_dir, server.staging
        template = remembered_tokenizer_fingerprint(config.target, run.fingerprints)  # no transformers import
        self.keys = {s.name: shard_key(template, s, config) for s in self.shards}

    @property
    def key(self) -> str:
        """The assembly's key, from the shards as their manifests stand now (`stage_key`'s `lost`): read after the
        shards ran, it tells an assembly that lacks rows lost to server errors from one that has them."""
        lost: dict[str, list[int] | None] = {}
        for s in self.shards:
            m = read_json(shard_paths(self.dir, s)[1])
            if m and m.get("key") == self.keys[s.name]:
                lost[s.name] = lost_rows(m)
        return stage_key(self.keys, self.config, lost)

    def is_complete(self, shard: Shard) -> bool:
        return shard_complete(self.dir, shard, self.keys[shard.name])

    def pending(self) -> list[Shard]:
        """Shards that are not complete, and complete ones that lost rows to server errors (retried now)."""
        return [s for s in self.shards if not self.is_complete(s) or has_losses(self.dir, s)]
