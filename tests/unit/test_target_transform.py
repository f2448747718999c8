"""Issue 25 item 8: the drafter's training labels apply the target's own transform
(eyrie/stages/train/patches/target_transform.py). For tiny targets of real transformers classes with each
approximation (a head bias, a LayerNorm final norm, an offset RMSNorm, a soft-cap, a logit scale), a real speculators
EAGLE-3 drafter is built by its own `from_training_args` (Eyrie's verifier-weight loader in place, as the trainer
runs it), its forward is run with the target's final hidden state, and the label distribution its loss receives is
compared with the target's own next-token distribution from transformers, restricted to the draft vocabulary:
equal to float tolerance with the patch, different without it."""

from __future__ import annotations

import json

import pytest
import torch

from eyrie.config import TargetConfig
from eyrie.target.tiny.families import build_gemma2, build_gpt_neox

DRAFT_VOCAB = 96
# Where the labels are made: the CPU here; on a machine with a GPU also CUDA, the GPU trainer's path (speculators
# compiles the drafter's forward there, and the drafter attends with flex attention).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _build(path, config_name: str, model_name: str, drop=(), **fields):
    import transformers

    from eyrie.target.tiny.families import _build as build

    build(path, 0, getattr(transformers, config_name), getattr(transformers, model_name), fields, {}, drop=drop)


# Each family: its builder and the approximations it carries (all applied by the trainer).
FAMILIES = {
    # a head bias and a LayerNorm final norm with a bias
    "phi": (
        lambda p: _build(p, "PhiConfig", "PhiForCausalLM", drop=("head_dim",), partial_rotary_factor=0.5),
        {"head bias", "final norm"},
    ),
    "gpt-neox": (build_gpt_neox, {"final norm"}),  # a LayerNorm final norm (weight and bias), untied head
    "gemma": (lambda p: _build(p, "GemmaConfig", "GemmaForCausalLM"), {"final norm"}),  # (1 + weight) RMSNorm alone
    "gemma2": (build_gemma2, {"final norm", "logit soft-capping"}),  # offset RMSNorm and a final soft-cap
    "granite": (
        lambda p: _build(p, "GraniteConfig", "GraniteForCausalLM", logits_scaling=4.0),
        {"logit scaling"},
    ),  # logits divided by a scale
    "cohere": (
        lambda p: _build(p, "CohereConfig", "CohereForCausalLM", logit_scale=0.25),
        {"final norm", "logit scaling"},
    ),  # logits multiplied by a scale; a LayerNorm without bias
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    built = {}
    for name, (build, _) in FAMILIES.items():
        build(root / name)
        built[name] = root / name
    return built


@pytest.fixture
def speculators_restored(monkeypatch):
    """speculators' loader and Eagle3DraftModel as they were, after the test (the patches are process-wide)."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.utils import loading

    monkeypatch.setattr(loading, "load_model_layers", loading.load_model_layers)
    monkeypatch.setattr(Eagle3DraftModel, "load_verifier_weights", Eagle3DraftModel.load_verifier_weights)


def _drafter(path, t2d, d2t, device="cpu"):
    from speculators.models.eagle3.core import Eagle3DraftModel

    from eyrie.target.drafter import draft_layer_config

    return (
        Eagle3DraftModel.from_training_args(
            verifier_config=draft_layer_config(TargetConfig(model=str(path)), 1),
            t2d=t2d,
            d2t=d2t,
            target_layer_ids=[2, 4, 5],
            verifier_name_or_path=str(path),
            draft_vocab_size=DRAFT_VOCAB,
            norm_before_residual=True,
            ttt_steps=1,
            draft_attn_impl="sdpa" if device == "cpu" else "simple_flex_attention",
        )
        .float()
        .to(device)
    )


def _target_run(path, ids):
    """The target's final hidden state (what the final norm receives: the residual stream extraction captures) and
    its own next-token logits, by transformers."""
    from transformers import AutoModelForCausalLM

    from eyrie.target.metadata import _final_norm

    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seen = {}
    norm = _final_norm(target)[1]
    norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0].detach()))  # returns None: no change
    with torch.no_grad():
        logits = target(input_ids=ids).logits
    return seen["h"], logits


def _labels(drafter, h, ids, monkeypatch):
    """The label logits the drafter's loss receives when its forward runs with the final hidden state `h`."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import core

    seen = {}
    compute = core.compute_metrics

    def capture(logits, targets, *args, **kwargs):
        seen["targets"] = targets.detach()
        return compute(logits, targets, *args, **kwargs)

    monkeypatch.setattr(core, "compute_metrics", capture)
    n, device = ids.shape[1], drafter.verifier_lm_head.weight.device
    with torch.no_grad():
        drafter(
            hidden_states=torch.randn(1, n, 3 * h.shape[-1], device=device),
            input_ids=ids.to(device),
            document_ids=torch.zeros(1, n, dtype=torch.long, device=device),
            loss_mask=torch.ones(1, n, dtype=torch.bool, device=device),
            verifier_last_hidden_states=h.to(device),
            ttt_steps=1,
            loss_config=resolve_loss_config("kl_div", "eager"),  # as the trainer runs (--loss-implementation eager)
        )
    return seen["targets"].cpu()


def _vocab(path):
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(vocab, generator=gen)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return vocab, t2d, ids - torch.arange(DRAFT_VOCAB)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_labels_are_the_targets_own_distribution(targets, family, device, speculators_restored, monkeypatch):
    from eyrie.stages.train.patches.target_transform import apply_target_transform
    from eyrie.stages.train.patches.verifier import _load_verifier_weights_by
    from eyrie.target.labels import label_report
    from eyrie.target.metadata import resolve_borrowed_weights

    path = targets[family]
    cfg = json.loads((path / "config.json").read_text())
    target = TargetConfig(model=str(path))
    _load_verifier_weights_by(resolve_borrowed_weights(target, cfg).speculators_names())
    vocab, t2d, d2t = _vocab(path)
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(2))
    h, logits = _target_run(path, ids)
    want = torch.softmax(logits[..., t2d], dim=-1)  # the target's distribution over the draft vocabulary

    before = _drafter(path, t2d, d2t, device)
    plain = _labels(before, h, ids, monkeypatch)
    drafter = _drafter(path, t2d, d2t, device)
    apply_target_transform(drafter, path)  # as the entry's build applies it (train.target_transform on)
    patched = _labels(drafter, h, ids, monkeypatch)

    got = torch.softmax(patched, dim=-1)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()
    assert (torch.softmax(plain, dim=-1) - want).abs().max() > 1e-3  # speculators' own labels are not the target's

    # Preflight and the trainer agree: what the trainer applied is preflight's "applied:" lines, and nothing of
    # these approximations is left a warning.
    warnings, applied = label_report(target, cfg)
    assert {line.split(": ", 2)[1].split(" (", 1)[0] for line in applied} == FAMILIES[family][1]
    assert not [w for w in warnings if "embedding scale" not in w], warnings

    # Only the labels changed: the drafter holds, saves and exports exactly speculators' tensors, with the values
    # speculators gave them (`verifier_norm.weight` stays the target's raw final-norm weight, never saved).
    state, plain_state = drafter.state_dict(), before.state_dict()
    assert set(state) == set(plain_state)
    for name in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"):
        assert torch.equal(state[name], plain_state[name]), name


def test_the_switch_off_is_read_from_the_options_file_and_leaves_speculators_labels(tmp_path):
    """train.target_transform: false reaches the trainer in its options file (no environment variable), and the
    entry installs the labels' transform only when it is on."""
    import inspect

    from eyrie.stages.train import entry
    from eyrie.stages.train.options import OPTIONS_FLAG, TrainerOptions, pop_options

    path = TrainerOptions(device="cpu", target_transform=False).write(tmp_path / "trainer-options.json")
    argv = ["--epochs", "1", OPTIONS_FLAG, str(path)]
    assert pop_options(argv).target_transform is False and argv == ["--epochs", "1"]
    assert pop_options([]).target_transform is True
    assert "if options.target_transform:" in inspect.getsource(entry.build_drafter)


def test_a_tensor_the_labels_need_missing_from_the_checkpoint_is_named(targets, tmp_path, speculators_restored):
    """A head bias the class has but the checkpoint lacks, or a verifier that is no local folder: a clear error
    naming what is missing and the way out."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eyrie.stages.train.patches.target_transform import apply_target_transform
    from eyrie.stages.train.patches.verifier import _load_verifier_weights_by
    from eyrie.target.metadata import resolve_borrowed_weights

    path = tmp_path / "phi"
    shutil.copytree(targets["phi"], path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "lm_head.bias"}, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    _load_verifier_weights_by(resolve_borrowed_weights(TargetConfig(model=str(path)), cfg).speculators_names())
    _, t2d, d2t = _vocab(path)
    drafter = _drafter(path, t2d, d2t)
    with pytest.raises(ValueError, match=r"`lm_head.bias`.*train.target_transform: false"):
        apply_target_transform(drafter, path)
    with pytest.raises(ValueError, match=r"not a local folder with a config.json.*train.target_transform: false"):
        apply_target_transform(drafter, "some-org/some-model")  # a hub id: Eyrie gives the trainer a local snapshot


def test_a_logit_transform_the_probe_cannot_recognise_stays_a_warning():
    """A forward whose logit transform is neither a scale nor a soft-cap is not probed into a wrong formula: the
    labels leave it, and the config attribute that names it stays a warning. A config attribute the forward does
    not apply (a soft-cap value on a class that never reads it) is not applied either."""
    import transformers

    from eyrie.target.labels import label_plan, probe_logits

    class Odd(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = torch.sinh(out.logits)
            return out

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=256)
    with torch.device("meta"):
        odd = Odd(transformers.LlamaConfig(**small, final_logit_softcapping=30.0))
        plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, final_logit_softcapping=30.0))
    assert probe_logits(odd) is None
    for model in (odd, plain):
        plan = label_plan(model)
        assert plan.logits is None
        assert [(a.what, a.applied) for a in plan.approximations] == [("logit soft-capping", "")]
    assert probe_logits(plain).scale == 1.0 and probe_logits(plain).cap is None  # measured: the forward ignores it
    assert isinstance(odd.lm_head, torch.nn.Linear)  # the probe leaves the model as it was
    assert "forward" not in vars(odd.get_decoder())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_plan_is_probed_on_the_cpu_whatever_the_default_device(targets, family):
    """The GPU trainer builds its drafter (and so runs the probes) under a CUDA default device; the probes make
    their own tensors on the CPU, so the plan is the one the CPU default gives (here the default is the meta device,
    where a probe's tensors would hold no values)."""
    from eyrie.target.labels import label_plan
    from eyrie.target.metadata import _meta_model

    path = targets[family]
    model = _meta_model(TargetConfig(model=str(path)), json.loads((path / "config.json").read_text()))
    on_cpu = label_plan(model)
    with torch.device("meta"):
        elsewhere = label_plan(model)
    assert (elsewhere.norm, elsewhere.head, elsewhere.logits) == (on_cpu.norm, on_cpu.head, on_cpu.logits)
    assert [(a.what, a.applied) for a in elsewhere.approximations] == [
        (a.what, a.applied) for a in on_cpu.approximations
    ]
    assert {a.what for a in on_cpu.approximations if a.applied} == FAMILIES[family][1]
