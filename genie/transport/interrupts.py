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
calls), too much for a ~100 us round trip, so it is installed once, the first time a block is
entered on the main thread, and only over Python's default handler. It behaves as that handler
outside blocks. A program's own handler (and threads, which never see KeyboardInterrupt) are left
alone: there the blocks change nothing.
"""
from __future__ import annotations

import signal
import threading

_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident


class _Hold:
    """Process-wide: how deep the main thread is in held blocks (and in those that let no wait
    through), and whether a SIGINT came meanwhile. An instance, not class attributes: setting a
    class's attribute costs several times more, and this runs a few times per round trip."""

    __slots__ = ("depth", "strict", "came", "installed")

    def __init__(self) -> None:
        self.depth = self.strict = 0
        self.came = False
        self.installed = False  # our handler replaced the default one (checked once)


_hold = _Hold()


def _on_sigint(signum, frame) -> None:
    if _hold.depth:
        _hold.came = True
        return
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as without us


def _install() -> None:
    _hold.installed = True
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main interpreter's main thread after all: nothing to hold
        pass


def _raise_if_came() -> None:
    came, _hold.came = _hold.came, False
    if came and signal.getsignal(signal.SIGINT) is _on_sigint:
        raise KeyboardInterrupt


class held_interrupts:
    """`with held_interrupts():` SIGINT does not raise KeyboardInterrupt within the block, waits
    included; one that came is raised when the outermost block ends (also when the block raised
    something else: the user's Ctrl-C is not lost). For bytes that must all go out. Blocks nest.
    A class, not a generator: entered a few times per answer read (~0.3 us each).

    Each block puts back the depths it found rather than counting down: an interrupt raised as a
    `let_through` ends (before it restored them) then cannot leave the count off for good."""

    __slots__ = ("depth", "strict")
    lets_waits_through = False

    def __enter__(self):
        if _get_ident() != _MAIN_THREAD:
            self.depth = None
            return self
        hold = _hold
        if not hold.installed:
            _install()
        self.depth, self.strict = hold.depth, hold.strict
        hold.depth += 1
        if not self.lets_waits_through:
            hold.strict += 1
        return self

    def __exit__(self, *exc) -> None:
        if self.depth is not None:
            hold = _hold
            hold.depth, hold.strict = self.depth, self.strict
            if not self.depth and hold.came:
                _raise_if_came()


class held_between_waits(held_interrupts):
    """`held_interrupts`, except inside its `let_through` waits (unless a strict block holds
    around it): for reading an answer, which must be filed once taken, but whose wait Ctrl-C
    must still stop."""

    __slots__ = ()
    lets_waits_through = True


class let_through:
    """`with let_through():` a wait in which nothing is taken, inside `held_between_waits`: a
    Ctrl-C that came before it, or comes during it, is raised at once."""

    __slots__ = ("depth",)

    def __enter__(self) -> "let_through":
        self.depth = None
        hold = _hold
        if hold.depth and not hold.strict and _get_ident() == _MAIN_THREAD:
            self.depth, hold.depth = hold.depth, 0
            try:
                _raise_if_came()
            except KeyboardInterrupt:
                hold.depth = self.depth
                raise
        return self

    def __exit__(self, *exc) -> None:
        if self.depth is not None:
            _hold.depth = self.depth


def stand_down() -> None:
    """Put Python's default SIGINT handler back if ours is in (genie.shutdown: the program no longer
    waits on daemons); the next held block installs ours again."""
    if _get_ident() != _MAIN_THREAD or _hold.depth:
        return
    _hold.installed = False
    try:
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass
