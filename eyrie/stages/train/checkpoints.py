"""speculators' training checkpoints: which ones count, and how a save cut short is undone before a resume.

speculators 0.9.0 saves epoch N into `<save_path>/N/`, in place, in this order: `config.json` and
`model.safetensors`, `optimizer_state_dict.pt`, `scheduler_state_dict.pt`, `training_state.json` ({epoch,
local_step, global_step}), and last the link `epochN_stepK` (mid-epoch) or `epochN_end` pointing at `N`. A mid-epoch
save overwrites `N/`. Killed half way, `N/` holds the weights of one step beside the optimizer and step count of
another, and speculators resumes from it without a word.

So a checkpoint counts only when it is whole: its training state is no older than any file it vouches for, names its
own epoch, and the completion link for that state exists. Before a resume, Eyrie moves a folder that is not whole
aside (`N.incomplete`) and puts back the whole one the interrupted save replaced: during training
(eyrie/stages/train/entry.py) each save first renames the whole `N/` it would overwrite to `N.previous` and deletes that
only once the new `N/` is whole, and durable: every file of the new save, its folder and the link beside it are
fsynced first, so a power loss after the delete cannot leave a new save whose bytes never reached the disk as the only
copy. A folder name that is not a number is invisible to speculators' resume.

A checkpoint `eyrie verify` finds damaged (a listed file whose bytes no longer match its sha256: bit rot) stops
counting: `quarantine` renames it `N.damaged` and removes the links that name it, so the next run resumes from the
newest whole checkpoint before it (or trains from scratch), never from the rotted one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from eyrie.run.files import fsync_path, read_json
from eyrie.stages.train.validation import PLATEAU

STATE = "training_state.json"
VOUCHED = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt")
PREVIOUS = ".previous"
INCOMPLETE = ".incomplete"
DAMAGED = ".damaged"


def completion_link(save_path: Path, epoch: int, local_step: int) -> Path:
    return save_path / (f"epoch{epoch}_step{local_step}" if local_step > 0 else f"epoch{epoch}_end")


def read_state(folder: Path) -> dict | None:
    state = read_json(folder / STATE)
    return state if isinstance(state, dict) else None


def files_no_newer_than_state(folder: Path) -> bool:
    """The training state was written after every file of the save (a save writes it last)."""
    try:
        written = (folder / STATE).stat().st_mtime_ns
        if not (folder / "model.safetensors").is_file() or not (folder / "optimizer_state_dict.pt").is_file():
            return False
        return all((folder / n).stat().st_mtime_ns <= written for n in VOUCHED if (folder / n).exists())
    except OSError:
        return False


def is_whole(folder: Path) -> bool:
    """A numbered checkpoint folder whose save finished: weights, optimizer and state of one step, and its link."""
    if not folder.name.isdigit() or not files_no_newer_than_state(folder):
        return False
    state = read_state(folder)
    if not state or state.get("epoch") != int(folder.name):
        return False
    link = completion_link(folder.parent, int(folder.name), int(state.get("local_step") or 0))
    return link.is_symlink() and os.readlink(link) == folder.name


def newest_whole_checkpoint(save_path: Path) -> Path | None:
    """The newest checkpoint that counts (the one speculators resumes from once `recover` has run)."""
    whole = [p for p in save_path.glob("*") if p.is_dir() and is_whole(p)] if save_path.is_dir() else []
    return max(whole, key=lambda p: int(p.name)) if whole else None


def set_aside_previous(folder: Path) -> None:
    """Before a save into `folder`: keep its whole contents as `<folder>.previous` (rank 0 only)."""
    if is_whole(folder):
        previous = folder.with_name(folder.name + PREVIOUS)
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(folder, previous)


def make_durable(folder: Path) -> None:
    """fsync every file below `folder` (links not followed), every folder below it, and its parent (the folder's own
    name and the completion link live there)."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                fsync_path(path)
        for name in dirs:
            if not (Path(root) / name).is_symlink():
                fsync_path(Path(root) / name)
    fsync_path(folder)
    fsync_path(folder.parent)


def settle_save(folder: Path) -> None:
    """After a save into `folder`: drop the previous copy once the new one is whole and on disk (a save that chose
    not to write leaves the previous copy to be put back)."""
    previous = folder.with_name(folder.name + PREVIOUS)
    if is_whole(folder):
        if previous.exists():
            make_durable(folder)  # the new save's bytes on disk before the only other copy goes
        shutil.rmtree(previous, ignore_errors=True)
    elif previous.is_dir() and not folder.exists():
        os.replace(previous, folder)


def recover(save_path: Path) -> list[str]:
    """Make the numbered folders speculators will see all whole; returns one line per change, for the log."""
    notes: list[str] = []
    if not save_path.is_dir():
        return notes
    for folder in sorted(p for p in save_path.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()):
        if is_whole(folder):
            shutil.rmtree(folder.with_name(folder.name + PREVIOUS), ignore_errors=True)
            continue
        aside = folder.with_name(folder.name + INCOMPLETE)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder, aside)
        notes.append(f"checkpoint {folder} was not whole (a save cut short): moved aside to {aside.name}")
    for previous in sorted(save_path.glob(f"*{PREVIOUS}")):
        folder = previous.with_name(previous.name.removesuffix(PREVIOUS))
        if folder.exists() or not folder.name.isdigit():
            continue
        state = read_state(previous) or {}
        # The interrupted save removed this checkpoint's link before it wrote its own; put it back, and only then
        # the folder: a kill between the two leaves the link waiting for its folder and `<N>.previous` whole, so the
        # next recover does the same again. (Folder first, a kill before the link left `<N>/` whole but unlinked,
        # and the next recover set it aside as a cut save: the only whole checkpoint gone.)
        for old in save_path.glob(f"epoch{folder.name}_*"):
            if old.is_symlink():
                old.unlink()
        completion_link(save_path, int(folder.name), int(state.get("local_step") or 0)).symlink_to(folder.name)
        os.replace(previous, folder)
        fsync_path(save_path)
        notes.append(
            f"restored checkpoint {folder} (global step {state.get('global_step')}) that the cut save replaced"
        )
    return notes


def checkpoint_holding(path: Path) -> Path | None:
    """The numbered checkpoint folder (speculators' `<save_path>/<N>/`) that `path` lies in, or None."""
    for folder in Path(path).parents:
        if folder.name.isdigit() and any((folder / n).is_file() for n in (STATE, *VOUCHED)):
            return folder
    return None


def quarantine(folder: Path) -> Path:
    """Take the damaged checkpoint `folder` out of the count: renamed `<N>.damaged` (kept, for a look; an older
    quarantine of the same epoch is replaced), its links removed (the completion link, speculators'
    `checkpoint_best`), and a plateau decided with it as the best epoch dropped (training resumes and decides again).
    Returns the new path."""
    save_path = folder.parent
    aside = folder.with_name(folder.name + DAMAGED)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    for link in save_path.iterdir():
        if link.is_symlink() and Path(os.readlink(link)).name == folder.name:
            link.unlink()
    plateau = read_json(save_path / PLATEAU)
    if isinstance(plateau, dict) and str(plateau.get("best_epoch")) == folder.name:
        (save_path / PLATEAU).unlink()
    fsync_path(save_path)
    return aside
