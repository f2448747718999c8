"""What a drafter is trained on, as one typed object the train stage's functions take (instead of six paths and
values passed one by one, and unpacked again by every caller)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainingData:
    """The data and its hidden states, the draft vocabulary's maps, the captured aux layers and the target's facts
    (preflight's `target_facts`: the checkpoint names of the tensors the drafter borrows, the mask token id).
    Paths may be given as strings (a Prefect task's job object is plain data); they are held as `Path`s."""

    data_dir: Path
    hidden_dir: Path
    d2t: Path
    t2d: Path
    aux_ids: list[int]
    target_facts: dict

    def __post_init__(self) -> None:
        for name in ("data_dir", "hidden_dir", "d2t", "t2d"):
            object.__setattr__(self, name, Path(getattr(self, name)))
        object.__setattr__(self, "aux_ids", [int(i) for i in self.aux_ids])
