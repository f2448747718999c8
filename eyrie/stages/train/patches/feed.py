"""Batches copied to the GPU ahead of the step that takes them, on a stream of their own."""

from __future__ import annotations


def _copied_ahead(batches, device, ahead: int = 2, fp8_on_gpu: bool = True):
    """Iterate `batches` (a data loader's iterator) with every tensor already on `device`. A thread takes each batch
    from the loader and copies it on a CUDA stream of its own, up to `ahead` batches ahead (train.speed.feed_ahead);
    the step's stream waits for that copy alone (an event), and each tensor is marked as used by the step's stream so
    its memory is not reused before the step is done with it."""
    import queue
    import threading

    import torch

    from eyrie.hidden_states.gpu_decode import decode_batch

    copy_stream = torch.cuda.Stream(device)
    ready = queue.Queue(maxsize=ahead)  # type: ignore[var-annotated]
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def feed() -> None:
        try:
            torch.cuda.set_device(device)
            for batch in batches:
                with torch.cuda.stream(copy_stream):
                    moved = {
                        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()
                    }
                    if fp8_on_gpu:
                        moved = decode_batch(moved)
                    copied = torch.cuda.Event()
                    copied.record(copy_stream)
                if not put((moved, copied)):
                    return
            put((done, None))
        except BaseException as err:  # noqa: BLE001  (raised again in the training thread)
            put((err, None))

    thread = threading.Thread(target=feed, name="eyrie-gpu-feed", daemon=True)
    thread.start()
    try:
        while True:
            item, copied = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            step_stream = torch.cuda.current_stream(device)
            step_stream.wait_event(copied)
            for v in item.values():
                if isinstance(v, torch.Tensor):
                    v.record_stream(step_stream)
            yield item
    finally:
        stop.set()
        thread.join(timeout=60)  # the thread ends once the batch it is waiting for arrives
