"""A daemon's memory limit: the client that exceeds it gets an error naming the limit; others carry on."""
import gc

import pytest
import torch

import genie
from daemons import DaemonProcess

LIMIT_GB = 0.01  # 10.24 MiB


@pytest.fixture
def limited_daemon(daemon_endpoint):
    with DaemonProcess(extra=["--memory-limit", str(LIMIT_GB)]) as d:
        yield d.endpoint
    genie.init(daemon_endpoint)  # back to the session daemon for later tests


def test_limit_error_isolation_and_baseline(limited_daemon, zmq_ctx):
    import zmq
    from genie.transport import protocol

    # A second, independent client (raw protocol) keeps a tensor on the same daemon.
    other = zmq_ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.RCVTIMEO, 10_000)
    other.setsockopt(zmq.LINGER, 0)
    other.connect(limited_daemon)

    def other_call(rid, body):
        other.send_multipart([protocol.pack(["exec", rid, body])])
        return protocol.unpack_header(other.recv_multipart()[0])

    _, ok, _ = other_call(1, {"ops": [["aten::ones", [[1024]], {}, 1]]})
    assert ok

    genie.init(limited_daemon)
    ra = torch.remote_accelerator
    assert ra.memory_stats()["limit_bytes"] == int(LIMIT_GB * 2**30)
    baseline = ra.memory_allocated()
    small = torch.ones(1024, 256, device="remote_accelerator")  # 1 MiB: fine
    assert small.sum().item() == 1024 * 256
    big = torch.ones(4096, 1024, device="remote_accelerator")  # 16 MiB: over the limit
    with pytest.raises(genie.RemoteExecutionError, match="memory limit of 0.01 GiB") as failure:
        big.cpu()
    # Caught as CUDA's out-of-memory errors are (code that retries with a smaller batch).
    assert isinstance(failure.value, torch.OutOfMemoryError) and failure.value.error_type == "OutOfMemoryError"
    assert ra.OutOfMemoryError is torch.cuda.OutOfMemoryError

    # The other client is undisturbed.
    _, ok, body = other_call(2, {"ops": [["aten::mul.Scalar", [protocol.encode_handle(1), 3], {}, 2]], "fetch": [2]})
    assert ok and body["fetched"][0][1] == "float32"
    _, ok, _ = other_call(3, {"frees": [2]})
    # And this client still works once it stays within the limit.
    assert (small * 2).sum().item() == 2 * 1024 * 256

    del small, big
    gc.collect()
    assert ra.memory_allocated() == baseline
