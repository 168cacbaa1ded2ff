"""Keys of watched objects that died, noted without running Python code at the moment of death.

Genie gives something back when an object dies: a remote handle when its HandleRef goes, an
address slot when a storage's identity goes, a shared segment when a download's array goes. A
`__del__` or a finalizer runs Python wherever the last reference happened to go, and a Ctrl-C
landing there is swallowed ("Exception ignored in ..."), with the hand-back. Here the death is
noted by a weak reference whose callback is C (`deque.append`); the owner takes the keys later,
at a point of its own choosing (`take`), and hands them back there.

The weak reference carries its key in a slot: a `functools.partial` per object cost about as much
again, and keying the references by themselves made each insert probe past every dead one whose
object had had the same address (a freed object's memory is reused at once): 29 us per handle
with 2,000 waiting to be taken, against 0.9 us this way (bench/NOTES.md, 2026-11-29 17:28).
"""
from __future__ import annotations

import collections
import weakref
from typing import Hashable


class KeyedRef(weakref.ref):
    """A weak reference that knows what it stands for."""

    __slots__ = ("key",)


class DeathNotes:
    """`watch(obj, key)`, and later `take()` gives back `key` once `obj` has died.

    A key must not be watched again until it has been taken (each owner only reuses a key it took).
    Safe from any thread: each step is one C call under the GIL."""

    __slots__ = ("watching", "dead")

    def __init__(self) -> None:
        self.watching: dict[Hashable, KeyedRef] = {}  # key -> its reference, while its object lives
        self.dead: collections.deque[KeyedRef] = collections.deque()  # appended by the callbacks

    def watch(self, obj: object, key: Hashable) -> None:
        ref = KeyedRef(obj, self.dead.append)
        ref.key = key
        self.watching[key] = ref

    def take(self):
        """The key of one watched object that died, or None when there is none (left)."""
        while True:
            try:
                ref = self.dead.popleft()
            except IndexError:  # none, or another thread took the last
                return None
            try:
                key = ref.key
            except AttributeError:  # a Ctrl-C came between making the reference and keying it
                continue
            self.watching.pop(key, None)
            return key

    def take_all(self) -> list:
        """The keys of every watched object that died so far."""
        keys = []
        while self.dead:
            key = self.take()
            if key is None:
                break
            keys.append(key)
        return keys
