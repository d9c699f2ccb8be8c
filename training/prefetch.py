"""Keep the input pipeline off the step's critical path: a background thread draws the next batches from the
host iterator and puts them on the devices while the current step runs.

On one H200 a 32 × 4096 batch takes about 0.2 s to assemble on the host; built after each step it left the GPU
idle for a third of every step (docs/benchmarks/train_h200.md). With ``depth`` batches in flight the device
never waits as long as the host keeps up on average.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

_DONE = object()


class DevicePrefetcher:
    """``for batch in DevicePrefetcher(host_batches, put): ...`` — ``put`` turns a host batch into device arrays
    (e.g. ``Trainer.global_batch``). Errors of the producer are raised in the consumer, at the batch where they
    happened. ``close()`` stops the thread (also on exceptions in the loop: use it as a context manager).

    ``state`` (optional): called right after each batch is drawn; its value for the batch the consumer took
    last is ``last_state`` — the iterator position a checkpoint must store (the thread is ahead by up to
    ``depth`` batches, so the live iterator's own state would skip them on resume)."""

    def __init__(self, batches: Iterator, put: Callable, depth: int = 2, state: Callable | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._batches, self._put, self._state = batches, put, state
        self.last_state = state() if state is not None else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="device-prefetch", daemon=True)
        self._thread.start()

    def _produce(self):
        try:
            while True:
                try:
                    batch = next(self._batches)  # next(), not a for loop: any iterator, __iter__ or not
                except StopIteration:
                    break
                item = (self._put(batch), self._state() if self._state is not None else None)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(_DONE)
        except BaseException as e:  # handed to the consumer
            self._queue.put(e)

    def __iter__(self):
        return self

    def __next__(self):
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, self.last_state = item
        return batch

    def close(self):
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
