"""genie.transport.interrupts: a Ctrl-C waits for the end of a held block, or for a wait inside
`held_between_waits`; outside blocks it reaches its handler at once (Python's own, which raises,
or the program's)."""
import os
import signal
import sys
import threading
import time
import weakref

import pytest

from genie.transport import interrupts
from genie.transport.interrupts import held_between_waits, held_interrupts, let_through


def _interrupt_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs the handler at its next check, well within this


def _ours_in() -> bool:
    return isinstance(signal.getsignal(signal.SIGINT), interrupts._InFront)


@pytest.fixture(autouse=True)
def _default_handler_after():
    yield
    assert interrupts._hold.depth == 0 and interrupts._hold.strict == 0 and not interrupts._hold.came
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_an_interrupt_inside_is_raised_at_the_end():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            _interrupt_self()
            reached.append("after the signal")
    assert reached == ["after the signal"]


def test_outside_a_block_the_handler_raises_at_once():
    with held_interrupts():
        pass
    assert _ours_in()  # installed once, kept
    reached = []
    with pytest.raises(KeyboardInterrupt):
        _interrupt_self()
        reached.append("after the signal")
    assert reached == []


def test_blocks_nest_and_the_outermost_raises():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_between_waits():
            with held_between_waits():
                _interrupt_self()
            reached.append("after the inner block")
    assert reached == ["after the inner block"]


def test_another_exception_gives_way_to_the_interrupt():
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            _interrupt_self()
            raise ValueError("the block failed too")


def test_a_wait_lets_an_interrupt_through_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_between_waits():
            with let_through():
                _interrupt_self()
                reached.append("waited on")
    assert reached == []


def test_an_interrupt_noted_before_a_wait_is_raised_as_it_starts():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_between_waits():
            _interrupt_self()
            reached.append("taken")
            with let_through():
                reached.append("waited on")
    assert reached == ["taken"]


def test_after_a_wait_the_block_holds_again():
    with held_between_waits():
        with let_through():
            pass
        assert interrupts._hold.depth == 1
        _interrupt_self()  # noted, not raised
        with pytest.raises(KeyboardInterrupt):
            with let_through():
                pass
        assert interrupts._hold.depth == 1  # put back as the interrupt left the wait


def test_a_strict_block_lets_no_wait_through():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():  # bytes that must all go out (a bulk transfer)
            with held_between_waits():
                with let_through():
                    _interrupt_self()
                    reached.append("waited on")
            reached.append("sent")
    assert reached == ["waited on", "sent"]


class _Stop(BaseException):
    """What a program's own SIGINT handler raises in these tests."""


def _own_handler(seen: list):
    def own(signum, frame):
        seen.append(signum)
        raise _Stop

    return own


def test_a_programs_own_handler_is_held_back_too():
    seen = []
    previous = signal.signal(signal.SIGINT, _own_handler(seen))
    try:
        reached = []
        with pytest.raises(_Stop):
            with held_interrupts():
                _interrupt_self()
                reached.append("after the signal")
                assert seen == []  # not yet
        assert reached == ["after the signal"] and seen == [signal.SIGINT]
        with pytest.raises(_Stop):  # outside a block it runs at once
            _interrupt_self()
        assert seen == [signal.SIGINT] * 2
    finally:
        signal.signal(signal.SIGINT, previous)


class _Stopped(Exception):
    """An Exception subclass, raised by a program's own SIGINT handler."""


def test_what_a_programs_handler_raises_is_told_from_a_failure():
    """A handler may raise an Exception subclass: Genie's code must treat it as the Ctrl-C it is
    (before, a batch it stopped was reported as a lost connection, and its exception raised again
    at the next sync). Raised at a block's end, in a let-through wait, or outside any block, it is
    marked; the same class raised by anything else is a failure."""
    def stop(signum, frame):
        raise _Stopped("Ctrl-C")

    previous = signal.signal(signal.SIGINT, stop)
    try:
        raised = []
        for where in ("block end", "wait", "outside"):
            try:
                if where == "outside":
                    with held_interrupts():  # puts ours in front of `stop`
                        pass
                    _interrupt_self()
                else:
                    with held_between_waits():
                        _interrupt_self()
                        if where == "wait":
                            with let_through():
                                pass
                        assert where == "block end"  # (the wait raised)
            except _Stopped as e:
                raised.append(e)
        assert len(raised) == 3 and all(interrupts.is_interrupt(e) for e in raised)
        assert not interrupts.is_interrupt(_Stopped("a failure"))
        assert interrupts.is_interrupt(KeyboardInterrupt()) and interrupts.is_interrupt(SystemExit())
        assert not interrupts.is_interrupt(ConnectionError())
    finally:
        signal.signal(signal.SIGINT, previous)


@interrupts.runs_whole
def _finalizer_interrupted(in_block: bool) -> None:
    if in_block:
        with held_interrupts():
            _interrupt_self()
    else:
        _interrupt_self()


@pytest.mark.parametrize("in_block", [False, True], ids=["outside-a-block", "in-a-block"])
def test_a_ctrl_c_in_a_finalizer_waits_for_the_next_block_not_lost(in_block):
    """Raised in a finalizer, a Ctrl-C is printed as ignored and never reaches the program; in one
    marked `interrupts.runs_whole`, held block or not, it is kept for the next held block's end. A
    Ctrl-C pressed again before then is raised at once, and the kept one with it: not twice."""
    with held_interrupts():  # ours in front
        pass
    _finalizer_interrupted(in_block)
    assert interrupts._hold.came is not None  # kept, not raised
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            pass
    _finalizer_interrupted(in_block)
    with pytest.raises(KeyboardInterrupt):
        _interrupt_self()  # pressed again, outside any block
    assert interrupts._hold.came is None
    with held_interrupts():  # nothing left to raise
        pass


def test_a_ctrl_c_in_any_weakref_finalize_callback_is_kept_not_ignored(monkeypatch):
    """Genie drops a graph's program from a weakref.finalize callback (so do programs, for their
    own things): a Ctrl-C there was printed as "Exception ignored" and dropped, with the rest of
    the callback's work. Now it is kept for the next Genie call, and the callback runs to its end."""
    with held_interrupts():  # ours in front
        pass

    class Thing:
        pass

    done = []

    def callback():
        _interrupt_self()
        done.append(True)

    thing = Thing()
    weakref.finalize(thing, callback)
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: ignored.append(raised.exc_type))
    del thing
    assert ignored == [] and done == [True]
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            pass


def test_a_handler_set_after_ours_is_held_back_from_the_next_block_on():
    with held_interrupts():
        pass
    assert _ours_in()
    seen = []
    signal.signal(signal.SIGINT, _own_handler(seen))  # the program's, set later
    with pytest.raises(_Stop):
        with held_between_waits():
            _interrupt_self()
            assert seen == []
            with pytest.raises(_Stop):  # a wait lets it through
                with let_through():
                    pass
            assert seen == [signal.SIGINT]
            _interrupt_self()
    assert seen == [signal.SIGINT] * 2


def test_a_handler_that_only_notes_the_interrupt_notes_it_at_the_end():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with held_interrupts():
            _interrupt_self()
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_handler_the_program_saved_and_puts_back_is_the_one_in_force_then():
    """`old = signal.signal(SIGINT, mine)` ... `signal.signal(SIGINT, old)` (a context manager of
    the program's): once it puts back what it saved, its own handler no longer gets Ctrl-C."""
    with held_interrupts():  # ours in front of Python's default
        pass
    seen = []
    saved = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    with held_interrupts():  # ours in front of the program's, for a while
        pass
    assert _ours_in()
    signal.signal(signal.SIGINT, saved)
    with pytest.raises(KeyboardInterrupt):
        _interrupt_self()
    assert seen == []


def test_an_ignored_interrupt_is_left_alone():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held_interrupts():
            _interrupt_self()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert not interrupts._hold.came
    finally:
        signal.signal(signal.SIGINT, previous)


def test_off_the_main_thread_it_changes_nothing():
    out = []

    def run():
        with held_interrupts():
            out.append(interrupts._hold.depth)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(10)
    assert out == [0]


def test_standing_down_puts_the_default_handler_back():
    with held_interrupts():
        pass
    assert _ours_in()
    interrupts.stand_down()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with held_interrupts():  # and the next block installs it again
        pass
    assert _ours_in()


def test_standing_down_puts_a_programs_own_handler_back():
    def own(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, own)
    try:
        with held_interrupts():
            pass
        assert _ours_in()
        interrupts.stand_down()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_conditions_with_runs_no_python_between_taking_and_giving_back_its_lock():
    """threading.Condition's __enter__ and __exit__ are Python functions: a KeyboardInterrupt raised
    at the start of __exit__ (or in __enter__ just after the lock was taken) leaves the lock held.
    interrupts.Condition's `with` calls the lock's own (C) methods; only its getters, which run
    before the lock is taken, are Python."""
    import sys

    from genie.transport.interrupts import Condition

    def python_calls_in_with(cond) -> list[str]:
        seen = []
        sys.setprofile(lambda frame, event, arg: seen.append(frame.f_code.co_name) if event == "call" else None)
        try:
            with cond:
                sys.setprofile(sys.getprofile())  # (a call inside the block, for the profiler to see)
        finally:
            sys.setprofile(None)
        return seen

    assert {"__enter__", "__exit__"} <= set(python_calls_in_with(threading.Condition()))
    assert not {"__enter__", "__exit__"} & set(python_calls_in_with(Condition()))
    cond, ready = Condition(), []
    threading.Timer(0.05, lambda: (cond.acquire(), ready.append(1), cond.notify_all(), cond.release())).start()
    with cond:
        assert cond.wait_for(lambda: ready, 5.0)
    assert cond.acquire(blocking=False)  # given back
    cond.release()
