"""Fuzz a live genie-daemon's lane listener: greetings and records from a known client's token.

Beside ZeroMQ (tests/test_fuzz_daemon.py), a daemon takes stream connections on its lane listener:
bulk lanes (first, shared-memory, joining), direct lanes and sealed greetings. Anyone holding a
client's token can open one, so each connection here greets with one of the magics (or garbage),
the token of a connected client (or a random one), then writes records of every kind with hostile
ids, sizes and segment numbers, part of a payload, and, over a Unix socket, file descriptors that
are no segment (/dev/null, a pipe), unsealed or oddly sized memory files. Afterwards the daemon
still runs, a fresh client's upload and download come back right, and nothing is left held:
no client but the checker, no bytes waiting, no segment lent, RSS within a slack of before.
"""
from __future__ import annotations

import fcntl
import os
import random
import socket
import struct
import time

import pytest
import torch

from daemons import DaemonProcess, ipc_endpoint
from genie.transport import bulk, stream_framing

CONNECTIONS = int(os.environ.get("GENIE_FUZZ_LANES", "240"))  # a longer run: GENIE_FUZZ_LANES=5000
RSS_SLACK = 256 << 20
_RECORD = struct.Struct("<IQQQ")  # kind, transfer id, bytes, segment (genie.transport.bulk)
_HOSTILE = [0, 1, 7, 4096, 1 << 20, (1 << 31) - 1, 1 << 32, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]
_KINDS = [bulk.STREAM, bulk.SEGMENT, bulk.HAND_BACK, bulk.FORGET, bulk.WRITING, bulk.TO_DEVICE, bulk.HELLO,
          bulk.PART, 0, 9, bulk.STREAM, bulk.PART, bulk.SEGMENT, bulk.WRITING]


def _number(r: random.Random) -> int:
    return r.choice(_HOSTILE) if r.random() < 0.5 else r.randrange(64)


def _descriptor(r: random.Random) -> int:
    """A file descriptor to pass along a record: mostly memory files, sealed right or not."""
    choice = r.randrange(6)
    if choice == 0:
        return os.open("/dev/null", os.O_RDONLY)
    if choice == 1:
        read, write = os.pipe()
        os.close(write)
        return read
    fd = os.memfd_create("fuzz", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, r.choice([0, 4096, 2 << 20, 4 << 20, (2 << 20) + 1]))
    if choice >= 3:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | (fcntl.F_SEAL_SEAL if choice == 4 else 0))
    return fd


def _hostile_connection(r: random.Random, address: tuple, token: bytes) -> None:
    family, where = address
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(0.2)  # a greeting the daemon holds (a sealed one waits for more) is let go
    try:
        sock.connect(where)
        magic = r.choice([bulk.MAGIC, bulk.MAGIC_SHARED, bulk.MAGIC_JOIN, bulk.MAGIC_SEALED, stream_framing.MAGIC,
                          os.urandom(4)])
        greeting = magic + (token if r.random() < 0.85 else os.urandom(bulk.TOKEN_BYTES))
        if r.random() < 0.05:
            greeting = greeting[:r.randrange(len(greeting))]
        sock.sendall(greeting)
        if not sock.recv(1):
            return  # refused
        for _ in range(r.randrange(1, 6)):
            kind, nbytes = r.choice(_KINDS), _number(r)
            record = _RECORD.pack(kind, _number(r), nbytes, _number(r))
            if r.random() < 0.05:
                record = record[:r.randrange(len(record))]
            if family == socket.AF_UNIX and kind in (bulk.SEGMENT, bulk.WRITING) and r.random() < 0.7:
                fds = [_descriptor(r) for _ in range(r.choice([1, 1, 1, 2]))]
                try:
                    socket.send_fds(sock, [record], fds)
                finally:
                    for fd in fds:
                        os.close(fd)
            else:
                sock.sendall(record)
            if kind in (bulk.STREAM, bulk.PART) and nbytes < (4 << 20):
                sock.sendall(os.urandom(min(nbytes, r.randrange(1 << 16)) if r.random() < 0.5 else nbytes))
    except OSError:
        pass  # the daemon closed it, as it should for most of these
    finally:
        sock.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("transport", ["tcp", "ipc", "tcp-local"])
def test_the_lane_listener_survives_hostile_connections_and_holds_nothing_after(transport):
    """tcp-local: a tcp daemon's local listener (an abstract Unix socket), which its clients on
    this host use (see tests/test_local_lane.py)."""
    import genie
    from genie.runtime import get_runtime

    listen, tmp = ("tcp://127.0.0.1:0", None) if transport.startswith("tcp") else ipc_endpoint()
    r = random.Random(f"lanes-{transport}")
    host = torch.randn(1 << 20)  # 4 MiB: on the bulk lane (in shared memory over ipc)
    with DaemonProcess(listen, extra=["--transfer-timeout", "2"], local_lane=transport == "tcp-local") as daemon:
        try:
            rss_before = None
            for round_start in range(0, CONNECTIONS, 40):
                genie.init(daemon.endpoint)  # a client whose token the connections use
                link = get_runtime().links[0]
                assert link.bulk_lane is not None
                sock = link.bulk_lane.sock
                assert (sock.family == socket.AF_UNIX) == (transport != "tcp")
                address = (sock.family, sock.getpeername())
                if rss_before is None:
                    assert torch.equal((host.to("remote_accelerator:0") * 2).cpu(), host * 2)
                    rss_before = _rss(daemon.proc.pid)
                for _ in range(min(40, CONNECTIONS - round_start)):
                    _hostile_connection(r, address, link.token)
                genie.shutdown()
                assert daemon.proc.poll() is None, "".join(daemon.stderr_lines[-20:])
            genie.init(daemon.endpoint)
            remote = host.to("remote_accelerator:0")
            assert torch.equal((remote * 2).cpu(), host * 2)
            assert torch.equal(remote.cpu(), host)
            del remote
            torch.remote_accelerator.synchronize()  # the free goes with it

            def held() -> tuple:
                stats = get_runtime().links[0].request("stats", {"dev": 0}).body
                return (stats["clients"], stats["resident"], stats["upload_bytes_waiting"],
                        stats["segment_bytes_lent"], stats["mailbox_bytes"])

            deadline = time.monotonic() + 10
            while held() != (1, 0, 0, 0, 0) and time.monotonic() < deadline:  # hand-backs travel on the lane
                time.sleep(0.05)
            assert held() == (1, 0, 0, 0, 0)
            assert _rss(daemon.proc.pid) - rss_before < RSS_SLACK
        finally:
            genie.shutdown()
