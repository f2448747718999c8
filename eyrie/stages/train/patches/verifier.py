"""The target's embedding, norm and head loaded by the checkpoint's own names."""

from __future__ import annotations


def _load_verifier_weights_by(names: dict[str, str]) -> None:
    """speculators asks its loader for the verifier's `embed_tokens.weight`, `lm_head.weight` and
    `model.norm.weight` and matches them by suffix and a few aliases, so a target with other names (GPT-NeoX's
    `gpt_neox.embed_in`, GPT-2's `transformer.wte`) fails with a KeyError or, worse, gets a layer's norm. Preflight
    resolved the checkpoint's own names; here the loader is given exactly those. A name left out (a tied head) is
    not asked for, and speculators falls back to the embedding as it does for tied targets."""
    from speculators.utils import loading

    load = loading.load_model_layers

    def load_model_layers(layer_names: list[str], model_path: str):
        wanted = {n: names[n] for n in layer_names if n in names}
        found = load(list(wanted.values()), model_path)
        return {n: found[key] for n, key in wanted.items() if key in found}

    loading.load_model_layers = load_model_layers
