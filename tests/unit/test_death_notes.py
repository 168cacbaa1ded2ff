"""DeathNotes: keys of watched objects that died, noted by a C callback, taken later."""
from __future__ import annotations

import gc
import threading

from genie.transport.death_notes import DeathNotes, KeyedRef


class Thing:
    __hash__ = None  # unhashable: the notes must never hash what they watch


def test_a_key_is_taken_once_after_its_object_dies():
    notes = DeathNotes()
    a, b = Thing(), Thing()
    notes.watch(a, 1)
    notes.watch(b, 2)
    assert notes.take() is None and not notes.dead
    del a
    assert notes.take() == 1
    assert notes.take() is None
    assert 1 not in notes.watching and 2 in notes.watching
    del b
    assert notes.take_all() == [2] and not notes.watching


def test_objects_at_reused_addresses_are_told_apart():
    """Freed memory is reused at once, so many watched objects share an address in turn: each
    key still comes back exactly once (the notes key by the key, never by the object)."""
    notes = DeathNotes()
    for key in range(5000):
        notes.watch(Thing(), key)  # dies at once
    assert sorted(notes.take_all()) == list(range(5000))
    assert not notes.watching and not notes.dead


def test_a_cycle_is_noted_when_the_collector_frees_it():
    notes = DeathNotes()
    thing = Thing()
    thing.me = thing
    notes.watch(thing, "k")
    del thing
    assert notes.take() is None
    gc.collect()
    assert notes.take() == "k"


def test_a_reference_cut_before_it_was_keyed_is_skipped():
    """A Ctrl-C between making the reference and keying it: that death is dropped, not a crash."""
    notes = DeathNotes()
    unkeyed = Thing()
    ref = KeyedRef(unkeyed, notes.dead.append)
    notes.watch(Thing(), 7)
    del unkeyed
    assert ref() is None and len(notes.dead) == 2
    assert notes.take_all() == [7]


def test_deaths_from_other_threads_are_all_taken():
    notes = DeathNotes()
    barrier = threading.Barrier(4)

    def worker(base):
        barrier.wait()
        for i in range(2000):
            notes.watch(Thing(), base + i)

    threads = [threading.Thread(target=worker, args=(n * 10_000,)) for n in range(4)]
    for t in threads:
        t.start()
    taken = []
    while any(t.is_alive() for t in threads):
        taken += notes.take_all()
    for t in threads:
        t.join(10)
    taken += notes.take_all()
    assert sorted(taken) == sorted(n * 10_000 + i for n in range(4) for i in range(2000))
