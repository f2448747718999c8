"""The trainer's command line: the optimizer and log frequency Eyrie passes are flags speculators accepts and
resolves to the configured values; the GPU-only changes in `eyrie.stages.train.entry` keep their CPU behaviour."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from conftest import TARGET_FACTS as FACTS
from conftest import config_dict
from tiny_drafter import ListLoader, tiny_eagle3

from eyrie.config import parse_config
from eyrie.errors import ConfigError
from eyrie.stages.train.command import training_command
from eyrie.stages.train.data import TrainingData
from eyrie.stages.train.trainer import untrained_key


def _command(tmp_path: Path, device: str = "cuda", **train) -> list[str]:
    config = parse_config(config_dict(tmp_path / "target", train=train))
    save = tmp_path / "run" / "train" / "k" / "checkpoints"
    # a warm start: no draft layer config to build, so no target folder is needed
    data = TrainingData(
        tmp_path / "data", tmp_path / "hs", tmp_path / "d2t.npy", tmp_path / "t2d.npy", [2, 4, 5], FACTS
    )
    return training_command(
        config,
        data,
        save,
        1.0,
        device,
        warm_start=tmp_path / "drafter",
    )


def _value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times"
    return cmd[cmd.index(flag) + 1]


def _resolved(cmd: list[str]) -> dict:
    """Every trainer setting as speculators itself resolves the arguments `eyrie.stages.train.entry` hands it."""
    from speculators.train.config import TrainConfig

    argv = cmd[cmd.index("eyrie.stages.train.entry") + 1 :]
    for own in ("--eyrie-verifier-weights", "--eyrie-metrics", "--eyrie-options"):  # the entry consumes these itself
        i = argv.index(own)
        del argv[i : i + 2]
    return TrainConfig.resolve(argv).flatten()


def _options(cmd: list[str]) -> dict:
    return json.loads(Path(_value(cmd, "--eyrie-options")).read_text())


def test_the_trainer_gets_its_device_labels_and_speed_choices_in_a_file_not_the_environment(tmp_path):
    """The device, train.target_transform and train.speed reach the trainer in the run folder's
    trainer-options.json (`--eyrie-options`); its environment holds no EYRIE_ variable of the trainer's."""
    from eyrie.stages.train.command import trainer_environment
    from eyrie.stages.train.options import TrainerOptions

    cmd = _command(tmp_path, "cuda", target_transform=False, speed={"gpu_feed": False, "one_kv_length": True})
    options = _options(cmd)
    assert Path(_value(cmd, "--eyrie-options")) == tmp_path / "run" / "train" / "k" / "trainer-options.json"
    assert options["device"] == "cuda" and options["target_transform"] is False
    assert options["speed"]["gpu_feed"] is False and options["speed"]["one_kv_length"] is True
    assert TrainerOptions.from_dict(options).switches.gpu_feed is False
    assert _options(_command(tmp_path, "cpu"))["device"] == "cpu"
    config = parse_config(config_dict(tmp_path / "target"))
    assert not [k for k in trainer_environment(config, "cuda", online=False) if k.startswith("EYRIE_TRAIN")]
    with pytest.raises(ValueError, match="ONE_KV_LENGHT is no switch"):
        TrainerOptions.from_dict({**options, "speed": {"ONE_KV_LENGHT": False}})


def test_auto_start_up_choices_follow_the_expected_training_time(tmp_path):
    """`auto`: a choice that saves seconds once and costs a share of every step is on for a short run, off for a run
    of hours; a resume decides by the steps left at the rate the trainer measured; an explicit value wins."""
    from eyrie.config import TrainConfig
    from eyrie.stages.train.patches.switches import STARTUP_TRADES, decide, expected_training_s
    from eyrie.stages.train.progress import METRICS
    from eyrie.stages.train.trainer import launch_switches

    speed = TrainConfig().speed
    short, hours = decide(speed, 60.0), decide(speed, 3 * 3600.0)
    assert short.one_kv_length and short.one_pointwise_config
    assert not hours.one_kv_length and not hours.one_pointwise_config
    assert hours.deferred_mask_compile and hours.eager_rotary  # no per-step cost: on whatever the length
    assert decide(speed, None).one_kv_length  # length unknown: the start-up wins
    for name, (saves, costs) in STARTUP_TRADES.items():
        assert getattr(decide(speed, 0.9 * saves / costs), name)
        assert not getattr(decide(speed, 1.1 * saves / costs), name)
    assert decide(TrainConfig(speed={"one_kv_length": True}).speed, 1e6).one_kv_length
    assert expected_training_s(100, 4096, None, 32000) == 100 * 4096 / 32000
    # 3 epochs of 1,000 steps of 4096 tokens at the assumed 32k tokens/s: ~6.4 min (on); of 20,000: ~2 h (off)
    train = TrainConfig(max_seq_len=4096)
    work = tmp_path / "work"
    work.mkdir()
    assert launch_switches(train, 1000, 0, work / METRICS).one_kv_length
    assert not launch_switches(train, 20000, 0, work / METRICS).one_kv_length
    # a resume 10 steps short of the end is short, and a slow measured rate makes 1,000 steps long
    assert launch_switches(train, 20000, 3 * 20000 - 10, work / METRICS).one_kv_length
    (work / METRICS).write_text("".join(json.dumps({"profile/tokens_per_s": v}) + "\n" for v in (500, 400, 450)))
    assert not launch_switches(train, 1000, 0, work / METRICS).one_kv_length


def test_defaults_are_adamw_and_sparse_logging(tmp_path):
    cmd = _command(tmp_path)
    assert _value(cmd, "--optimizer") == "adamw"
    assert _value(cmd, "--log-freq") == "50"
    flat = _resolved(cmd)
    assert flat["optimizer"] == "adamw" and flat["log_freq"] == 50


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_configured_optimizer_and_log_frequency_reach_speculators(tmp_path, optimizer):
    for device in ("cuda", "cpu"):
        cmd = _command(tmp_path, device, optimizer=optimizer, log_every_steps=7, lr=2e-4)
        flat = _resolved(cmd)
        assert flat["optimizer"] == optimizer
        assert flat["log_freq"] == 7
        # a warm start (as _command builds): promotion.warm_start_lr_scale (0.1) of train.lr
        assert flat["lr"] == pytest.approx(2e-5)
        # muon's own rate follows --lr (speculators' default), as it did before Eyrie passed --optimizer
        assert flat["muon_lr"] == pytest.approx(2e-5)


def test_bad_values_are_refused_naming_the_key(tmp_path):
    for train, key in (({"optimizer": "sgd"}, "train.optimizer"), ({"log_every_steps": 0}, "train.log_every_steps")):
        with pytest.raises(ConfigError) as info:
            parse_config(config_dict(tmp_path / "t", train=train), "cfg.yaml")
        assert f"`{key}`" in str(info.value)


def test_the_optimizer_is_part_of_the_train_key_and_logging_and_devices_are_not(tmp_path):
    from eyrie.stages.train.trainer import train_key

    def key(**t):
        return train_key(parse_config(config_dict(tmp_path / "t", train=t)), ["d"], "v", [2, 4, 5])

    assert key(optimizer="muon") != key()
    assert key(log_every_steps=1, devices=4, still_improving_warning=0.5, save_every_steps=10) == key()


def test_a_resume_across_a_device_change_warns(tmp_path):
    from eyrie.stages.train.trainer import resume_notes

    work = tmp_path / "work"
    (work / "checkpoints").mkdir(parents=True)
    config = parse_config(config_dict(tmp_path / "t", train={"devices": 8}))
    assert resume_notes(config.train, work, "cuda") == []  # the first launch records its settings
    assert resume_notes(config.train, work, "cuda") == []
    fewer = parse_config(config_dict(tmp_path / "t", train={"devices": 7}))
    (note,) = resume_notes(fewer.train, work, "cuda")
    assert "train.devices 8 -> 7" in note


def test_a_warm_start_trains_at_a_scaled_rate_and_keys_it(tmp_path):
    from eyrie.stages.train.command import learning_rate
    from eyrie.stages.train.trainer import train_key

    def config(scale: float):
        return parse_config(
            {**config_dict(tmp_path / "t", train={"lr": 1e-2}), "promotion": {"warm_start_lr_scale": scale}}
        )

    assert learning_rate(config(0.1), warm=False) == 1e-2
    assert learning_rate(config(0.1), warm=True) == pytest.approx(1e-3)
    assert _resolved(_command(tmp_path, "cpu", lr=1e-2))["lr"] == pytest.approx(1e-3)
    # the scale is part of the key (eyrie.run.identity.STAGES["train"])
    warm = {train_key(config(s), ["d"], "v", [2, 4, 5]) for s in (0.1, 0.5)}
    assert len(warm) == 2
    with pytest.raises(ConfigError, match="warm_start_lr_scale"):
        config(0)


# --- eyrie.stages.train.entry's GPU-only changes
# -------------------------------------------------------------------------


def test_worker_init_is_picklable_by_name_and_touches_no_accelerator(monkeypatch):
    import torch

    from eyrie.stages.train.patches import workers

    # a spawned DataLoader worker unpickles it by module and name
    assert pickle.loads(pickle.dumps(workers._worker_init)) is workers._worker_init
    called = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda *a: called.append(a))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: called.append(("threads", n)))
    workers._worker_init(3)
    assert called == [("threads", 1)]


def _step_timer_on_cpu(monkeypatch) -> None:
    import torch

    if not torch.accelerator.is_available():  # the step timer's, as the entry's CPU patch makes it (patches/cpu.py)
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)


def test_the_trainer_view_leaves_cpu_tensors_and_optimizers_alone(monkeypatch):
    import types

    import torch
    from speculators.train import trainer
    from speculators.train.optimizers import build_optimizers

    from eyrie.stages.train.eyrie_trainer import _fuse_adamw, _trainer_view
    from eyrie.stages.train.patches.switches import Switches

    view, _ = _trainer_view(Switches(), types.SimpleNamespace())  # type: ignore[arg-type]
    assert trainer.torch is torch  # speculators' module keeps its own
    assert view.autocast is torch.autocast and view.nn.Linear is torch.nn.Linear and view.float32 is torch.float32
    assert view.nn.utils.get_total_norm is torch.nn.utils.get_total_norm
    for args, kw in (
        ((3,), {"dtype": torch.float32, "device": "cpu"}),
        ((1.0,), {"dtype": torch.float32}),
        (([1, 2],), {}),
        ((2,), {}),
    ):
        got, want = view.tensor(*args, **kw), torch.tensor(*args, **kw)
        assert got.dtype == want.dtype and got.device == want.device and torch.equal(got, want)

    class Config:
        optimizer, lr, weight_decay = "adamw", 1e-3, 0.01
        muon_lr, muon_momentum, muon_weight_decay, muon_ns_steps, muon_adjust_lr_fn = 1e-3, 0.95, 0.1, 5, "original"

    (opt,) = build_optimizers(torch.nn.Linear(4, 4), Config)
    _fuse_adamw(opt)
    assert type(opt) is torch.optim.AdamW and not opt.param_groups[0]["fused"]  # CPU parameters: unchanged
    Config.optimizer = "muon"
    opts = build_optimizers(torch.nn.Sequential(torch.nn.Linear(4, 4)), Config)
    for o in opts:
        _fuse_adamw(o)
    assert [type(o).__name__ for o in opts] == ["Muon", "AdamW"] and not opts[1].defaults.get("fused")


def test_accuracy_counts_without_sync_are_speculators_counts():
    """Eyrie's accuracy counts equal speculators', and the drafter's `compute_metrics` (speculators' code) reads
    Eyrie's counts while speculators' own module keeps its function."""
    import torch
    from speculators.models import metrics as shared
    from speculators.models.eagle3 import metrics

    from eyrie.stages.train.patches import metrics as patches

    stock = metrics.compute_accuracy_single_step
    mine = patches.compute_metrics_without_sync()
    assert mine.__code__ is metrics.compute_metrics.__code__
    assert mine.__globals__["compute_accuracy_single_step"] is patches.compute_accuracy_single_step
    assert metrics.compute_accuracy_single_step is stock is shared.compute_accuracy_single_step
    g = torch.Generator().manual_seed(0)
    for case in range(60):
        n = int(torch.randint(1, 200, (1,), generator=g))
        pred, target = (torch.randint(0, 3, (1, n), generator=g) for _ in range(2))
        mask = [None, torch.randint(0, 2, (1, n), generator=g), torch.randint(0, 2, (1, n), generator=g).bool()][
            case % 3
        ]
        prev = None if case % 4 == 0 else torch.randint(0, 2, (1, n), generator=g).bool()
        prev_too = None if prev is None else prev.clone()
        want = shared.compute_accuracy_single_step(pred, target, mask, prev)
        got = patches.compute_accuracy_single_step(pred, target, mask, prev_too)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got))
        assert prev is None or torch.equal(prev, prev_too)  # updated in place alike


def test_clip_handed_to_fused_adamw_makes_the_same_update():
    import copy

    import torch

    from eyrie.stages.train.eyrie_trainer import EyrieTrainer, _trainer_view
    from eyrie.stages.train.patches.switches import Switches

    running = EyrieTrainer.__new__(EyrieTrainer)  # its clip and step alone, without a model or loaders
    running.switches, running._pending_clip, running.optimizers = Switches(), [], []
    view, _ = _trainer_view(Switches(), running)  # the trainer's view of torch: the clip through the running trainer
    for grad_scale, fused in ((100.0, True), (1e-3, True), (100.0, False)):  # clipped, not clipped, not fused
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        folded = copy.deepcopy(plain)
        opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=fused)
        opt_folded = torch.optim.AdamW(folded.parameters(), lr=1e-2, fused=fused)
        for _ in range(4):
            x = torch.randn(5, 8)
            for m in (plain, folded):
                m.zero_grad()
                (m(x).pow(2).sum() * grad_scale).backward()
            want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            opt_plain.step()
            got = view.nn.utils.clip_grad_norm_(folded.parameters(), 1.0)
            running.optimizers = [opt_folded]
            EyrieTrainer._optimizers_step(running)
            assert torch.allclose(want, got) and not hasattr(opt_folded, "grad_scale")
        for a, b in zip(plain.parameters(), folded.parameters()):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_forward_with_scalars_made_on_the_device_is_speculators_forward():
    """The drafter's forward with sync_free_metrics (speculators' source, its two host-made scalars made on the
    device, and Eyrie's accuracy counts) gives speculators' forward's tokens, loss, metrics and gradients exactly,
    bound on the drafter alone: speculators' class keeps its forward."""
    import torch
    from speculators.models.eagle3 import core

    from eyrie.stages.train.drafter import apply_speed_choices
    from eyrie.stages.train.patches.switches import Switches

    stock = core.Eagle3DraftModel.forward
    model, batch = _tiny_eagle3()
    # float32 inputs: the comparison below is exact
    raw = batch(torch.Generator().manual_seed(1))
    inputs = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in raw.items()}

    def run():
        model.zero_grad()
        tokens, loss, metrics = model(**inputs)
        loss.backward()
        return tokens, loss.detach(), metrics, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = run()
    only = Switches(deferred_mask_compile=False, one_kv_length=False, eager_rotary=False)
    apply_speed_choices(model, only)
    assert "forward" in vars(model) and core.Eagle3DraftModel.forward is stock
    assert model.forward.__func__.__code__ is not getattr(stock, "__wrapped__", stock).__code__  # the edited source
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0])) and torch.equal(want[1], got[1])
    assert want[2].keys() == got[2].keys()
    assert all(torch.equal(want[2][k], got[2][k]) and want[2][k].dtype == got[2][k].dtype for k in want[2])
    assert all(torch.equal(a, b) for a, b in zip(want[3], got[3]))
    assert type(tiny_eagle3()).forward is stock  # another drafter: speculators' forward


def _tiny_eagle3():
    """tiny_drafter's drafter and one batch for it."""
    import torch
    from speculators.losses import resolve_loss_config

    model = tiny_eagle3()

    def batch(g):
        n = 48
        return dict(
            hidden_states=torch.randn(1, n, 96, generator=g).bfloat16(),
            input_ids=torch.randint(0, 256, (1, n), generator=g),
            document_ids=torch.cat([torch.zeros(20), torch.ones(26), -torch.ones(2)]).long()[None],
            loss_mask=torch.randint(0, 2, (1, n), generator=g),
            position_ids=torch.cat([torch.arange(20), torch.arange(26), torch.zeros(2, dtype=torch.long)])[None],
            verifier_last_hidden_states=torch.randn(1, n, 32, generator=g).bfloat16(),
            ttt_steps=3,
            loss_config=resolve_loss_config("kl_div", "eager"),
        )

    return model, batch


def test_bf16_working_weights_train_like_float32_weights_under_autocast(monkeypatch):
    """BF16_WEIGHTS: the trainer's step (autocast forward, zero_grad, backward, clip, AdamW) on bfloat16 working
    copies gives the step on float32 weights under autocast up to bfloat16 rounding, and everything the clip, the
    optimizer and a checkpoint see is float32. Not bit-identical (norms multiply by bfloat16 weights, activations
    and the TTT steps' gradient sums are rounded to bfloat16); tolerances, from 3 steps on this toy drafter: loss
    within 1%, gradient norm within 3%, gradients' cosine similarity above 0.99, accuracy counts within 2."""
    import copy

    import torch

    from eyrie.stages.train.patches import working_weights

    monkeypatch.setattr(working_weights, "_WORKING", [])
    plain, batch = _tiny_eagle3()
    working = copy.deepcopy(plain)
    weights = working_weights._WorkingWeights(working, torch.bfloat16)
    seen = []
    working.register_forward_pre_hook(lambda m, a: seen.append({p.dtype for p in m.parameters()}))
    opts = [torch.optim.AdamW(m.named_parameters(), lr=1e-3) for m in (plain, working)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        kwargs = batch(g)
        got = []
        for model, opt in zip((plain, working), opts):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss, metrics = model(**kwargs)
            opt.zero_grad()
            loss.backward()
            weights.to_master()  # what the clip does first (a no-op for the plain model's step)
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            got.append((loss.item(), norm.item(), grads, metrics))
        (l0, n0, g0, m0), (l1, n1, g1, m1) = got
        assert abs(l1 - l0) <= 0.01 * abs(l0) and abs(n1 - n0) <= 0.03 * n0
        assert torch.nn.functional.cosine_similarity(g0, g1, dim=0) > 0.99
        assert all(abs(m0[k].item() - m1[k].item()) <= 2 for k in m0 if "_acc_" in k)
        assert seen[-1] == {torch.bfloat16}  # the forward ran on bfloat16 weights alone
        assert all(p.dtype == torch.float32 for p in working.parameters())
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in working.parameters())
    assert all(t.dtype == torch.float32 for k, t in working.state_dict().items() if t.is_floating_point())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opts[1].state.values())
    for p, w in zip(weights.params, weights.work):  # frozen weights were copied once and are still exact
        if not p.requires_grad:
            assert torch.equal(w, p.detach().to(torch.bfloat16))
    with torch.no_grad():  # validation: float32 again after its forward
        kwargs = batch(g)
        kwargs.pop("verifier_last_hidden_states")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            working(**kwargs)
    assert seen[-1] == {torch.bfloat16} and not weights.working
    assert all(p.dtype == torch.float32 for p in working.parameters())


def _eyrie_trainer(tmp_path, switches, dtype, steps: int = 2, **kwargs):
    import torch
    from speculators.train.trainer import TrainerConfig

    from eyrie.stages.train.eyrie_trainer import EyrieTrainer

    model, batch = _tiny_eagle3()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        b = batch(g)
        call = {k: b.pop(k) for k in ("ttt_steps", "loss_config")}
        batches.append({**{k: v.to(dtype) if v.is_floating_point() else v for k, v in b.items()}, "error_records": 0})
    config = TrainerConfig(
        num_epochs=1,
        save_path=str(tmp_path / "checkpoints"),
        lr=1e-3,
        train_call_kwargs=call,
        val_call_kwargs=call,
        scheduler_type="none",
        hidden_states_dtype=dtype,
        log_freq=1,
    )
    return EyrieTrainer(
        model, config, ListLoader(batches), ListLoader(batches[:1]), device="cpu", switches=switches, **kwargs
    )


def test_bf16_working_weights_are_put_back_before_clip_step_and_save(monkeypatch, tmp_path):
    """EyrieTrainer with bf16_weights on one process: forward and backward on bfloat16 copies, and the clip, the
    optimizer step and every checkpoint see float32 weights and gradients."""
    import torch

    from eyrie.stages.train.patches import working_weights
    from eyrie.stages.train.patches.switches import Switches

    _step_timer_on_cpu(monkeypatch)
    trainer = _eyrie_trainer(tmp_path, Switches(), torch.bfloat16)
    (weights,) = working_weights._WORKING
    seen = []
    trainer.model.register_forward_pre_hook(lambda m, a: seen.append({p.dtype for p in m.parameters()}))
    steps = []
    step = trainer._optimizers_step

    def watched():
        steps.append(
            {p.dtype for p in trainer.model.parameters()}
            | {p.grad.dtype for p in trainer.model.parameters() if p.grad is not None}
        )
        return step()

    trainer._optimizers_step = watched
    trainer.train_epoch(0)
    assert seen and all(s == {torch.bfloat16} for s in seen)  # the forward ran on bfloat16 weights alone
    assert steps == [{torch.float32}] * 2  # the step saw float32 weights and gradients
    trainer.model(
        **{k: v for k, v in trainer.train_loader.batches[0].items() if k != "error_records"},
        **trainer.config.train_call_kwargs,
    )
    assert weights.working
    trainer.maybe_save_checkpoint(0)
    assert not weights.working
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    # under DDP or FSDP (or without bf16_weights) there are no working copies
    _eyrie_trainer(tmp_path / "off", Switches(bf16_weights=False), torch.bfloat16)
    assert working_weights._WORKING == []


def test_the_saved_checkpoint_is_speculators_own_and_loads_with_speculators(monkeypatch, tmp_path):
    """EyrieTrainer's checkpoints are speculators' format: its own loader reads the saved drafter back with the
    trained weights, and the folder holds what speculators writes (weights, config, optimizer, training state)."""
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.train import checkpointer as checkpointer_module
    from speculators.train import trainer as trainer_module
    from speculators.train.checkpointer import SingleGPUCheckpointer

    from eyrie.stages.train.checkpoints import is_whole
    from eyrie.stages.train.drafter import apply_speed_choices
    from eyrie.stages.train.patches.switches import Switches

    _step_timer_on_cpu(monkeypatch)
    tqdm = trainer_module.tqdm
    trainer = _eyrie_trainer(tmp_path, Switches(), torch.float32)
    apply_speed_choices(trainer.model, Switches())  # the GPU path's drafter: its forward and mask bound on it
    trainer.train_epoch(0)
    # the trainer's view of torch and tqdm is its own methods': speculators' trainer module is as installed
    assert trainer_module.torch is torch and trainer_module.tqdm is tqdm
    assert trainer.train_epoch.__func__.__globals__["torch"] is not torch
    trainer.maybe_save_checkpoint(0)
    folder = tmp_path / "checkpoints" / "0"
    assert is_whole(folder)
    assert {"model.safetensors", "config.json", "optimizer_state_dict.pt", "training_state.json"} <= {
        p.name for p in folder.iterdir()
    }
    # speculators' own readers: its config class, and its checkpointer's weights loader (what its resume uses)
    config = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    assert config.transformer_layer_config.hidden_size == trainer.model.config.transformer_layer_config.hidden_size
    loaded = tiny_eagle3()
    monkeypatch.setattr(checkpointer_module, "get_current_device", lambda: "cpu")  # as patches/cpu.py does on CPU
    checkpointer = SingleGPUCheckpointer(str(tmp_path / "checkpoints"))
    assert checkpointer.previous_epoch == 0
    checkpointer.load_model_state_dict(loaded, float_dtype=torch.float32)
    saved = trainer.model.state_dict()
    on_disk = load_file(str(folder / "model.safetensors"))
    assert on_disk and all(not k.startswith("verifier_") or k == "verifier_lm_head.weight" for k in on_disk)
    for name, tensor in on_disk.items():  # read back as written, and written as trained (to the file's rounding)
        assert torch.equal(loaded.state_dict()[name].float(), tensor.float()), name
        assert torch.allclose(tensor.float(), saved[name].float(), rtol=1e-2, atol=1e-3), name


def test_compile_cache_goes_beside_the_run_unless_set(monkeypatch, tmp_path):
    from eyrie.stages.train import entry as train_entry

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    save = tmp_path / "run" / "train" / "abc" / "checkpoints"
    train_entry._compile_cache_beside(str(save))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "run" / "train" / "compile-cache").resolve())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere")
    train_entry._compile_cache_beside(str(save))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere"
    assert train_entry._option(["--save-path", "x", "--seed", "0"], "--save-path") == "x"
    assert train_entry._option(["--seed"], "--save-path") is None
    assert json.dumps(FACTS)  # the facts the command is built from are plain JSON


def test_the_untrained_baseline_is_keyed_by_what_shapes_it(tiny_llama, tmp_path):
    """A changed drafter shape, vocabulary, captured layers or target gives a new untrained drafter; a change that
    shapes nothing (the learning rate, the epochs) keeps the one already made."""
    base = config_dict(tiny_llama)
    key = untrained_key(parse_config(base), "vocab-a", [2, 4, 5])
    assert key == untrained_key(parse_config({**base, "train": {"lr": 0.5, "epochs": 9}}), "vocab-a", [2, 4, 5])
    assert key != untrained_key(parse_config({**base, "train": {"num_layers": 2}}), "vocab-a", [2, 4, 5])
    assert key != untrained_key(parse_config(base), "vocab-b", [2, 4, 5])
    assert key != untrained_key(parse_config(base), "vocab-a", [1, 3, 5])
    other = tmp_path / "target"
    shutil.copytree(tiny_llama, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "initializer_range": 0.5}))  # another target
    assert key != untrained_key(parse_config(config_dict(other)), "vocab-a", [2, 4, 5])


@pytest.mark.parametrize("eager", [False, True])
def test_the_block_mask_is_built_eagerly_on_the_drafter_alone(eager, monkeypatch):
    """deferred_mask_compile: the drafter's `_build_attn_mask` runs eagerly inside a compiled forward (a CPU
    stand-in for speculators' torch.compile on GPUs), bound on that drafter alone, from the documents' block layout
    (eyrie/stages/train/block_mask.py) where its mask function is flex attention's own; the mask is speculators'."""
    import torch
    from speculators.models.eagle3 import core

    from eyrie.stages.train import block_mask
    from eyrie.stages.train.drafter import apply_speed_choices
    from eyrie.stages.train.patches.switches import Switches

    layout: list = []
    by_layout = block_mask.document_block_mask

    def watched_layout(*args, **kwargs):
        layout.append(torch.compiler.is_compiling())
        return by_layout(*args, **kwargs)

    monkeypatch.setattr(block_mask, "document_block_mask", watched_layout)

    stock = core.Eagle3DraftModel._build_attn_mask
    model, _ = _tiny_eagle3()
    seen: list = []

    def create_block_mask(*args, **kwargs):
        seen.append(torch.compiler.is_compiling())
        return core.create_block_mask(*args, **kwargs)

    model._attn_impl, model._create_mask_fn = "simple_flex_attention", create_block_mask
    docs = torch.tensor([0] * 100 + [1] * 100 + [-1] * 56)
    want = stock(model, docs, 256, "cpu")
    seen.clear()
    if eager:
        only = Switches(sync_free_metrics=False, one_kv_length=False, eager_rotary=False)
        apply_speed_choices(model, only)
        assert "_build_attn_mask" in vars(model) and core.Eagle3DraftModel._build_attn_mask is stock
    torch._dynamo.reset()
    try:
        got = torch.compile(lambda d: model._build_attn_mask(d, 256, "cpu"), backend="eager")(docs)
    except Exception:  # noqa: BLE001  (tracing create_block_mask may not work on CPU; the eager case must not)
        assert not eager
        got = None
    finally:
        torch._dynamo.reset()
    if eager:
        assert seen == [False]  # built outside the compile
    else:
        assert any(seen)  # speculators' builder is traced
    if got is not None:
        assert got.to_dense().equal(want.to_dense()) and got.seq_lengths == want.seq_lengths
    assert not layout  # a mask function of another kind: speculators' builder
    if eager:  # flex attention's create_block_mask: the mask from the block layout, outside the compile
        model._create_mask_fn = core.create_block_mask
        seen.clear()
        torch._dynamo.reset()
        try:
            got = torch.compile(lambda d: model._build_attn_mask(d, 256, "cpu"), backend="eager")(docs)
        finally:
            torch._dynamo.reset()
        assert layout == [False] and not seen
        assert got.to_dense().equal(want.to_dense()) and torch.equal(got.kv_indices, want.kv_indices)


def test_eight_devices_launch_the_same_entry_under_torchrun(tmp_path):
    """train.devices: 8 on cuda: torchrun with 8 processes per node runs the same entry with the same arguments as one
    GPU (the options file included); on CPU one process whatever train.devices says."""
    import sys

    one = _command(tmp_path / "one", "cuda", devices=1)
    eight = _command(tmp_path / "eight", "cuda", devices=8)
    assert eight[:4] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=8"]
    assert one[0] == sys.executable and one[1:3] == ["-m", "eyrie.stages.train.entry"]
    entry = eight.index("eyrie.stages.train.entry")
    assert eight[entry - 1] == "-m"
    strip = str(tmp_path / "eight"), str(tmp_path / "one")
    assert [a.replace(*strip) for a in eight[entry:]] == one[2:]
    assert _options(eight) == _options(one)
    cpu = _command(tmp_path / "cpu", "cpu", devices=8)
    assert cpu[0] == sys.executable and "torch.distributed.run" not in cpu


def test_the_loaders_read_through_eyries_readers_without_registering_them(tmp_path):
    """The entry's loaders pick Eyrie's readers themselves (packs and files, bf16 and fp8; fp8 carried to the GPU
    with its choices), leaving hs_connectors' registry as speculators has it."""
    import types

    from hs_connectors import HiddenStatesBackend

    from eyrie.hidden_states import pack_reader
    from eyrie.hidden_states.gpu_decode import CarriedFP8Transfer
    from eyrie.stages.train.loaders import transfer_for
    from eyrie.stages.train.patches.switches import Switches

    registry = dict(HiddenStatesBackend.registry)
    for backend, switches, want, carried in (
        ("file", None, pack_reader.PackedFileTransfer, False),
        ("fp8", None, pack_reader.PackedFP8Transfer, False),
        ("fp8", Switches(), CarriedFP8Transfer, True),
        ("fp8", Switches(fp8_on_gpu=False), pack_reader.PackedFP8Transfer, False),
    ):
        args = types.SimpleNamespace(hidden_states_backend=backend, hidden_states_path=str(tmp_path), data_path="d")
        transfer, is_carried = transfer_for(args, switches)
        assert type(transfer) is want and is_carried is carried
    assert dict(HiddenStatesBackend.registry) == registry
