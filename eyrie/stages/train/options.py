"""What the flow tells the trainer beyond speculators' own arguments, in one file of its run folder:
`<train>/<key>/trainer-options.json`, named by the trainer's `--eyrie-options` (no environment variable): where it
trains (cpu or cuda), whether its labels are made with the target's own transform (train.target_transform), and the
GPU speed choices resolved for this launch (train.speed, eyrie.stages.train.patches.switches)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.stages.train.patches.switches import Switches

OPTIONS = "trainer-options.json"
OPTIONS_FLAG = "--eyrie-options"
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TrainerOptions:
    device: str = "cuda"
    target_transform: bool = True
    switches: Switches = field(default_factory=Switches)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"the trainer's device is {self.device!r}; it trains on one of {', '.join(DEVICES)}")

    def to_dict(self) -> dict:
        return {"device": self.device, "target_transform": self.target_transform, "speed": self.switches.to_dict()}

    @classmethod
    def from_dict(cls, values: dict) -> TrainerOptions:
        unknown = sorted(set(values) - {"device", "target_transform", "speed"})
        if unknown:
            raise ValueError(f"trainer options {', '.join(unknown)} are unknown: device, target_transform, speed")
        return cls(
            device=values.get("device", "cuda"),
            target_transform=bool(values.get("target_transform", True)),
            switches=Switches.from_dict(values.get("speed") or {}),
        )

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def pop_options(argv: list[str]) -> TrainerOptions:
    """`--eyrie-options PATH` taken out of `argv` and read; without it, the defaults (a GPU, every choice as
    train.speed's defaults resolve for a run of unknown length)."""
    if OPTIONS_FLAG not in argv[:-1]:
        return TrainerOptions()
    i = argv.index(OPTIONS_FLAG)
    path = Path(argv[i + 1])
    del argv[i : i + 2]
    try:
        return TrainerOptions.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise SystemExit(f"eyrie: the trainer's options {path} cannot be used: {err}") from err
