"""prepare's key, and the costly fingerprints it is made of remembered in the run folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

from eyrie.config import DataConfig, TargetConfig
from eyrie.run.files import atomic_write_json, read_json, sha256_json
from eyrie.stages.prepare.source import _local_files, _local_source, is_hub_source, source_fingerprint
from eyrie.target.metadata import load_tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """What the loaded tokenizer does: its chat template, size, special tokens and, with a fast backend, its whole
    serialization; without one (a slow tokenizer such as Kimi's), its vocabulary. Its files enter the keys too
    (`eyrie.run.identity.FILE_KINDS["tokenizer"]`): a slow tokenizer's merges live only there."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return sha256_json(
        [
            tokenizer.chat_template,
            len(tokenizer),
            tokenizer.eos_token,
            getattr(tokenizer, "special_tokens_map", None),
            hashlib.sha256(backend.to_str().encode()).hexdigest()
            if backend is not None
            else sha256_json(sorted(tokenizer.get_vocab().items())),
        ]
    )


def prepare_key(target: TargetConfig, data: DataConfig, memo: Path | None = None) -> str:
    """The identity of prepare's output (`eyrie.run.identity.STAGES["prepare"]`): what is read, how it is
    tokenized, how it is cut.

    With `memo` (a JSON file in the run folder), the two fingerprints that cost seconds are remembered there under
    what determines them, and reused while that is unchanged: the source's (local files: each one's path, size,
    mtime, ctime and inode; a hub dataset is not remembered, its fingerprint is a commit lookup) and the tokenizer's
    (loading it imports transformers: the target's tokenizer and target files by content, the revision,
    `trust_remote_code`, the installed tokenizer libraries and the code of `tokenizer_fingerprint`). The key is the
    same with or without it."""
    from eyrie.config import PipelineConfig
    from eyrie.target.metadata import stage_key as keyed

    config = PipelineConfig.model_construct(target=target, data=data)
    remembered = _read_memo(memo)
    source_id = _source_memo_id(data)
    source = remembered.get("source", {}).get(source_id) if source_id else None
    if source is None:
        source = source_fingerprint(data)
    tokenizer_id = _tokenizer_memo_id(target)
    tokenizer = remembered.get("tokenizer", {}).get(tokenizer_id)
    if tokenizer is None:
        tokenizer = tokenizer_fingerprint(load_tokenizer(target))
    _remember(
        memo,
        remembered,
        {"tokenizer": {tokenizer_id: tokenizer}, **({"source": {source_id: source}} if source_id else {})},
    )
    return keyed("prepare", config, source=source, tokenizer=tokenizer)


def remembered_tokenizer_fingerprint(target: TargetConfig, memo: Path | None) -> str:
    """`tokenizer_fingerprint(load_tokenizer(target))`, remembered in `memo` as `prepare_key` remembers it: a stage
    that keys on the template (regeneration) costs no transformers import on a run whose target is unchanged."""
    remembered = _read_memo(memo)
    tokenizer_id = _tokenizer_memo_id(target)
    tokenizer = remembered.get("tokenizer", {}).get(tokenizer_id)
    if tokenizer is None:
        tokenizer = tokenizer_fingerprint(load_tokenizer(target))
        _remember(memo, remembered, {"tokenizer": {tokenizer_id: tokenizer}})
    return tokenizer


def _remember(memo: Path | None, remembered: dict, fresh: dict) -> None:
    """Write `fresh` over what `memo` held (entries under other ids are dropped, the other kinds kept)."""
    if memo is None or fresh == {k: remembered.get(k) for k in fresh}:
        return
    try:
        atomic_write_json(memo, {**remembered, **fresh})
    except OSError:
        pass  # a read-only run folder: the fingerprints are computed again next time, nothing else changes


def _read_memo(memo: Path | None) -> dict:
    if memo is None:
        return {}
    try:
        value = read_json(memo)
    except (OSError, ValueError):
        return {}  # missing or damaged: computed again (and rewritten)
    return value if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()) else {}


def _source_memo_id(data: DataConfig) -> str | None:
    """What a local source's fingerprint is remembered under: each file's resolved path and stat (size, mtime,
    ctime, inode: a rewrite in place changes mtime and ctime, a replacement the inode)."""
    if is_hub_source(data):
        return None
    path = _local_source(data)
    stats = []
    for f in _local_files(path):
        st = f.stat()
        stats.append((str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return sha256_json(["source", str(path.resolve()), stats])


def _tokenizer_memo_id(target: TargetConfig) -> str:
    """What the tokenizer's fingerprint is remembered under: everything `load_tokenizer` and
    `tokenizer_fingerprint` depend on."""
    import inspect

    from eyrie.run.identity import installed_version
    from eyrie.target import metadata

    libraries = ("transformers", "tokenizers", "sentencepiece", "tiktoken", "protobuf")
    return sha256_json(
        [
            "tokenizer",
            target.model,
            target.revision,
            target.trust_remote_code,
            metadata.file_identity("tokenizer", target),
            metadata.file_identity("target", target),  # config.json names the tokenizer class; remote code lives here
            [installed_version(d) for d in libraries],
            inspect.getsource(tokenizer_fingerprint),
            inspect.getsource(metadata.load_tokenizer),
        ]
    )
