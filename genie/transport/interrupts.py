"""Ctrl-C held back while the transport is in the middle of something it cannot leave halfway.

Python raises KeyboardInterrupt at its next check after SIGINT, which may be just after a C call
that took a message off a socket and before the message was filed anywhere: the answer was gone
and its reader waited for it for good (tests/test_interrupts.py's loop of random Ctrl-Cs hung so
in 2 of about 11 runs with the other core busy). Likewise a bulk transfer is a header and then
its bytes on a stream socket: an interrupt in the middle left the stream between two records
(the next transfer never arrived).

Within `held_interrupts()` a Ctrl-C is noted, and raised when the outermost block ends, where the
state is whole again (CUDA cannot stop a copy halfway either). `held_between_waits()` is the
same except within its `let_through()` waits, where nothing has been taken: there it is raised at
once, so Ctrl-C still stops a long wait for an answer.

This needs a SIGINT handler of our own: swapping it in per block cost ~5-9 us (two sigaction
calls), too much for a ~100 us round trip, so it stays in. The first block entered on the main
thread puts it in front of the handler it finds, Python's default one or the program's own, and
an outermost block looks again (~0.05 us) in case the program set another since (ipykernel
puts Python's in for each cell and its own back after it). Outside blocks
it calls the handler it stands in front of at once; a Ctrl-C that came within a block reaches
that handler as the block ends (or as a wait lets it through). So a program's handler that
raises (KeyboardInterrupt, SystemExit) is held back like the default one, and one that only
notes the Ctrl-C notes it a little later. While it is in, `signal.getsignal(SIGINT)` returns ours.
What a program's handler raises may be any exception, not only KeyboardInterrupt: ours marks it,
and `is_interrupt` tells it from a failure, so that Genie's code treats it as the Ctrl-C it is (a
batch not yet sent is kept, a lane cut mid-message is dropped), not as a lost connection.
Handlers that are not Python functions (SIG_IGN, SIG_DFL) are left alone, as are threads, which
never see KeyboardInterrupt: there the blocks change nothing.

Some code must run whole, and a held block cannot cover it, since entering one is Python too: a
finalizer (run when an object dies, wherever that happens; Python prints what it raises as
"Exception ignored" and drops it), or the step that turns a state on or off (a genie.graph's
recording). Functions marked `runs_whole`, and any `weakref.finalize` callback, keep a Ctrl-C
that comes while they run for the program's next Genie call.

`Condition` is threading.Condition with a `with` that cannot be cut between taking its lock and
entering the block (or leaving it and giving the lock back): see its docstring.
"""
from __future__ import annotations

import signal
import sys
import threading
import weakref

from _signal import getsignal as _getsignal  # signal.getsignal wraps it in ~1.9 us; this is ~0.02

_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident


class _Hold:
    """Process-wide: how deep the main thread is in held blocks (and in those that let no wait
    through), and the handler a SIGINT that came meanwhile is for. An instance, not class
    attributes: setting a class's attribute costs several times more, and this runs a few times
    per round trip."""

    __slots__ = ("depth", "strict", "came", "declined")

    def __init__(self) -> None:
        self.depth = self.strict = 0
        self.came = None  # the handler a SIGINT that came while held is delivered to
        self.declined = None  # a handler found and left alone (SIG_IGN, SIG_DFL): not looked at again


_hold = _Hold()


_SIGINT = int(signal.SIGINT)


class _InFront:
    """Our SIGINT handler, standing in front of `chained` (the one it found in force). One per
    handler it stands in front of: a program that saved it (`old = signal.signal(SIGINT, mine)`)
    and puts it back later gets the handler that was in force then, not one set since."""

    __slots__ = ("chained",)

    def __init__(self, chained) -> None:
        self.chained = chained

    def __call__(self, signum, frame) -> None:
        if _hold.depth or _in_runs_whole(frame):
            _hold.came = self.chained
            return
        _hold.came = None  # one kept for later (see `runs_whole`) is this one now
        _call_marking(self.chained, signum, frame)  # Python's default one raises KeyboardInterrupt, as without us


# Set on what a SIGINT handler raised through ours (an attribute of the exception itself: holding
# it elsewhere would keep its traceback's frames, and their tensors, alive).
_MARK = "_genie_raised_by_sigint"


def _call_marking(handler, signum, frame) -> None:
    try:
        handler(signum, frame)
    except BaseException as e:
        try:
            setattr(e, _MARK, True)
        except AttributeError:  # (no instance dict: nothing in the standard library; still raised)
            pass
        raise


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` stops the program rather than reports a failure: a KeyboardInterrupt (or
    another exception that is not an Exception, as SystemExit), or anything a program's own SIGINT
    handler raised through ours, whatever its class."""
    return not isinstance(exc, Exception) or getattr(exc, _MARK, False)


def _stand_in_front(found) -> None:
    """Put our handler in front of `found` (the handler in force; not ours), if it is a function."""
    hold = _hold
    if not callable(found):  # SIG_IGN, SIG_DFL (ints), or None (set from outside Python)
        hold.declined = found
        return
    try:
        signal.signal(signal.SIGINT, _InFront(found))
        hold.declined = None
    except ValueError:  # not the main interpreter's main thread after all: nothing to hold
        hold.declined = found


def _deliver_if_came() -> None:
    """A Ctrl-C that came while held reaches the handler it came to (the default one raises),
    unless this block is in a function that runs whole: then it is kept (see `runs_whole`)."""
    handler = _hold.came
    if handler is not None:
        frame = sys._getframe(1)
        if _in_runs_whole(frame):
            return
        _hold.came = None
        _call_marking(handler, _SIGINT, frame)


# The code of the functions that run whole (see `runs_whole`), and weakref.finalize's call of any
# finalizer: a Ctrl-C landing in one of those (Genie's dropping a graph's program, the program's
# own) was dropped too.
_RUN_WHOLE: set = {weakref.finalize.__call__.__code__}


def runs_whole(function):
    """Marks `function` to run whole: a Ctrl-C that comes while it runs (anywhere below its frame),
    held block or not, is kept for the end of the program's next held block or wait after it (its
    next Genie call), or for its next Ctrl-C, which is raised at once and clears the kept one. For
    finalizers (a Ctrl-C raised there would be printed as "Exception ignored" and never reach the
    program) and short steps that must not stop halfway. The frames are looked at only when a
    Ctrl-C comes: nothing is paid otherwise."""
    _RUN_WHOLE.add(function.__code__)
    return function


def _in_runs_whole(frame) -> bool:
    while frame is not None:
        if frame.f_code in _RUN_WHOLE:
            return True
        frame = frame.f_back
    return False


class held_interrupts:
    """`with held_interrupts():` SIGINT does not raise KeyboardInterrupt within the block, waits
    included; one that came reaches its handler when the outermost block ends (the default one
    raises then, also when the block raised something else: the user's Ctrl-C is not lost). For
    bytes that must all go out. Blocks nest. A class, not a generator: entered a few times per
    answer read (~0.3 us each).

    Each block puts back the depths it found rather than counting down: an interrupt raised as a
    `let_through` ends (before it restored them) then cannot leave the count off for good."""

    __slots__ = ("depth", "strict")
    lets_waits_through = False

    def __enter__(self):
        if _get_ident() != _MAIN_THREAD:
            self.depth = None
            return self
        hold = _hold
        if not hold.depth:
            found = _getsignal(_SIGINT)
            if type(found) is not _InFront and found is not hold.declined:
                _stand_in_front(found)
        self.depth, self.strict = hold.depth, hold.strict
        hold.depth += 1
        if not self.lets_waits_through:
            hold.strict += 1
        return self

    def __exit__(self, *exc) -> None:
        if self.depth is not None:
            hold = _hold
            hold.depth, hold.strict = self.depth, self.strict
            if not self.depth and hold.came is not None:
                _deliver_if_came()


class held_between_waits(held_interrupts):
    """`held_interrupts`, except inside its `let_through` waits (unless a strict block holds
    around it): for reading an answer, which must be filed once taken, but whose wait Ctrl-C
    must still stop."""

    __slots__ = ()
    lets_waits_through = True


class let_through:
    """`with let_through():` a wait in which nothing is taken, inside `held_between_waits`: a
    Ctrl-C that came before it, or comes during it, reaches its handler at once."""

    __slots__ = ("depth",)

    def __enter__(self) -> "let_through":
        self.depth = None
        hold = _hold
        if hold.depth and not hold.strict and _get_ident() == _MAIN_THREAD:
            self.depth, hold.depth = hold.depth, 0
            try:
                _deliver_if_came()
            except BaseException:
                hold.depth = self.depth
                raise
        return self

    def __exit__(self, *exc) -> None:
        if self.depth is not None:
            _hold.depth = self.depth


class Condition(threading.Condition):
    """threading.Condition whose `with` takes and gives back its lock in C. Condition's own
    `__enter__` and `__exit__` are Python functions: a Ctrl-C raised at the start of `__exit__`, or
    in `__enter__` just after the lock was taken, leaves the lock held for good, and the next
    thread to take it (Genie's event loop among them) waits forever. These look up the lock's own
    methods instead (in a Python getter, run before the lock is taken); `with` then calls them
    with no Python frame, so no point where Python raises, between the two. (scripts/interrupt_fuzz.py
    found such a lock held.)"""

    __enter__ = property(lambda self: self._lock.__enter__)
    __exit__ = property(lambda self: self._lock.__exit__)


def stand_down() -> None:
    """Put back the handler ours stands in front of (genie.shutdown: the program no longer waits on
    daemons); the next held block puts ours in front again."""
    if _get_ident() != _MAIN_THREAD or _hold.depth:
        return
    try:
        found = _getsignal(_SIGINT)
        if type(found) is _InFront:
            signal.signal(signal.SIGINT, found.chained)
    except ValueError:
        pass
    _hold.declined = None
