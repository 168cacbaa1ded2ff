"""The runtime's event loop: one asyncio loop (uvloop when installed) on a daemon thread."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class LoopThread:
    def __init__(self) -> None:
        self.loop = _new_loop()
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
