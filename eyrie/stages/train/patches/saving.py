"""Every save keeps the whole checkpoint it overwrites until the new one is whole."""

from __future__ import annotations


def _keep_the_last_whole_checkpoint() -> None:
    """speculators overwrites `<epoch>/` in place on each save of that epoch. Rank 0 renames the whole folder aside
    first and deletes it once the new save is whole, so a kill mid-save leaves a whole checkpoint to resume from
    (eyrie.stages.train.checkpoints.recover puts it back). The fault point sits between the weights and the training
    state."""
    from pathlib import Path

    import torch.distributed as dist
    from speculators.train import trainer

    from eyrie.run.faults import fault_point
    from eyrie.stages.train.checkpoints import set_aside_previous, settle_save

    save = trainer.Trainer.maybe_save_checkpoint
    save_state = trainer.Trainer._save_training_state

    def maybe_save_checkpoint(self, epoch, local_step=0):
        folder = Path(self.checkpointer.path) / str(epoch)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0 and isinstance(epoch, int):
            set_aside_previous(folder)
        save(self, epoch, local_step=local_step)
        if rank0 and isinstance(epoch, int):
            settle_save(folder)

    def _save_training_state(self, epoch, local_step):
        fault_point(f"train.before-state.step{self.global_step}")
        save_state(self, epoch, local_step)

    trainer.Trainer.maybe_save_checkpoint = maybe_save_checkpoint
    trainer.Trainer._save_training_state = _save_training_state
