"""The stage's keys and plan: everything the flow needs to know before deciding whether vLLM must start at all."""

from __future__ import annotations

import logging
from pathlib import Path

from eyrie.config import PipelineConfig, RegenerateConfig
from eyrie.errors import DiskFullError, ExtractionError
from eyrie.hidden_states.check import record_context
from eyrie.hidden_states.packs import PACKED
from eyrie.hidden_states.staging import staging_dir
from eyrie.run.folder import sample_path
from eyrie.stages.extract.manifest import drop_unpacked, shard_complete
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import Shard, load_shards


def content_key(config: PipelineConfig, captured_ids: list[int], shard: Shard) -> str:
    """A shard's hidden states by content (`eyrie.run.identity.STAGES["extract"]`): what the target computes
    (weights, dtype, output-shaping server arguments), what is captured, which rows, how values are encoded. What
    training keys on: the same hidden states laid out another way train the same drafter. The whole config: the
    key is computed from the declaration's dotted paths."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed(
        "extract",
        config,
        captured=list(captured_ids),
        shard={"fingerprint": shard.fingerprint, "rows": [shard.start, shard.stop]},
    )


def sample_key(config: PipelineConfig, captured_ids: list[int]) -> str:
    """What every sample's hidden-state file is made under: the content key's inputs (`STAGES["extract"]`: the
    target's weights, dtype, output-shaping server arguments and environment, the captured layers, the encoding)
    for no shard in particular, since a file's rows are its token ids, which extraction checks apart. Each file
    records it (`eyrie.hidden_states.keyed`) and a file on disk is kept only under it, so a new target or other
    layers redo the files of the same rows; a new shard plan over the same rows and tokens does not."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed("extract", config, captured=list(captured_ids), shard=None)


def shard_key(content: str, config: PipelineConfig) -> str:
    """The shard's manifest key: its content key and the storage layout (`STAGES["extract.layout"]`). The whole
    config: the key is computed from the declaration's dotted paths."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed("extract.layout", config, content=content)


def source_folder(run, regenerate: RegenerateConfig) -> Path:
    """The folder whose dataset and shards extraction reads: regenerate's when the config regenerates, else
    prepare's (`eyrie.stages.regenerate.source.extraction_source` also checks that regenerate's is current)."""
    return run.stage("regenerate") if regenerate.enabled else run.prepare


log = logging.getLogger(__name__)


class ExtractionPlan:
    """`node`: this node's name when several nodes share the run folder (its server lives in `extract/nodes/<node>/`);
    None on a single node (`extract/`). `source`: the folder `shards` come from (`source_folder` by default).
    The whole config: the shards' keys and the server's spec (`ServerSpec.for_extraction`) are computed from
    identity's dotted paths."""

    def __init__(
        self,
        config: PipelineConfig,
        run,
        report,
        shards: list[Shard],
        node: str | None = None,
        source: Path | None = None,
    ):
        from eyrie.run.folder import server_folder
        from eyrie.vllm.spec import ServerSpec

        self.run = run
        self.shards = shards
        self.source = Path(source) if source is not None else source_folder(run, config.regenerate)
        self.finished_from_disk: list[str] = []  # shards `pending` found whole on disk and gave their manifest
        self.server_dir = server_folder(run.extract, node)
        self.captured_ids = report.captured_layer_ids
        self.hidden_size = report.hidden_size
        self.hidden_states_dtype = config.extraction.hidden_states_dtype
        self.storage = config.extraction.storage
        self.node = node
        self.online = config.train.hidden_states == "online"
        # What training keys on (content), and what a shard's manifest records (content and layout).
        self.data_keys = {s.name: content_key(config, self.captured_ids, s) for s in shards}
        self.keys = {name: shard_key(k, config) for name, k in self.data_keys.items()}
        self.sample_key = sample_key(config, self.captured_ids)  # what each file records it was made under
        self.spec = ServerSpec.for_extraction(config, self.captured_ids, str(self.staging))
        record_context(run.extract, config, report)  # what the capture proof reads (eyrie.hidden_states.check)

    @property
    def staging(self) -> Path:
        if (
            self.online
        ):  # train.hidden_states: online: the trainer reads each file once and deletes it (eyrie.stages.train.online)
            return staging_dir(self.run.root, self.node)
        # Inside the run folder: files are renamed from here into hidden_states, which needs one filesystem.
        return self.server_dir / "staging"

    def select(self, names: list[str]) -> None:
        """Narrow the plan to these shards (a node's share of a fanned-out extraction)."""
        wanted = set(names)
        unknown = sorted(wanted - set(self.keys))
        if unknown:
            raise ExtractionError(f"shards {unknown} are not in {self.run.prepare / 'shards.json'}")
        self.shards = [s for s in self.shards if s.name in wanted]

    def manifest_path(self, shard: Shard) -> Path:
        return self.run.shard_manifests / f"{shard.name}.json"

    def is_complete(self, shard: Shard, rehash_changed: bool = False) -> bool:
        """`shard_complete`; a complete packed shard also loses the per-sample files a kill left after its manifest
        (`drop_unpacked`: one stat when there are none)."""
        done = shard_complete(self.manifest_path(shard), self.keys[shard.name], self.run.hidden_states, rehash_changed)
        if done and self.storage == PACKED:
            drop_unpacked(self.run.hidden_states, shard)
        return done

    def pending(self, rehash_changed: bool = False) -> list[Shard]:
        """The shards that need the target: not complete, and not finished by `finish_from_disk`."""
        return [s for s in self.shards if not self.is_complete(s, rehash_changed) and not self.finish_from_disk(s)]

    def finish_from_disk(self, shard: Shard) -> bool:
        """Give a shard whose samples are all on disk, but that no manifest vouches for, its manifest (or pack),
        without a server: a kill between its last file and its manifest, a switch of `extraction.storage` or of a
        layout-only setting. Every file is checked as an interrupted attempt's are (`extract_shard` with no
        client: made under the plan's `sample_key`, whole, for its tokens), so this reads the shard's files once; a
        shard with any sample missing costs a stat per file up to the first missing one. True when the shard is
        complete now; a bad file (or one made under another key) is removed and the shard pending."""
        hidden = self.run.hidden_states
        if not all(sample_path(hidden, i).exists() for i in range(shard.start, shard.stop)):
            return False
        try:
            extract_shard(
                None,
                self.source,
                shard,
                self.keys[shard.name],
                hidden,
                self.manifest_path(shard),
                len(self.captured_ids),
                self.hidden_size,
                log=log.info,
                hidden_states_dtype=self.hidden_states_dtype,
                storage=self.storage,
                sample_key=self.sample_key,
            )
        except DiskFullError:
            raise  # the server would meet the same full disk: said now, before it loads
        except ExtractionError as err:
            log.info(f"{shard.name}: pending ({err})")
            return False
        self.finished_from_disk.append(shard.name)
        log.info(f"{shard.name}: every sample was on disk; its manifest is written without a server")
        return True


def online_plan(config: PipelineConfig, run, report: dict, data_dir: Path):
    """What online training needs from extraction, with nothing extracted: the shard keys extraction would give
    (target identity, captured layers, shard fingerprint: the train key's data keys), the extraction server's spec
    (its storage path on tmpfs, see `ExtractionPlan.staging`) and its folder."""
    return ExtractionPlan(config, run, PreflightReport(**report), load_shards(data_dir), source=data_dir)
