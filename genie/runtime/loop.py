"""The runtime's event loop: one asyncio loop (uvloop when installed) on a daemon thread."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

log = logging.getLogger("genie.runtime")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def _report_loop_error(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's error report, one line without the traceback unless debug logging is on.
    It also runs when the garbage collector frees a failed task, in whatever thread and in the
    middle of whatever that is doing; in Python 3.11 formatting a traceback calls ast.parse, and
    ast.parse interrupted by another ast.parse fails ("AST constructor recursion depth mismatch",
    CPython issue 106905; seen with 3.11.7), so a traceback formatted there broke the user's own
    torch.jit.script."""
    error = context.get("exception")
    if error is None or log.isEnabledFor(logging.DEBUG):
        loop.default_exception_handler(context)
        return
    where = context.get("future") or context.get("handle")
    log.error("%s: %s: %s%s", context.get("message", "error on the genie runtime loop"),
              type(error).__name__, error, f" ({where!r})" if where is not None else "")


class LoopThread:
    def __init__(self) -> None:
        self.loop = _new_loop()
        self.loop.set_exception_handler(_report_loop_error)
        self._thread = threading.Thread(target=self._run, name="genie-runtime", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro) -> concurrent.futures.Future:
        """Run a coroutine on the loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn, *args) -> None:
        """Schedule a plain callback on the loop (FIFO with other calls)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
