"""Shared fixtures: one real genie-daemon for the session, connected through genie.init."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from daemons import DaemonProcess  # noqa: E402


@pytest.fixture
def zmq_ctx():
    """A ZeroMQ context for a raw client, destroyed (its sockets closed at linger 0) however the test
    ends. Left to the garbage collector with a socket open (a failed assert between a socket's
    creation and its close), a context hangs in term(), and the whole run with it."""
    import zmq

    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="session")
def daemon_endpoint():
    with DaemonProcess() as d:
        yield d.endpoint


@pytest.fixture
def dev(daemon_endpoint):
    """genie connected to the session daemon (reconnected if a test changed it); the device string."""
    import genie
    from genie.runtime import get_runtime

    rt = get_runtime()
    if not rt.started or [link.endpoint for link in rt.links] != [daemon_endpoint]:
        genie.init(daemon_endpoint)
    return "remote_accelerator:0"


@pytest.fixture
def tcp_lanes(dev):
    """`dev`, for tests of the tcp lanes themselves: skipped where the session daemon gave this
    process its local lane instead (GENIE_TEST_LOCAL_LANE=1, see tests/daemons.py)."""
    import genie

    if genie.get_runtime().links[0].local_lane:
        pytest.skip("tests the tcp lanes; the session daemon runs with its local lane (GENIE_TEST_LOCAL_LANE=1)")
    return dev


@pytest.fixture
def tcp_lane_endpoint(daemon_endpoint):
    """`daemon_endpoint`, for tests of its tcp lanes: skipped where it runs with its local lane."""
    if os.environ.get("GENIE_TEST_LOCAL_LANE") == "1":
        pytest.skip("tests the tcp lanes; the session daemon runs with its local lane (GENIE_TEST_LOCAL_LANE=1)")
    return daemon_endpoint


@pytest.fixture
def reference(dev):
    """Where a test's reference side runs: this process's GPU where the session daemon computes on
    CUDA and this process has CUDA too (the same kernels; scripts/gpu_node_check.sh), else the CPU."""
    import torch

    import genie

    on_cuda = genie.get_runtime().links[0].devices[0]["type"] == "cuda"
    return "cuda" if on_cuda and torch.cuda.is_available() else "cpu"


@pytest.fixture
def index_errors_are_op_errors(dev):
    """For tests that make an op fail on the daemon with an index out of range: on a CUDA daemon
    that is a device-side assert, after which the daemon restarts (tests/test_device_loss.py),
    not one op's error; they run where the daemon computes on the CPU."""
    import genie

    if genie.get_runtime().links[0].devices[0]["type"] == "cuda":
        pytest.skip("an index out of range on a CUDA daemon is a device-side assert: the daemon restarts")
    return dev


@pytest.fixture
def two_daemons(daemon_endpoint):
    """genie connected to two fresh daemons, one over tcp and one over ipc; disconnected afterwards."""
    import shutil

    import genie
    from daemons import ipc_endpoint

    ipc, tmpdir = ipc_endpoint()
    with DaemonProcess("tcp://127.0.0.1:0", local_lane=False) as a, DaemonProcess(ipc) as b:
        assert a.endpoint.startswith("tcp://") and b.endpoint.startswith("ipc://")
        genie.init(f"{a.endpoint},{b.endpoint}")
        try:
            yield a, b
        finally:
            genie.shutdown()
    shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture
def sent_ops(monkeypatch):
    """The names of the ops this process sends from now on, in order (batches as they are taken)."""
    from genie.runtime.stream import DeviceStream

    sent: list[str] = []
    take = DeviceStream._take

    def spy(self, *args, **kwargs):
        sent.extend(op[0] for op in self.ops)
        return take(self, *args, **kwargs)

    monkeypatch.setattr(DeviceStream, "_take", spy)
    return sent
