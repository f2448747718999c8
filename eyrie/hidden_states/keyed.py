"""The key a hidden-state file was made under, in its own safetensors metadata.

A sample's file is named by its row (`hs_<i>.safetensors`), and a name says nothing about what made it: the same row
extracted from another target, other layers, another dtype or encoding has the same name, the same token ids and the
same shape. So each file carries, in its header's `__metadata__`, the key of everything its values are a function of
besides its token ids (`eyrie.stages.extract.plan.sample_key`), and extraction keeps a file from an interrupted
attempt only when it carries the key the shard is extracted under (`eyrie.stages.extract.shard.extract_shard`).
Packs carry their shard's key the same way (`eyrie.hidden_states.packs.KEY_METADATA`).

The standard library only: the vLLM connector (eyrie/vllm/plugin/connector.py) and extraction both import it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SAMPLE_KEY = "eyrie_sample_key"  # a sample file's safetensors metadata: the key its values were made under
_MAX_HEADER = 100 << 20  # safetensors' own bound on a header
# A key as it may stand in a server file's name: what `eyrie.run.identity.key` makes (16 hex digits), with room.
_NAME_KEY = re.compile(r"[0-9A-Za-z_-]{1,64}")
_SUFFIX = ".safetensors"
_NAME_TAG = ".key-"


def _parse(header: bytes, what: str) -> dict:
    try:
        parsed = json.loads(header)
    except ValueError:
        raise ValueError(f"unreadable: {what} has no safetensors header") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"unreadable: {what} has no safetensors header")
    return parsed


def _header_length(prefix: bytes, what: str) -> int:
    if len(prefix) < 8:
        raise ValueError(f"unreadable: {what} is shorter than a safetensors header")
    n = int.from_bytes(prefix[:8], "little")
    if n > _MAX_HEADER:
        raise ValueError(f"unreadable: {what} declares a {n}-byte header")
    return n


def header_of(data: bytes, what: str = "the file") -> tuple[int, dict]:
    """(where the tensors' data starts, the parsed header) of a safetensors file's bytes; ValueError if unreadable."""
    n = _header_length(data, what)
    if len(data) < 8 + n:
        raise ValueError(f"unreadable: {what} ends inside its header")
    return 8 + n, _parse(data[8 : 8 + n], what)


def key_in(header: dict) -> str | None:
    """The sample key a parsed header records, or None (a file written before files recorded it)."""
    meta = header.get("__metadata__")
    key = meta.get(SAMPLE_KEY) if isinstance(meta, dict) else None
    return key if isinstance(key, str) else None


def file_key(path: Path) -> str | None:
    """The sample key recorded in the file at `path` (its header only is read), or None when it records none.
    ValueError when the file has no readable safetensors header."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = _header_length(prefix, str(path))
            header = f.read(n)
    except OSError as err:
        raise ValueError(f"unreadable: {err}") from None
    if len(header) < n:
        raise ValueError(f"unreadable: {path} ends inside its header")
    return key_in(_parse(header, str(path)))


def with_key(data: bytes, key: str) -> bytes:
    """A safetensors file's bytes with `key` recorded as its sample key (other metadata kept), the tensors' bytes
    unchanged: a new header before the same data (its offsets are relative to where the data starts), padded to
    8 bytes as safetensors writes it."""
    start, header = header_of(data)
    meta = header.pop("__metadata__", None)
    meta = dict(meta) if isinstance(meta, dict) else {}
    meta[SAMPLE_KEY] = key
    head = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + data[start:]


def key_metadata(key: str | None) -> dict[str, str] | None:
    """The `metadata` argument of safetensors' `save_file` that records `key` (None when there is no key)."""
    return {SAMPLE_KEY: key} if key else None


# The key on its way through the server. An extraction request asks for it in its `kv_transfer_params`
# (`{SAMPLE_KEY: key}`); the connector's scheduler side, which names each request's file, puts it in the name
# (`eyrie-<random>.key-<key>.safetensors`), and its writer, in another process, reads it back from the name it is
# handed and records it in the file's metadata: the name is the one thing vLLM already carries from one to the other.


def name_with_key(name: str, key: object) -> str:
    """The server file name `name` (`*.safetensors`) carrying `key`; unchanged when `key` is not one (None, or
    characters a name must not hold: a client's value never steers the path)."""
    if not isinstance(key, str) or not _NAME_KEY.fullmatch(key) or not name.endswith(_SUFFIX):
        return name
    return f"{name[: -len(_SUFFIX)]}{_NAME_TAG}{key}{_SUFFIX}"


def key_from_name(path: str) -> str | None:
    """The key `name_with_key` put in a server file's name, or None."""
    name = Path(path).name
    if not name.endswith(_SUFFIX):
        return None
    stem = name[: -len(_SUFFIX)]
    _, tag, key = stem.rpartition(_NAME_TAG)
    return key if tag and _NAME_KEY.fullmatch(key) else None
