"""Several daemons at once: one started over tcp, another over ipc, both through `genie-daemon`."""
import shutil
import time

import pytest
import torch
import zmq

import genie
from daemons import DaemonProcess


def test_devices_enumerate_daemons_in_order(two_daemons):
    a, b = two_daemons
    ra = torch.remote_accelerator
    assert ra.device_count() == 2
    assert a.endpoint in ra.get_device_name(0)
    assert b.endpoint in ra.get_device_name(1)


def test_work_runs_on_each_daemon(two_daemons):
    x0 = torch.arange(4.0, device="remote_accelerator:0")
    x1 = torch.arange(4.0, device="remote_accelerator:1") * 10
    assert (x0 * 2).cpu().tolist() == [0, 2, 4, 6]
    assert (x1 + 1).cpu().tolist() == [1, 11, 21, 31]
    s0 = genie.transport_stats()
    assert all(v["bytes_received"] > 0 for v in s0.values())


def test_moving_between_devices_and_mixing_is_an_error(two_daemons):
    x0 = torch.arange(4.0, device="remote_accelerator:0")
    x1 = x0.to("remote_accelerator:1")
    assert x1.device == torch.device("remote_accelerator:1")
    assert (x1 + 1).cpu().tolist() == [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="same device"):
        x0 + x1


def test_set_device_and_default_index(two_daemons):
    ra = torch.remote_accelerator
    with ra.device(1):
        t = torch.ones(2, device="remote_accelerator")
        assert t.device.index == 1
    assert ra.current_device() == 0
    t = torch.ones(2, device="remote_accelerator")
    assert t.device.index == 0


def test_memory_is_per_daemon(two_daemons):
    ra = torch.remote_accelerator
    base0, base1 = ra.memory_allocated(0), ra.memory_allocated(1)
    x = torch.zeros(1000, device="remote_accelerator:1")
    ra.synchronize(1)
    assert ra.memory_allocated(1) == base1 + 4000
    assert ra.memory_allocated(0) == base0
    del x


def test_daemon_to_daemon_copy_bypasses_the_client(two_daemons):
    x = torch.randn(512, 512, device="remote_accelerator:0")  # 1 MiB, made on daemon 0
    expected = x.sum().item()
    before = genie.transport_stats()
    y = x.to("remote_accelerator:1")
    assert y.device == torch.device("remote_accelerator:1")
    assert abs(y.sum().item() - expected) < 1e-2
    z = torch.empty(512, 512, device="remote_accelerator:1")
    z.copy_(x * 2)
    assert abs(z.sum().item() - 2 * expected) < 1e-2
    after = genie.transport_stats()
    moved = sum(after[k]["bytes_sent"] + after[k]["bytes_received"]
                - before[k]["bytes_sent"] - before[k]["bytes_received"] for k in after)
    assert moved < 64 * 1024, f"{moved} bytes went through the client for 2 MiB of transfers"


def test_moving_between_daemons_makes_one_copy(two_daemons, sent_ops):
    """`x.to(other device)` is the peer's copy itself: no second `_to_copy` of it on the receiver
    (it copied every moved tensor again, into fresh memory: 64 MiB took ~50 ms, not ~17). A change
    of dtype on the way still converts there."""
    x = torch.randn(64, 32, device="remote_accelerator:0")
    expected = x.cpu()
    torch.remote_accelerator.synchronize(0)
    sent_ops.clear()
    y = x.to("remote_accelerator:1")
    assert torch.equal(y.cpu(), expected)
    assert sent_ops.count("genie::recv") == 1 and "aten::_to_copy" not in sent_ops, sent_ops
    t = x.t()  # a transposed view keeps its layout, as PyTorch's .to() keeps it
    moved = t.to("remote_accelerator:1")
    assert moved.stride() == t.stride() and torch.equal(moved.cpu(), expected.t())
    sent_ops.clear()
    half = x.to("remote_accelerator:1", dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half.cpu(), expected.half())
    assert sent_ops.count("aten::_to_copy") == 1, sent_ops


@pytest.mark.parametrize("channels", [4, 256])  # 12 KiB inside ZeroMQ; 3 MiB on a lane (once it is open)
def test_a_moved_tensor_keeps_its_memory_layout(two_daemons, channels):
    """Channels-last and permuted tensors move between daemons in their own memory order and keep
    their strides (as PyTorch's .to() between CUDA devices); a view with gaps arrives row-major."""
    x = torch.randn(2, channels, 16, 12, device="remote_accelerator:0")
    if x.nbytes >= 1 << 20:
        _copy_until_a_lane_opens(x, 0, 1)
    for t in (x.contiguous(memory_format=torch.channels_last), x.permute(3, 1, 0, 2)):
        want = t.cpu()
        moved = t.to("remote_accelerator:1")
        assert moved.stride() == t.stride() and moved.stride() == want.stride()
        back = moved.cpu()
        assert back.stride() == want.stride() and torch.equal(back, want)
        assert torch.equal((moved * 2).cpu(), want * 2)  # the daemon's tensor is laid out as planned
    if x.nbytes >= 1 << 20:
        assert _peer_lane_bytes(0) >= 2 * x.nbytes
    gaps = x[:, ::2]
    moved = gaps.to("remote_accelerator:1")
    assert moved.is_contiguous() and torch.equal(moved.cpu(), gaps.cpu())


def _daemon_stats(index: int) -> dict:
    stream = genie.get_runtime().streams[index]
    stream.synchronize()
    return stream.link.request("stats", {"dev": stream.local_index}).body


def _peer_lane_bytes(index: int) -> int:
    """Bytes daemon `index` sent to peers on lanes (see daemon/peers.py)."""
    return _daemon_stats(index)["peer_lane_bytes_sent"]


def _copy_until_a_lane_opens(x: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Copy `x` from device `src` to `dst` until daemon `src` has sent on a lane to its peer (the
    first copy greets the peer, whose answer opens the lane); each copy checked. x on the CPU."""
    expected = x.cpu()
    deadline = time.monotonic() + 20
    while _peer_lane_bytes(src) == 0:
        assert time.monotonic() < deadline, "no lane to the peer daemon"
        assert torch.equal(x.to(f"remote_accelerator:{dst}").cpu(), expected)
        time.sleep(0.05)
    return expected


def test_large_daemon_to_daemon_copies_take_a_lane_once_the_peer_offers_one(two_daemons):
    """The first large copy greets the peer (and goes inside ZeroMQ); once its answer opened a lane,
    copies of 1 MiB and more go there: the bytes land in the receiver's recycled buffers. Both
    directions (daemon 0 listens on tcp, daemon 1 on ipc: a TCP lane one way, a Unix one back)."""
    for src, dst in ((0, 1), (1, 0)):
        x = torch.randn(1 << 20, device=f"remote_accelerator:{src}")  # 4 MiB
        expected = _copy_until_a_lane_opens(x, src, dst)
        before = _peer_lane_bytes(src)
        for k in range(3):
            y = (x + k).to(f"remote_accelerator:{dst}")
            assert torch.equal(y.cpu(), expected + k)
        assert _peer_lane_bytes(src) - before == 3 * x.nbytes
        small = torch.arange(10.0, device=f"remote_accelerator:{src}")  # below the lane's threshold
        assert torch.equal(small.to(f"remote_accelerator:{dst}").cpu(), torch.arange(10.0))
        assert _peer_lane_bytes(src) - before == 3 * x.nbytes
    # As many lanes as a client opens: 4 connections to the tcp daemon, 1 to the ipc one.
    a, b = two_daemons
    assert _daemon_stats(0)["peer_lane_counts"] == {b.endpoint: 1}
    assert _daemon_stats(1)["peer_lane_counts"] == {a.endpoint: 4}


def _copy_until_a_direct_lane_opens(x: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Copy small `x` from device `src` to `dst` until daemon `src` has a direct lane to its peer
    (the first copy greets it); each copy checked. x on the CPU."""
    expected = x.cpu()
    deadline = time.monotonic() + 20
    while not _daemon_stats(src)["peer_direct_lanes"]:
        assert time.monotonic() < deadline, "no direct lane to the peer daemon"
        assert torch.equal(x.to(f"remote_accelerator:{dst}").cpu(), expected)
        time.sleep(0.05)
    return expected


def _small_copies_go_direct(src: int, dst: int, path: str) -> None:
    x = torch.randn(4096, device=f"remote_accelerator:{src}")  # 16 KiB: below the bulk lanes' threshold
    expected = _copy_until_a_direct_lane_opens(x, src, dst)
    stats = _daemon_stats(src)
    assert list(stats["peer_direct_lanes"].values()) == [path]
    before, lane_bytes = stats["peer_direct_deposits"], stats["peer_lane_bytes_sent"]
    for k in range(5):
        y = (x + k).to(f"remote_accelerator:{dst}")
        assert torch.equal(y.cpu(), expected + k)
    stats = _daemon_stats(src)
    assert stats["peer_direct_deposits"] - before == 5
    assert stats["peer_lane_bytes_sent"] == lane_bytes


def test_small_daemon_to_daemon_copies_take_the_peers_direct_lane(two_daemons):
    """Copies below the bulk lanes' threshold went inside ZeroMQ, through an I/O thread at each
    end (~200 us of a 16 KiB copy's ~600 here); the first now greets the peer, and once its answer
    opened a direct lane (a plain socket, read by the peer's event loop) the deposits go there:
    a 16 KiB copy and a read of it 0.57-0.61 -> 0.49-0.51 ms. Both directions (tcp, Unix socket)."""
    _small_copies_go_direct(0, 1, "unix")
    _small_copies_go_direct(1, 0, "tcp")


def test_small_copies_between_daemons_under_curve_take_a_sealed_direct_lane(tmp_path):
    from daemons import curve_pair

    if not zmq.has("curve"):
        pytest.skip("needs a libzmq built with CURVE")
    flags, keys = curve_pair(tmp_path)
    shutil.copy(keys["server_key"], tmp_path / "allowed" / "daemon.key")  # the daemons greet each other
    with DaemonProcess(extra=flags, local_lane=False) as a, DaemonProcess(extra=flags, local_lane=False) as b:
        genie.init(f"{a.endpoint},{b.endpoint}", **keys)
        try:
            _small_copies_go_direct(0, 1, "tcp-sealed")
        finally:
            genie.shutdown()


def test_a_direct_lane_to_a_peer_survives_quiet_spells_and_the_peer_dropping_it(daemon_endpoint):
    """As for bulk lanes: after half the lease without a message to the peer a small copy goes
    inside ZeroMQ (renewing the lease); after a whole lease the peer drops us and our direct lane,
    the copies go on inside ZeroMQ, and greet it again."""
    with DaemonProcess(extra=["--client-lease", "2"], local_lane=False) as a, \
            DaemonProcess(extra=["--client-lease", "2"], local_lane=False) as b:
        genie.init(f"{a.endpoint},{b.endpoint}")
        try:
            x = torch.randn(64, device="remote_accelerator:0")
            expected = _copy_until_a_direct_lane_opens(x, 0, 1)

            def copy_and_count() -> int:
                assert torch.equal(x.to("remote_accelerator:1").cpu(), expected)
                return _daemon_stats(0)["peer_direct_deposits"]

            direct = copy_and_count()
            time.sleep(1.5)  # past half the lease (1 s): this copy renews it inside ZeroMQ
            assert copy_and_count() == direct
            assert copy_and_count() == direct + 1  # and the direct lane carries the next
            time.sleep(3.5)  # past the lease: the peer dropped us and our lanes
            deadline = time.monotonic() + 20
            while copy_and_count() == direct + 1:
                assert time.monotonic() < deadline, "the direct lane was not opened again"
        finally:
            genie.shutdown()


@pytest.mark.parametrize("numel", [16, 1 << 20])  # inside ZeroMQ; on a lane
def test_a_write_after_a_move_does_not_reach_the_moved_copy(two_daemons, numel):
    """`y = x.to(dev1); x.add_(1)`: y holds x as it was at the move, as a CUDA copy reads its
    source in stream order. Before, the sending daemon read x's memory only when the bytes left,
    after it had run the write: 17-30 of 30 copies held the written values."""
    for src, dst in ((0, 1), (1, 0)):
        for _ in range(10):
            x = torch.zeros(numel, device=f"remote_accelerator:{src}")
            y = x.to(f"remote_accelerator:{dst}")
            x.add_(1)
            genie.get_runtime().streams[src].flush()  # the write goes to the daemon at once
            assert y.sum().item() == 0
            assert x.sum().item() == numel


@pytest.mark.parametrize("listen, shared, curve", [("ipc", True, False), ("ipc", False, False), ("tcp", True, False),
                                                   ("ipc", True, True), ("tcp", True, True)])
def test_daemons_on_one_host_copy_through_shared_memory(listen, shared, curve, tmp_path):
    """Two daemons of one user on one host: a large copy between them goes in a shared segment of
    the sender, which the receiver keeps the tensor over until it is freed (then the segment comes
    back). ipc:// daemons lane over their Unix socket, tcp:// ones over their local lane (an
    abstract Unix socket named in hello), under CURVE as well (plain lanes, for the own user only).
    With --no-shared-memory (on both) it goes through the Unix socket."""
    from daemons import curve_pair, ipc_endpoint

    extra, keys = ([] if shared else ["--no-shared-memory"]), {}
    if curve:
        if not zmq.has("curve"):
            pytest.skip("needs a libzmq built with CURVE")
        flags, keys = curve_pair(tmp_path)
        shutil.copy(keys["server_key"], tmp_path / "allowed" / "daemon.key")  # the daemons greet each other
        extra += flags

    def start():
        return DaemonProcess(ipc_endpoint()[0] if listen == "ipc" else "tcp://127.0.0.1:0", extra=extra,
                             local_lane=True)

    with start() as a, start() as b:
        genie.init(f"{a.endpoint},{b.endpoint}", **keys)
        try:
            for src, dst, peer in ((0, 1, b), (1, 0, a)):
                x = torch.randn(1 << 20, device=f"remote_accelerator:{src}")  # 4 MiB
                expected = _copy_until_a_lane_opens(x, src, dst)
                assert _daemon_stats(src)["peer_lanes"] == {peer.endpoint: "shared-memory" if shared else "unix"}
                y = (x * 2).to(f"remote_accelerator:{dst}")
                assert torch.equal(y.cpu(), expected * 2)
                lent = _daemon_stats(src)["peer_segment_bytes_lent"]
                assert lent >= x.nbytes if shared else lent == 0
                del y
                torch.remote_accelerator.synchronize(dst)  # the free goes with it
                deadline = time.monotonic() + 10
                while _daemon_stats(src)["peer_segment_bytes_lent"] and time.monotonic() < deadline:
                    time.sleep(0.02)  # the hand-back travels on the lane
                assert _daemon_stats(src)["peer_segment_bytes_lent"] == 0
        finally:
            genie.shutdown()


def test_peer_lanes_option_sets_the_connections_and_split_copies_arrive_whole():
    """`genie-daemon --peer-lanes 2`: two connections to each peer; a copy of 16 MiB (from 8 MiB
    payloads are split across the lanes) arrives whole, both ways."""
    with DaemonProcess(extra=["--peer-lanes", "2"], local_lane=False) as a, \
            DaemonProcess(extra=["--peer-lanes", "2"], local_lane=False) as b:
        genie.init(f"{a.endpoint},{b.endpoint}")
        try:
            for src, dst, peer in ((0, 1, b), (1, 0, a)):
                x = torch.randn(4 << 20, device=f"remote_accelerator:{src}")  # 16 MiB
                expected = _copy_until_a_lane_opens(x, src, dst)
                assert _daemon_stats(src)["peer_lane_counts"] == {peer.endpoint: 2}
                before = _peer_lane_bytes(src)
                y = (x * 2).to(f"remote_accelerator:{dst}")
                assert torch.equal(y.cpu(), expected * 2)
                assert _peer_lane_bytes(src) - before == x.nbytes
        finally:
            genie.shutdown()


def test_a_peer_lane_survives_quiet_spells_and_the_peer_dropping_it(daemon_endpoint):
    """After half the lease without a message to the peer, a copy goes inside ZeroMQ (renewing the
    lease: the peer may be dropping our lane just then); after a whole lease the peer drops us and
    our lane, and large copies are on a lane again shortly after."""
    with DaemonProcess(extra=["--client-lease", "2"]) as a, DaemonProcess(extra=["--client-lease", "2"]) as b:
        genie.init(f"{a.endpoint},{b.endpoint}")
        try:
            x = torch.randn(1 << 18, device="remote_accelerator:0")  # 1 MiB
            expected = x.cpu()

            def copy_and_count() -> int:
                assert torch.equal(x.to("remote_accelerator:1").cpu(), expected)
                return _peer_lane_bytes(0)

            deadline = time.monotonic() + 20
            while copy_and_count() == 0:
                assert time.monotonic() < deadline, "no lane to the peer daemon"
            on_lane = copy_and_count()
            time.sleep(1.5)  # past half the lease (1 s): this copy renews it inside ZeroMQ
            assert copy_and_count() == on_lane
            assert copy_and_count() == on_lane + x.nbytes  # and the lane carries the next
            time.sleep(3.5)  # past the lease: the peer dropped us and our lane
            deadline = time.monotonic() + 20
            while copy_and_count() == on_lane + x.nbytes:
                assert time.monotonic() < deadline, "the lane was not opened again"
        finally:
            genie.shutdown()


def test_one_daemon_with_two_devices(daemon_endpoint):
    with DaemonProcess(extra=["--device", "cpu,cpu"]) as d:
        genie.init(d.endpoint)
        try:
            assert torch.remote_accelerator.device_count() == 2
            x = torch.arange(6.0, device="remote_accelerator:0").reshape(2, 3).t()
            y = x.to("remote_accelerator:1")
            del x  # the copy must not depend on the source's Python object
            # A transposed tensor keeps its strides, as PyTorch's .to() keeps them between GPUs.
            assert y.device.index == 1 and y.stride() == (1, 3) and not y.is_contiguous()
            assert y.cpu().tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
            assert (y + 1).cpu().tolist() == [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]
            image = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
            moved = image.to("remote_accelerator:0").to("remote_accelerator:1")
            assert moved.stride() == image.stride() and torch.equal(moved.cpu(), image)
            assert moved.cpu().is_contiguous(memory_format=torch.channels_last)
            gappy = torch.arange(12.0, device="remote_accelerator:0").reshape(3, 4)[:, ::2]
            row_major = gappy.to("remote_accelerator:1")  # a view with gaps arrives row-major, as there
            assert row_major.is_contiguous() and row_major.cpu().tolist() == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]
            z = torch.ones(3, device="remote_accelerator:1") + torch.tensor(1.0)
            assert z.cpu().tolist() == [2.0, 2.0, 2.0]
            # Autograd on a device index above 0 needs the C++ device guard.
            w = torch.randn(3, 3, device="remote_accelerator:1", requires_grad=True)
            (w * 2).sum().backward()
            assert w.grad.device.index == 1 and w.grad.cpu().tolist() == [[2.0] * 3] * 3
            # PyTorch's generic Stream/Event work through that guard as well.
            s = torch.Stream(device="remote_accelerator:1")
            e = torch.Event(device="remote_accelerator:1", enable_timing=True)
            e.record(s)
            e.synchronize()
            assert s.device == torch.device("remote_accelerator:1") and e.query() and s.query()
        finally:
            genie.shutdown()


def test_payloads_larger_than_a_frame_travel_in_chunks(daemon_endpoint, monkeypatch):
    from genie.transport import tensors

    monkeypatch.setattr(tensors, "MAX_FRAME_BYTES", 1 << 20)  # this client: 1 MiB frames
    chunked = ["--max-frame-mb", "1", "--no-bulk-lane"]  # large payloads over ZeroMQ, in 1 MiB frames
    with DaemonProcess(extra=chunked) as a, DaemonProcess(extra=chunked) as b:
        genie.init(f"{a.endpoint},{b.endpoint}")
        try:
            src = torch.randn(1536, 1024)  # 6 MiB: six frames each way
            x = src.to("remote_accelerator:0")
            assert torch.equal(x.cpu(), src)
            y = (x * 2).to("remote_accelerator:1")  # daemon to daemon, chunked too
            assert torch.equal(y.cpu(), src * 2)
        finally:
            genie.shutdown()
