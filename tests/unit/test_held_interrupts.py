"""genie.transport.interrupts: a Ctrl-C waits for the end of a held block, or for a wait inside
`held_between_waits`; outside blocks it is raised as Python's own handler raises it."""
import os
import signal
import threading
import time

import pytest

from genie.transport import interrupts
from genie.transport.interrupts import held_between_waits, held_interrupts, let_through


def _interrupt_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs the handler at its next check, well within this


@pytest.fixture(autouse=True)
def _default_handler_after():
    yield
    assert interrupts._hold.depth == 0 and interrupts._hold.strict == 0 and not interrupts._hold.came
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts._hold.installed = False


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
    assert signal.getsignal(signal.SIGINT) is interrupts._on_sigint  # installed once, kept
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


def test_a_programs_own_handler_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with held_interrupts():
            _interrupt_self()
            assert seen == [signal.SIGINT]  # ran at once, as without the block
        assert signal.getsignal(signal.SIGINT) is not interrupts._on_sigint
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
    assert signal.getsignal(signal.SIGINT) is interrupts._on_sigint
    interrupts.stand_down()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with held_interrupts():  # and the next block installs it again
        pass
    assert signal.getsignal(signal.SIGINT) is interrupts._on_sigint


def test_standing_down_leaves_a_programs_own_handler():
    def own(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, own)
    try:
        interrupts.stand_down()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)
