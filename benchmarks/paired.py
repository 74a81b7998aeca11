"""Paired on/off timing shared by the benchmarks: fusionguard installed, its runtime's enabled flag (the
first thing every wrapper reads) switched off and on between consecutive calls, so host drift
cancels; the order within a pair alternates (the second call of a pair runs on warmer caches)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Tuple

from fusionguard._testing import set_guarding


def paired(call: Callable[[], object], pairs: int, sync: Callable[[], object] = lambda: None, per: int = 1) -> Tuple[float, float]:
    """(median of guarded minus plain, median plain), in seconds per call, over ``pairs`` pairs;
    ``per`` calls are queued between two syncs (a training loop does not sync after each call)."""
    diffs, plains = [], []
    try:
        for i in range(pairs):
            t = {}
            for on in (False, True) if i % 2 == 0 else (True, False):
                set_guarding(on)
                sync()
                t0 = time.perf_counter()
                for _ in range(per):
                    call()
                sync()
                t[on] = (time.perf_counter() - t0) / per
            diffs.append(t[True] - t[False])
            plains.append(t[False])
    finally:
        set_guarding(True)
    return statistics.median(diffs), statistics.median(plains)
