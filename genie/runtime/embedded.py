"""The embedded default: a local genie-daemon process for this Python process.

Started on first use when no daemon is configured, bound to a private ipc path
(tcp on loopback where ipc is unavailable), told to exit if this process dies,
and stopped at interpreter exit.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger("genie.runtime")

READY_LINE = "GENIE_DAEMON_READY"


# A daemon's CURVE settings in this process's environment are for daemons on the network (a GPU
# node's shell sets them for `genie-daemon`). The embedded daemon listens on a private path and the
# runtime connects to it without CURVE; given them, it refused this process's plain connection, or
# did not start (a secret without GENIE_CURVE_ALLOW).
NETWORK_ONLY_SETTINGS = ("GENIE_CURVE_SECRET", "GENIE_CURVE_ALLOW")


def daemon_environment() -> dict:
    """The embedded daemon's environment: this process's, less NETWORK_ONLY_SETTINGS."""
    return {k: v for k, v in os.environ.items() if k not in NETWORK_ONLY_SETTINGS}


class LocalDaemon:
    """A genie-daemon child process; `endpoint` is where it listens once started."""

    def __init__(self, listen: str | None = None, threads: int = 0, extra_args: list[str] | None = None) -> None:
        self._dir: str | None = None
        if listen is None:
            if sys.platform.startswith("win"):
                listen = "tcp://127.0.0.1:0"
            else:
                # Private to this process: removed at stop, or by the daemon once this process is gone.
                self._dir = tempfile.mkdtemp(prefix="genie-")
                listen = f"ipc://{self._dir}/daemon.sock"
        self.listen = listen
        self.threads = threads
        self.extra_args = extra_args or []
        self.process: subprocess.Popen | None = None
        self.endpoint: str | None = None
        self._stderr_tail: list[str] = []
        self._owner_pid = os.getpid()  # a forked child sees this object too, and must not stop the daemon
        self._stderr_reader: threading.Thread | None = None

    def start(self, timeout: float = 60.0, while_waiting=None) -> str:
        """Start the process and wait for it to say where it listens. `while_waiting`, if given, runs
        on this thread meanwhile (the daemon takes about a second to import torch and bind)."""
        cmd = [sys.executable, "-m", "genie_daemon", "--listen", self.listen,
               "--exit-with-parent", str(os.getpid()), *self.extra_args]
        if self._dir is not None:  # the daemon removes it when this process ends without stop()
            cmd += ["--private-dir", self._dir]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            env=daemon_environment(),
        )
        self._stderr_reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._stderr_reader.start()
        deadline = time.monotonic() + timeout
        result: list[str] = []

        def read_ready() -> None:
            for line in self.process.stdout:
                if line.startswith(READY_LINE):
                    result.append(line.split(None, 1)[1].strip())
                    return

        reader = threading.Thread(target=read_ready, daemon=True)
        reader.start()
        if while_waiting is not None:
            while_waiting()
        reader.join(max(deadline - time.monotonic(), 0))
        if not result:
            self.stop()
            tail = "".join(self._stderr_tail[-20:])
            raise RuntimeError(f"local genie-daemon did not start within {timeout:.0f}s:\n{tail}")
        self.endpoint = result[0]
        log.info("started local genie-daemon (pid %d) on %s", self.process.pid, self.endpoint)
        return self.endpoint

    def _drain_stderr(self) -> None:
        # Keep the last lines for error messages, and never let the pipe fill up.
        for line in self.process.stderr:
            self._stderr_tail.append(line)
            if len(self._stderr_tail) > 200:
                del self._stderr_tail[:100]

    def exit_report(self) -> str | None:
        """How the process ended, with the last lines it wrote, once it has; None while it runs."""
        proc = self.process
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = "".join(self._stderr_tail[-8:]).strip()
        return f"the local genie-daemon {how}" + (f"; its last words:\n{tail}" if tail else "")

    def wait_for_exit_report(self, timeout: float) -> str | None:
        """`exit_report` once the process has ended and its last words are read, waiting `timeout`
        at most for both (a crashing process may still be exiting when its heartbeats stop)."""
        proc = self.process
        if proc is None:
            return None
        deadline = time.monotonic() + timeout
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self._stderr_reader is not None:
            self._stderr_reader.join(max(deadline - time.monotonic(), 0))
        return self.exit_report()

    def stop(self, timeout: float = 5.0) -> None:
        if os.getpid() != self._owner_pid:
            return
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self._dir is not None and (proc is None or proc.poll() is not None):
            # The daemon's socket files lived here; without this, each process left a folder in /tmp.
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
