"""A bounded sample of a stream of numbers: the memory figures of one (layer, phase), whose
median the report shows whatever the log's length (exact up to ``RESERVOIR`` values; the max
always exact)."""

from __future__ import annotations

import math
import random
from typing import List, Optional

RESERVOIR = 2048


class Reservoir:
    """Uniform sample of at most ``cap`` values and the exact max.

    Algorithm L (Li, 1994): once full, it draws how many values to skip before the next
    replacement, so most values cost two comparisons; fixed seed, reproducible medians."""

    __slots__ = ("n", "max", "sample", "cap", "_rng", "_w", "_next")

    def __init__(self, cap: int = RESERVOIR) -> None:
        self.n = 0
        self.max: Optional[float] = None
        self.sample: List[float] = []
        self.cap = cap
        self._rng: Optional[random.Random] = None
        self._w = 1.0
        self._next = 0

    def add(self, x: float) -> None:
        n = self.n = self.n + 1
        if self.max is None or x > self.max:
            self.max = x
        if n <= self.cap:
            self.sample.append(x)
            if n == self.cap:
                self._rng = random.Random(0)
                self._w = math.exp(math.log(self._random()) / self.cap)
                self._skip()
            return
        if n == self._next:
            self.sample[self._rng.randrange(self.cap)] = x  # type: ignore[union-attr]
            self._w *= math.exp(math.log(self._random()) / self.cap)
            self._skip()

    def _random(self) -> float:
        r = 0.0
        while r == 0.0:
            r = self._rng.random()  # type: ignore[union-attr]
        return r

    def _skip(self) -> None:
        w = self._w
        gap = math.floor(math.log(self._random()) / math.log1p(-w)) if w < 1.0 else 0
        self._next = self.n + gap + 1

    def note_max(self, x: float) -> None:
        if self.max is None or x > self.max:
            self.max = x

    def median(self) -> Optional[float]:
        if not self.sample:
            return None
        s = sorted(self.sample)
        mid = len(s) // 2
        value = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
        return int(value) if float(value).is_integer() else value
