"""DevicePrefetcher: order, the iterator state of the batch consumed last, errors, early close."""
import threading
import time

import pytest

from mixerlab.training.prefetch import DevicePrefetcher


class _Counter:
    def __init__(self, n, fail_at=None):
        self.i, self.n, self.fail_at = 0, n, fail_at

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == self.fail_at:
            raise RuntimeError(f"bad batch {self.i}")
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1


def test_batches_in_order_with_the_state_after_each():
    source = _Counter(5)
    with DevicePrefetcher(source, lambda b: b * 10, depth=2, state=lambda: source.i) as it:
        assert it.last_state == 0
        seen = []
        for batch in it:
            seen.append((batch, it.last_state))
            time.sleep(0.01)  # the producer runs ahead; last_state must still follow the consumer
    assert seen == [(0, 1), (10, 2), (20, 3), (30, 4), (40, 5)]


def test_producer_errors_reach_the_consumer_and_close_stops_the_thread():
    with pytest.raises(RuntimeError, match="bad batch 2"):
        with DevicePrefetcher(_Counter(10, fail_at=2), lambda b: b) as it:
            list(it)
    endless = DevicePrefetcher(iter(int, 1), lambda b: b, depth=1)  # never-ending source, blocked on a full queue
    next(endless)
    endless.close()
    assert not any(t.name == "device-prefetch" and t.is_alive() for t in threading.enumerate()
                   if t is endless._thread)
