"""Content-addressed two-level analysis cache.

Level 1: topology -> patterns and phases (they depend only on structure).
Level 2: (topology, shapes, network) -> costs and schedule.

The topology key is the graph's structural fingerprint, a hash of ops, edges
and attributes in program order built while the graph is recorded: a lookup is
then one dict access. (A Weisfeiler-Lehman hash, order-independent, is computed
once per miss for the report; at ~4 ms for 300 nodes it is too slow to be the
key that every decode step pays.) Hit rates and hit latency are kept.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class LevelStats:
    hits: int = 0
    misses: int = 0
    hit_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def mean_hit_us(self) -> float:
        return self.hit_seconds / self.hits * 1e6 if self.hits else 0.0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate, "mean_hit_us": self.mean_hit_us}


class _LRU:
    def __init__(self, maxsize: int) -> None:
        self.data: OrderedDict = OrderedDict()
        self.maxsize = maxsize

    def get(self, key):
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.maxsize:
            self.data.popitem(last=False)


@dataclass
class AnalysisCache:
    maxsize: int = 1024
    topology: LevelStats = field(default_factory=LevelStats)
    shapes: LevelStats = field(default_factory=LevelStats)

    def __post_init__(self) -> None:
        self._level1 = _LRU(self.maxsize)
        self._level2 = _LRU(self.maxsize)

    def lookup(self, level: int, key, compute):
        """Return the cached value for key, computing (and storing) it on a miss."""
        store, stats = (self._level1, self.topology) if level == 1 else (self._level2, self.shapes)
        t0 = time.perf_counter()
        value = store.get(key)
        if value is not None:
            stats.hits += 1
            stats.hit_seconds += time.perf_counter() - t0
            return value
        stats.misses += 1
        value = compute()
        store.put(key, value)
        return value

    def stats(self) -> dict:
        return {"topology": self.topology.as_dict(), "shapes": self.shapes.as_dict()}

    def clear(self) -> None:
        self._level1 = _LRU(self.maxsize)
        self._level2 = _LRU(self.maxsize)
        self.topology, self.shapes = LevelStats(), LevelStats()
