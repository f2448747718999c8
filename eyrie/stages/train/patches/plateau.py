"""Every epoch's validation metrics recorded; training stopped once they plateau."""

from __future__ import annotations


class PlateauReached(Exception):
    """Raised after an epoch's validation when training has plateaued: ends speculators' epoch loop."""


def _record_validation(plateau: tuple[int, float] | None) -> None:
    """Write every epoch's validation metrics beside its checkpoint (speculators writes them only when the loss
    improved), and with `plateau` (patience, min_delta) stop once the predicted acceptance length has stopped
    rising: `plateau.json` in the checkpoints folder tells Eyrie not to relaunch. Every rank holds the same
    all-reduced metrics, so every rank decides the same."""
    from pathlib import Path

    import torch.distributed as dist
    from speculators.train import trainer

    from eyrie.run.files import atomic_write_json
    from eyrie.stages.train.validation import (
        PLATEAU,
        VALIDATION,
        epoch_validation,
        plateaued,
        predicted_acceptance_length,
    )

    update_best = trainer.Trainer.maybe_update_best

    def maybe_update_best(self, epoch, val_metrics):
        update_best(self, epoch, val_metrics)
        if val_metrics is None:
            return
        save_path = Path(self.checkpointer.path)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            atomic_write_json(save_path / str(epoch) / VALIDATION, val_metrics)
        if plateau is None:
            return
        scores = {}
        for e in range(epoch + 1):
            metrics = val_metrics if e == epoch else epoch_validation(save_path / str(e))
            if metrics:
                scores[e] = predicted_acceptance_length(metrics)
        if plateaued(list(scores.values()), *plateau):
            best = max(scores, key=lambda e: scores[e])
            if rank0:
                atomic_write_json(save_path / PLATEAU, {"epoch": epoch, "best_epoch": best, "scores": scores})
            raise PlateauReached(f"validation plateaued at epoch {epoch} (best: epoch {best})")

    trainer.Trainer.maybe_update_best = maybe_update_best
