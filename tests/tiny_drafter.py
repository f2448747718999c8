"""A one-layer EAGLE-3 drafter at toy width, seeded, with the norms speculators' CLI turns on: the same model
for the trainer-entry unit tests and for every rank of the DDP check (and its one-process reference), and a loader
of fixed batches for it."""

from __future__ import annotations


def tiny_eagle3():
    """A one-layer EAGLE-3 drafter at toy width (seeded: every rank and the reference build the same one)."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig, core
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=256,
        num_hidden_layers=1,
    )
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=64,
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="x", architectures=["X"]),
        ),
    )
    torch.manual_seed(0)
    model = core.Eagle3DraftModel(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.05)
    t2d = torch.zeros(256, dtype=torch.bool)
    ids = torch.randperm(256)[:64].sort().values
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(64))
    return model


class ListLoader:
    """What the trainer asks of its loader: a length, a batch sampler (none here) and the batches."""

    batch_sampler = None

    def __init__(self, batches: list[dict]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter([dict(b) for b in self.batches])
