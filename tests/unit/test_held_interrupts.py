"""genie.transport.interrupts.held_interrupts: a Ctrl-C waits for the end of the block."""
import os
import signal
import threading
import time

import pytest

from genie.transport.interrupts import held_interrupts


def _interrupt_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs the handler at its next check, well within this


def test_an_interrupt_inside_is_raised_at_the_end():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            _interrupt_self()
            reached.append("after the signal")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_an_interrupt_nothing_is_raised_and_the_handler_is_back():
    with held_interrupts():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_programs_own_handler_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with held_interrupts():
            _interrupt_self()
            assert seen == [signal.SIGINT]  # ran at once, as without the block
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_off_the_main_thread_it_changes_nothing():
    out = []

    def run():
        with held_interrupts():
            out.append(signal.getsignal(signal.SIGINT) is signal.default_int_handler)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(10)
    assert out == [True]
