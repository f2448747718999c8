"""Tiny targets the project builds itself, deterministically and without downloads.

Each is a folder a vLLM or transformers user would recognise: config.json, model.safetensors and a fast tokenizer
with a chat template. They stand in for the production target in the demo and the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from eyrie.target.tiny.families import FAMILIES
from eyrie.target.tiny.tokenizer import build_tokenizer

TINY_TARGETS = (
    "tiny-llama",
    "tiny-llama-chat",
    "tiny-deepseek-v3",
    "tiny-kimi-k25",
    "tiny-gpt2",
    "tiny-opt",
    *FAMILIES,
)


# A target whose recipe changed is built again over an older folder: the marker names the recipe it was built by.
RECIPES = {"tiny-llama-chat": "taught with fixed CPU numerics (v2)"}


def _marker(kind: str) -> str:
    return " ".join([kind, RECIPES.get(kind, "")]).strip() + "\n"


def build_target(kind: str, path: str | Path, seed: int = 0, **kw) -> Path:
    """Write tiny target `kind` into `path` (idempotent: an existing complete folder of the same recipe is kept)."""
    path = Path(path)
    done = path / ".complete"
    if done.exists() and (kind not in RECIPES or done.read_text() == _marker(kind)):
        return path
    done.unlink(missing_ok=True)
    build: Callable[..., None]
    if kind == "tiny-llama":
        from eyrie.target.tiny.llama import build_llama as build
    elif kind == "tiny-llama-chat":  # the demo's target: taught the bundled conversations (about a minute)
        from functools import partial

        from eyrie.target.tiny.pretrain import build_taught_llama

        # In a child process with fixed CPU numerics, so that every machine builds the same weights.
        build = partial(build_taught_llama, pretrain_steps=kw.pop("pretrain_steps", 200))
    elif kind == "tiny-deepseek-v3":
        from eyrie.target.tiny.deepseek import build_deepseek_v3 as build
    elif kind == "tiny-gpt2":
        from eyrie.target.tiny.classic import build_gpt2 as build
    elif kind == "tiny-opt":
        from eyrie.target.tiny.classic import build_opt as build
    elif kind == "tiny-kimi-k25":
        from eyrie.target.tiny.kimi import build_kimi_k25 as build
    elif kind in FAMILIES:  # the compatibility matrix's other architectures
        build = FAMILIES[kind]
    else:
        raise ValueError(f"unknown tiny target {kind!r}; choose one of {', '.join(TINY_TARGETS)}")
    path.mkdir(parents=True, exist_ok=True)
    build(path, seed=seed, **kw)
    done.write_text(_marker(kind))
    return path


__all__ = ["TINY_TARGETS", "build_target", "build_tokenizer"]
