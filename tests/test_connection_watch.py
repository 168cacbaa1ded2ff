"""The connection watch (a ZeroMQ socket monitor on each daemon connection): it reports drops on
tcp and ipc alike, and it is taken down in an order that cannot wedge the process's ZeroMQ context."""
from __future__ import annotations

import asyncio
import shutil
import signal
import time

import pytest
import zmq
import zmq.asyncio

import genie
from daemons import DaemonProcess, ipc_endpoint
from genie.transport.channel import Channel


class _RecordingSocket(zmq.asyncio.Socket):
    calls: list = []

    def disable_monitor(self):
        _RecordingSocket.calls.append(("disable_monitor", self.type, self.closed))
        return super().disable_monitor()

    def close(self, linger=None):
        if not self.closed:
            _RecordingSocket.calls.append(("close", self.type))
        return super().close(linger)


class _RecordingContext(zmq.asyncio.Context):
    _socket_class = _RecordingSocket


async def test_the_monitor_is_detached_from_the_open_socket_before_either_closes(daemon_endpoint):
    """libzmq's I/O thread sends monitor events with a blocking send: if the monitor's reading end
    closes while the monitored socket can still raise an event (a closed socket is torn down
    later, by another thread), that thread blocks for good and no connection of the context
    works again. So: detach first, on the open socket; then close the reader; then the socket."""
    _RecordingSocket.calls = []
    ctx = _RecordingContext()
    channel = Channel(daemon_endpoint, ctx)
    channel.on_disconnect = lambda why: None
    try:
        await channel.open()
        await asyncio.wait_for(channel.post("ping", {}), 10)
        await channel.close()
        await asyncio.sleep(0.05)  # anything the cancelled watch does late shows up too
        assert _RecordingSocket.calls == [("disable_monitor", zmq.DEALER, False),
                                          ("close", zmq.PAIR), ("close", zmq.DEALER)]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_an_ipc_daemon_killed_is_reported_at_once_not_by_heartbeats():
    """The watch is attached before connect(): on ipc the connection is up within connect(), and
    a watch attached after it never saw it come up, so it never reported it going down either."""
    endpoint, tmpdir = ipc_endpoint()
    try:
        with DaemonProcess(endpoint) as d:
            genie.init(endpoint)
            try:
                link = genie.get_runtime().links[0]
                d.proc.send_signal(signal.SIGKILL)
                d.proc.wait(10)
                deadline = time.monotonic() + 2.0  # well inside the heartbeat timeout
                while link.lost is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert link.lost is not None and "the connection dropped" in link.lost, link.lost
            finally:
                genie.shutdown()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture
def quick_connect(monkeypatch):
    import dataclasses

    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, connect_timeout=1.0, connect_refused_timeout=0.5))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_connect_timeout_says_whether_anything_was_listening(quick_connect):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts the connection, never answers
    try:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(genie.GenieConnectionError, match="the connection was made, but nothing answered"):
            genie.init(f"tcp://127.0.0.1:{port}")
    finally:
        silent.close(linger=0)
        ctx.destroy(linger=0)


@pytest.fixture
def patient_connect(monkeypatch):
    """A long connect timeout and a short one for refusals: refusals must not wait out the first."""
    import dataclasses

    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, connect_timeout=30.0, connect_refused_timeout=0.5))
    monkeypatch.setattr(rt, "_unreachable_since", float("-inf"))


@pytest.mark.timeout(60)
def test_a_refused_connection_fails_in_seconds_naming_the_cause(patient_connect, tmp_path):
    for endpoint, cause in ((f"tcp://127.0.0.1:{_free_port()}", "Connection refused"),
                            (f"ipc://{tmp_path}/no-daemon.sock", "no such socket file")):
        started = time.monotonic()
        with pytest.raises(genie.GenieConnectionError, match=f"nothing listens at {endpoint} .*{cause}"):
            genie.init(endpoint)
        assert time.monotonic() - started < 10  # not the 30 s connect timeout
    with pytest.raises(genie.GenieConnectionError, match="cannot resolve the host"):
        genie.init("tcp://no-such-host.invalid:5555")


@pytest.mark.timeout(60)
def test_device_count_after_a_failed_connect_answers_at_once(patient_connect, monkeypatch):
    import dataclasses

    import torch

    rt = genie.get_runtime()
    genie.shutdown()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, server_url=f"tcp://127.0.0.1:{_free_port()}"))
    assert torch.remote_accelerator.device_count() == 0  # tried, and failed after the refusal timeout
    started = time.monotonic()
    assert not torch.remote_accelerator.is_available() and torch.remote_accelerator.device_count() == 0
    assert time.monotonic() - started < 0.5


def test_endpoints_are_read_for_the_plain_connection_attempt():
    from genie.transport.reachability import parse

    assert parse("tcp://127.0.0.1:5555") == ("tcp", ("127.0.0.1", 5555))
    assert parse("tcp://[::1]:5555") == ("tcp", ("::1", 5555))
    assert parse("tcp://eth0;gpu1:5555") == ("tcp", ("gpu1", 5555))
    assert parse("ipc:///tmp/genie.sock") == ("ipc", "/tmp/genie.sock")
    assert parse("ipc://@abstract") is None and parse("inproc://x") is None and parse("tcp://host") is None


async def test_a_cancelled_reachability_watch_ends_and_leaves_no_unretrieved_error(tmp_path):
    """asyncio.wait_for in Python 3.11 returns its inner result when it is cancelled just as that
    finished, so a cancel could be lost: the watch went on probing and, `grace` later, failed with
    Unreachable that nobody read. Its log line ("Task exception was never retrieved") is written
    when the task is collected, at any moment: once during an ast.parse, which in 3.11.7 then
    failed with "AST constructor recursion depth mismatch". Cancelled at any step, it ends cancelled."""
    import gc

    from genie.transport import reachability

    loop = asyncio.get_running_loop()
    unread: list = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    try:
        for steps in range(12):  # cancel after each number of loop turns, hitting every await
            watch = asyncio.ensure_future(reachability.wait_until_refused(f"ipc://{tmp_path}/none.sock", 0.3))
            for _ in range(steps):
                await asyncio.sleep(0)
            watch.cancel()
            await asyncio.wait({watch}, timeout=2)
            assert watch.done() and watch.cancelled(), f"cancelled after {steps} turns, it went on: {watch}"
            del watch
            gc.collect()
        assert unread == []
    finally:
        loop.set_exception_handler(None)
