"""The GPU trainer's speed choices (`train.speed`, eyrie.config.TrainSpeedConfig) resolved for one launch: `Switches`,
decided by the flow (`decide`, from the run's expected training time) and handed to the trainer in its run folder's
trainer-options.json (eyrie.stages.train.options); benchmarks/train_throughput.py turns any off (`--off NAME`) to
measure what it buys.

The start-up choices and their measured trades (one H200 at Kimi-K2.5 width, from a cold compile cache,
docs/stages/train.md, Start-up): with deferred_mask_compile, one_kv_length, eager_rotary and one_pointwise_config on,
the first step came 44.1-55.2 s after launch at 0.929-0.936 of the bare step (2026-12-03), 94.7 s with all four off.
one_kv_length saves ~20 s once for 2.5-3% of tokens/s; one_pointwise_config ~7 s once for ~0.5%; the other two cost
no tokens/s measurably. `auto` turns a choice with a per-step cost on only when the run's expected training time
times that cost is less than the start-up it saves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# choice -> (seconds it saves once, at the cold start; share of tokens/s it costs for the whole run)
STARTUP_TRADES: dict[str, tuple[float, float]] = {
    "one_kv_length": (20.0, 0.0275),
    "one_pointwise_config": (7.0, 0.005),
}


@dataclass(frozen=True)
class Switches:
    """One launch's choices, resolved (no `auto`): the fields of train.speed less assumed_tokens_per_s."""

    gpu_feed: bool = True
    feed_ahead: int = 2
    pinned_loader: bool = True
    fp8_on_gpu: bool = True
    quiet_progress: bool = True
    build_on_gpu: bool = True
    forkserver_workers: bool = True
    sync_free_metrics: bool = True
    clip_in_adamw: bool = True
    bf16_weights: bool = True
    deferred_mask_compile: bool = True
    one_kv_length: bool = True
    eager_rotary: bool = True
    one_pointwise_config: bool = True
    warm_compile_workers: bool = False

    @classmethod
    def from_dict(cls, values: dict) -> Switches:
        """From trainer-options.json; a name that is no switch is refused (a typo is not a switch left as is)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)} is no switch of the trainer; the switches: {', '.join(sorted(names))}"
            )
        return cls(**values)

    def without(self, *names: str) -> Switches:
        """These switches off (benchmarks/train_throughput.py's `--off`); an unknown name is refused."""
        return dataclasses.replace(self, **{n: False for n in names}) if names else self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def auto_on(name: str, expected_s: float | None) -> bool:
    """Whether `auto` turns the start-up choice `name` on for a run expected to train `expected_s` seconds: on when
    what it costs over the run is less than what it saves once, or when the length is unknown."""
    saves, costs = STARTUP_TRADES[name]
    return expected_s is None or expected_s * costs < saves


def decide(speed, expected_s: float | None) -> Switches:
    """`speed` (a TrainSpeedConfig) resolved for a run expected to train `expected_s` seconds (None: unknown)."""
    values = {}
    for field in dataclasses.fields(Switches):
        value = getattr(speed, field.name)
        values[field.name] = auto_on(field.name, expected_s) if value == "auto" else value
    return Switches(**values)


def expected_training_s(
    steps_left: int, max_seq_len: int, tokens_per_s: float | None, assumed_tokens_per_s: float
) -> float:
    """Seconds of training left: `steps_left` packed steps of `max_seq_len` tokens at the rate this drafter's trainer
    measured (`tokens_per_s`), or at the assumed one before it has."""
    return max(0, steps_left) * max_seq_len / (tokens_per_s or assumed_tokens_per_s)
