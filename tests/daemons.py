"""Helpers that start real genie-daemon processes for tests, with bounded waits and sure teardown."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

READY = "GENIE_DAEMON_READY"


def keygen(directory, name: str) -> tuple[str, str]:
    """A CURVE key pair made by `genie-daemon keygen` in `directory` (a pathlib.Path): the paths of
    its public and secret key files."""
    out = subprocess.run([sys.executable, "-m", "genie_daemon", "keygen", str(directory), "--name", name],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return str(directory / f"{name}.key"), str(directory / f"{name}.key_secret")


def curve_pair(directory) -> tuple[list[str], dict]:
    """A daemon key pair and a client's, made in `directory` (a pathlib.Path), the client's public
    key allowed: (the daemon's flags, genie.init's key arguments)."""
    allow = directory / "allowed"
    allow.mkdir()
    server_public, server_secret = keygen(directory, "daemon")
    client_public, client_secret = keygen(directory, "client")
    os.replace(client_public, allow / "client.key")
    return (["--curve-secret", server_secret, "--allow-keys", str(allow)],
            {"client_key": client_secret, "server_key": server_public})


@contextlib.contextmanager
def connected(endpoint: str, **config):
    """genie connected to `endpoint` alone with `config` fields changed (genie.config.Config); its
    link. Disconnected, and the config restored, afterwards."""
    import genie
    from genie.runtime import get_runtime

    rt = get_runtime()
    saved = rt.config
    rt.config = dataclasses.replace(saved, **config)
    try:
        genie.init(endpoint)
        yield rt.links[0]
    finally:
        genie.shutdown()
        rt.config = saved


class DaemonProcess:
    def __init__(self, listen: str = "tcp://127.0.0.1:0", extra: list[str] | None = None,
                 use_console_script: bool = True, local_lane: bool | None = None) -> None:
        # The console script only when it is this interpreter's (another install's on PATH would
        # run other code, or another Python without torch).
        exe = shutil.which("genie-daemon", path=os.path.dirname(sys.executable)) if use_console_script else None
        cmd = [exe] if exe else [sys.executable, "-m", "genie_daemon"]
        # A tcp daemon's tests run over TCP lanes, as from another host, unless they ask for the
        # local lane (shared memory for clients on the daemon's host; ipc daemons test that path too).
        # GENIE_TEST_LOCAL_LANE=1 gives every tcp daemon that does not say its local lane.
        if local_lane is None:
            local_lane = os.environ.get("GENIE_TEST_LOCAL_LANE") == "1"
        local = [] if local_lane or not listen.startswith("tcp://") else ["--no-local-lane"]
        self.cmd = [*cmd, "--listen", listen, "--threads", "1", "--log-level", "WARNING", *local, *(extra or [])]
        self.proc: subprocess.Popen | None = None
        self.endpoint: str | None = None
        self.stderr_lines: list[str] = []

    def start(self, timeout: float = 60.0) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        found: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                if line.startswith(READY):
                    found.append(line.split(None, 1)[1].strip())
                    break

        def drain() -> None:
            for line in self.proc.stderr:
                self.stderr_lines.append(line)

        threading.Thread(target=drain, daemon=True).start()
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not found:
            self.stop()
            raise RuntimeError(f"genie-daemon did not start: {''.join(self.stderr_lines[-20:])}")
        self.endpoint = found[0]
        return self.endpoint

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> "DaemonProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def child_pythonpath(root: str) -> str:
    """PYTHONPATH for a child Python: `root` first, then this process's own (on a GPU node, where
    the packages the image lacks were carried in)."""
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def ipc_endpoint() -> tuple[str, str]:
    d = tempfile.mkdtemp(prefix="genie-test-")
    return f"ipc://{os.path.join(d, 'd.sock')}", d


class _Forwarder:
    """Accepts loopback TCP connections and forwards each to `target_port`; a subclass moves the
    bytes of each direction (`_forward`)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._open: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                self._forward(a, b)

    def _forward(self, src, dst) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()
        for s in self._open:
            try:
                s.close()
            except OSError:
                pass


class RecordingProxy(_Forwarder):
    """A loopback TCP forwarder that keeps a copy of every byte it carries (to check encryption)."""

    def __init__(self, target_port: int) -> None:
        self.recorded = bytearray()
        self._lock = threading.Lock()
        super().__init__(target_port)

    def _forward(self, src, dst) -> None:
        threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass


class DelayProxy(_Forwarder):
    """A loopback TCP forwarder that sends each chunk `one_way_s` after it arrived, in each
    direction: a network's propagation delay, without a bandwidth limit (bench.network_latency)."""

    def __init__(self, target_port: int, one_way_s: float) -> None:
        self.one_way_s = one_way_s
        super().__init__(target_port)

    def _forward(self, src, dst) -> None:
        held: collections.deque = collections.deque()
        ready = threading.Condition()
        threading.Thread(target=self._read, args=(src, held, ready), daemon=True).start()
        threading.Thread(target=self._write, args=(dst, held, ready), daemon=True).start()

    def _read(self, src, held, ready) -> None:
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            with ready:
                held.append((time.monotonic() + self.one_way_s, data))
                ready.notify()
            if not data:
                return

    def _write(self, dst, held, ready) -> None:
        while True:
            with ready:
                while not held:
                    ready.wait()
                due, data = held.popleft()
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return