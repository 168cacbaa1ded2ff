"""Polling for an expected message for a short while before sleeping, with a back-off.

On a small VM a thread that sleeps in poll() takes tens of microseconds to wake once its
message comes (a halted vCPU), longer than a tight request loop takes to answer. Both ends
therefore poll for a while first: the daemon for a client's next request, a client for the
answer to its blocking request. Polling costs a core, so SPIN_MISSES polls in a row that run
out without a message switch it off for SPIN_BACKOFF_S (another process on those cores may be
the one the message waits on).
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

SPIN_MISSES = 3  # polls in a row that ran out ...
SPIN_BACKOFF_S = 0.05  # ... switch polling off for this long

T = TypeVar("T")


class BusyPoll:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds  # 0: never poll
        self.misses = 0  # polls in a row that ran out
        self.off_until = 0.0  # time.monotonic() before which polling is backed off

    def available(self) -> bool:
        return bool(self.seconds) and time.monotonic() >= self.off_until

    def run(self, poll_once: Callable[[], T]) -> T | None:
        """Call `poll_once` (which must not block) until it returns something true, returned, or
        `seconds` pass: None, counted as a miss."""
        deadline = time.perf_counter() + self.seconds
        while time.perf_counter() < deadline:
            ready = poll_once()
            if ready:
                self.misses = 0
                return ready
        self.misses += 1
        if self.misses >= SPIN_MISSES:
            self.misses = 0
            self.off_until = time.monotonic() + SPIN_BACKOFF_S
        return None
