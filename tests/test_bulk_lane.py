"""The bulk lane: large payloads over a plain socket beside ZeroMQ, into recycled buffers."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import time

import pytest
import torch

import genie
from daemons import DaemonProcess, ipc_endpoint
from genie.transport import bulk, stream_framing
from genie.transport.shared_segments import size_class

BIG = 1536 * 1024  # float32 elements: 6 MiB, above the 4 MiB default bulk threshold


def _lane():
    return genie.get_runtime().links[0].bulk_lane


def test_large_tensors_travel_on_the_tcp_bulk_lane(tcp_lanes):
    dev = tcp_lanes
    info = genie.transport_info()
    assert next(iter(info["links"].values()))["path"] == "zmq+bulk-tcp"
    lane = _lane()
    sent, received = lane.bytes_sent, lane.bytes_received
    src = torch.randn(BIG)
    original = src.clone()
    x = src.to(dev)
    src.add_(1)  # the upload was taken at .to() time, like a blocking host-to-device copy
    y = (x * 2).cpu()
    assert torch.equal(y, original * 2)
    assert lane.bytes_sent - sent >= BIG * 4 and lane.bytes_received - received >= BIG * 4


@contextlib.contextmanager
def _ipc_daemon(extra=None, **client_config):
    """genie connected to a fresh ipc:// daemon, with `client_config` fields replaced meanwhile."""
    ipc, tmpdir = ipc_endpoint()
    rt = genie.get_runtime()
    saved = rt.config
    try:
        with DaemonProcess(ipc, extra=extra) as d:
            rt.config = dataclasses.replace(saved, **client_config)
            genie.init(d.endpoint)
            try:
                yield d
            finally:
                genie.shutdown()
    finally:
        rt.config = saved
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_ipc_daemon_passes_payloads_in_shared_memory_used_in_place():
    with _ipc_daemon() as d:
        info = genie.transport_info()["links"][d.endpoint]
        assert info["path"] == "zmq+bulk-shared-memory" and info["bulk_min_bytes"] == 1 << 20
        lane = _lane()
        src = torch.arange(BIG, dtype=torch.float32)
        x = src.to("remote_accelerator:0")
        src.add_(1)  # taken at .to() time, as on every lane
        y = (x + 1).cpu()
        assert torch.equal(y, src)
        # The result is the daemon's segment itself, mapped here: held while y lives, then handed back.
        assert lane._incoming.in_use() == 1
        del y
        assert lane._incoming.in_use() == 0
        assert lane.bytes_received >= BIG * 4 and lane.bytes_sent >= BIG * 4
        for _ in range(3):  # segments recycled both ways: results stay right
            src = torch.randn(BIG)
            assert torch.equal((src.to("remote_accelerator:0") * 2).cpu(), src * 2)
        assert lane._outgoing.held_bytes() <= 3 * size_class(BIG * 4)


def test_uploads_are_copied_in_behind_their_record_only_where_the_daemon_keeps_them():
    with _ipc_daemon():
        sent = []
        real_send = bulk.Lane.send

        def send(self, xfer, payload, after_head=None, write_behind=False, records=None):
            before = len(records) if records is not None else 0
            real_send(self, xfer, payload, after_head, write_behind, records)
            sent.append((write_behind, records is not None and len(records) > before))

        bulk.Lane.send = send
        try:
            for _ in range(2):
                src = torch.randn(BIG)
                x = src.to("remote_accelerator:0")  # adopted: copied in behind its record
                y = torch.zeros(BIG, device="remote_accelerator:0")
                y.copy_(src * 2)  # read at once by copy_: copied in first
                assert torch.equal((x + y).cpu(), src * 3)
                del x, y
                torch.remote_accelerator.synchronize()  # the frees go: the daemon hands the segments back
                deadline = time.monotonic() + 10
                while any(s.busy for s in _lane()._outgoing._segments.values()):
                    assert time.monotonic() < deadline, "segments were not handed back"
                    time.sleep(0.01)
            # The first time a segment is named on the lane (its fd rides along); once the daemon
            # has handed it back, the request itself names it.
            assert sent == [(True, False), (False, False), (True, True), (False, False)]
        finally:
            bulk.Lane.send = real_send


def test_daemon_refuses_a_payload_still_being_written_to_an_op_that_reads_it():
    with _ipc_daemon():
        real_send = bulk.Lane.send
        bulk.Lane.send = lambda self, xfer, payload, after_head=None, write_behind=False, records=None: real_send(
            self, xfer, payload, after_head, True, records)  # a client that breaks its promise
        try:
            y = torch.zeros(BIG, device="remote_accelerator:0")
            with pytest.raises(genie.RemoteExecutionError, match="before its bytes were in"):
                y.copy_(torch.ones(BIG))
                y.cpu()  # the failed copy_ poisoned y: reading it says why
        finally:
            bulk.Lane.send = real_send
        src = torch.randn(BIG)
        assert torch.equal((src.to("remote_accelerator:0") + 1).cpu(), src + 1)  # and carries on


def test_a_request_naming_a_segment_the_daemon_does_not_know_fails_and_the_daemon_carries_on():
    with _ipc_daemon() as d:
        real_send = bulk.Lane.send

        def send(self, xfer, payload, after_head=None, write_behind=False, records=None):
            if records is not None:
                records.append([xfer, 999, payload.nbytes])  # no such segment
                after_head()
                return None
            return real_send(self, xfer, payload, after_head, write_behind, records)

        bulk.Lane.send = send
        try:
            with pytest.raises(genie.GenieError, match="unknown shared segment 999"):
                torch.ones(BIG).to("remote_accelerator:0")
                torch.remote_accelerator.synchronize()
        finally:
            bulk.Lane.send = real_send
        deadline = time.monotonic() + 10
        while not _lane().closed:  # a bad record closes the lane, as on the lane itself
            assert time.monotonic() < deadline, "the lane stayed open"
            time.sleep(0.01)
        assert d.proc.poll() is None
        src = torch.randn(BIG)
        assert torch.equal((src.to("remote_accelerator:0") + 1).cpu(), src + 1)  # over ZeroMQ now


@contextlib.contextmanager
def _segments_taken_by_name():
    """The segments the client takes as named in answers (bulk.Lane.take_named), while in the block."""
    taken = []
    real_take = bulk.Lane.take_named

    def take_named(self, segment, nbytes):
        taken.append(segment)
        return real_take(self, segment, nbytes)

    bulk.Lane.take_named = take_named
    try:
        yield taken
    finally:
        bulk.Lane.take_named = real_take


def test_downloads_into_segments_the_client_has_mapped_are_named_in_the_answer():
    with _ipc_daemon(), _segments_taken_by_name() as named:
        lane = _lane()
        src = torch.randn(BIG)
        x = src.to("remote_accelerator:0")
        for i in range(6):
            assert torch.equal((x + i).cpu(), src + i)  # each result freed at once: handed back
            time.sleep(0.05)
        # The first went on the lane (its fd with it); once handed back, answers name the segment.
        assert len(named) >= 3 and lane.bytes_received >= 6 * BIG * 4


def test_a_failed_fetch_still_takes_the_other_tensors_so_their_segments_come_back():
    with _ipc_daemon():
        src = torch.randn(BIG)
        x = src.to("remote_accelerator:0")
        assert torch.equal((x + 0).cpu(), src)  # a download: its segment is handed back, then named next time
        time.sleep(0.1)
        with _segments_taken_by_name() as taken:
            bad = torch.ones(4, device="remote_accelerator:0")[torch.tensor([10], device="remote_accelerator:0")]
            with pytest.raises(genie.RemoteExecutionError, match="out of bounds"):
                genie.materialize_sync([bad, x * 2])
        assert len(taken) == 1  # x * 2 was taken (and dropped: its segment goes back) though bad came first
        for i in range(3):  # and segments keep coming back: results stay right
            assert torch.equal((x + i).cpu(), src + i)


async def test_a_failed_async_materialize_still_takes_the_other_tensors():
    with _ipc_daemon():
        src = torch.randn(BIG)
        x = src.to("remote_accelerator:0")
        assert torch.equal((await genie.materialize(x + 0)), src)  # its segment comes back, then is named
        time.sleep(0.1)
        with _segments_taken_by_name() as taken:
            bad = torch.ones(4, device="remote_accelerator:0")[torch.tensor([10], device="remote_accelerator:0")]
            with pytest.raises(genie.RemoteExecutionError, match="out of bounds"):
                await genie.materialize([bad, x * 2])
        assert len(taken) == 1
        assert torch.equal(await genie.materialize(x + 1), src + 1)


def test_a_result_in_the_daemons_segment_outlives_the_daemon():
    with _ipc_daemon() as d:
        src = torch.randn(BIG)
        y = (src.to("remote_accelerator:0") * 3).cpu()
        assert _lane()._incoming.in_use() == 1  # y lives in the daemon's segment
        d.proc.kill()
        d.proc.wait(10)
        assert torch.equal(y, src * 3)  # the mapping keeps the memory: still readable, still right
        y.add_(1)  # and writable
        assert torch.equal(y, src * 3 + 1)


@pytest.mark.parametrize("extra, client", [(["--no-shared-memory"], {}), ([], {"shared_memory": False})])
def test_shared_memory_can_be_turned_off_on_either_side(extra, client):  # daemon flag; client GENIE_SHARED_MEMORY=0
    with _ipc_daemon(extra, **client) as d:
        info = genie.transport_info()["links"][d.endpoint]
        assert info["path"] == "zmq+bulk-unix" and info["bulk_min_bytes"] == 1 << 20
        src = torch.arange(BIG, dtype=torch.float32)
        assert torch.equal((src.to("remote_accelerator:0") + 1).cpu(), src + 1)
        assert _lane().bytes_received >= BIG * 4


def test_daemon_survives_a_shared_lane_sending_a_file_that_is_no_segment():
    with _ipc_daemon() as d:
        x = torch.ones(4, device="remote_accelerator:0")
        token = genie.get_runtime().links[0].token
        path = genie.get_runtime().links[0].bulk_lane.sock.getpeername()
        sock, answer = bulk.connect_greeted((socket.AF_UNIX, path), bulk.MAGIC_SHARED, token, 10.0)
        assert answer == bulk.ACCEPTED_SHARED  # same user: agreed
        with sock, open(os.devnull, "rb") as f:  # /dev/null: not a sealed memory file
            socket.send_fds(sock, [bulk._HEADER.pack(bulk.SEGMENT, 1, 4096, 1)], [f.fileno()])
            assert sock.recv(1) == b""  # the daemon closed that lane
        assert d.proc.poll() is None
        assert (x + 1).sum().item() == 8.0  # and still serves the client (its payloads go by ZeroMQ now)


def test_bulk_download_lands_in_a_recycled_buffer_without_a_copy(tcp_lanes):
    dev = tcp_lanes
    pool = genie.get_runtime().host_pool
    x = torch.randn(BIG, device=dev)
    first = x.cpu()
    blocks = [b.data_ptr() for sizes in pool._blocks.values() for b in sizes]
    assert first.data_ptr() in blocks  # the socket wrote straight into the pooled block
    address = first.data_ptr()
    del first
    reuses = pool.reuses
    second = (x + 0).cpu()
    assert second.data_ptr() == address and pool.reuses == reuses + 1  # same block, recycled


def test_without_a_bulk_lane_large_payloads_go_over_zeromq():
    with DaemonProcess(extra=["--no-bulk-lane"]) as d:
        genie.init(d.endpoint)
        try:
            assert genie.transport_info()["links"][d.endpoint]["path"] == "zmq"
            src = torch.randn(BIG)
            assert torch.equal(src.to("remote_accelerator:0").cpu(), src)
        finally:
            genie.shutdown()


def test_daemon_refuses_a_bulk_connection_from_an_unknown_client(tcp_lanes):
    dev = tcp_lanes
    port = _lane().sock.getpeername()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(bulk.MAGIC + b"\x00" * 16)  # a token no client owns
        assert s.recv(1) == b""  # closed without the accepting byte
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"HTTP/1.1 GET /\r\n\r\n")
        assert s.recv(1) == b""
    x = torch.randn(BIG, device=dev)  # the real client's lane still works
    assert x.cpu().shape == (BIG,)


def test_transport_info_says_what_paths_exist(dev):
    local = genie.transport_info()["local"]
    assert set(local) >= {"rdma_libraries", "rdma_devices", "ucx_lane", "gpudirect_rdma", "cuda", "cupy"}
    if "ucxx" not in local["rdma_libraries"]:
        assert local["ucx_lane"] == "not used: no UCX library (pip install ucxx-cu12 for RDMA between nodes); " \
                                   "bulk data goes over sockets"
    elif not local["rdma_devices"]:
        assert "no RDMA device" in local["ucx_lane"]
    assert local["gpudirect_rdma"].startswith("not on this side:")
    link = genie.transport_info()["links"][genie.get_runtime().links[0].endpoint]
    assert link["gpu_memory_over_ucx"].startswith("no:")  # a socket lane: no UCX at all
    if not torch.cuda.is_available():
        assert local["cuda"] is False


def test_an_upload_batch_goes_with_its_bytes_and_a_sync_after_it_asks_nothing_more(dev):
    link = genie.get_runtime().links[0]
    ch = link.channel
    torch.remote_accelerator.synchronize()
    src = torch.arange(BIG, dtype=torch.float32)
    before = ch.messages_sent
    x = src.to(dev)
    assert ch.messages_sent == before + 1  # the op reading the transfer went out with it, not batched for later
    torch.remote_accelerator.synchronize()
    assert ch.messages_sent == before + 1  # its answer says the upload is done: no round trip of its own
    assert torch.equal(x.cpu(), src)


def test_a_failing_op_with_a_bulk_argument_is_reported(dev):
    from genie.errors import RemoteExecutionError

    x = torch.zeros(10, device=dev)
    index = torch.full((BIG // 2,), 99, dtype=torch.int64)  # 6 MiB of out-of-range indices: on the lane
    y = x.index_select(0, index)  # planned fine here (shapes); fails on the daemon
    torch.remote_accelerator.synchronize()  # the batch ran; its failure stays with y, as for any op
    with pytest.raises(RemoteExecutionError, match="index"):
        y.cpu()
    del y
    assert torch.equal((x + 1).cpu(), torch.ones(10))  # the connection carries on


def test_an_unread_upload_answer_does_not_block_another_thread(dev):
    import threading

    small = torch.ones(4, device=dev)
    torch.remote_accelerator.synchronize()
    src = torch.randn(BIG)
    x = src.to(dev)  # its answer is left unread on the direct socket
    got = []
    t = threading.Thread(target=lambda: got.append((small * 3).cpu()))
    t.start()
    t.join(60)
    assert not t.is_alive() and torch.equal(got[0], torch.full((4,), 3.0))
    assert torch.equal(x.cpu(), src)


def test_a_claimed_transfer_is_dropped_when_a_later_argument_fails(dev):
    from genie.errors import UnsupportedOperationError
    from genie.frontend import capture

    stream = genie.get_runtime().stream(0)
    with stream.lock:
        with pytest.raises(UnsupportedOperationError):
            capture.encode_call([torch.randn(BIG), object()], {}, stream)  # no wire form
        assert stream.pending_bulk == []
    src = torch.randn(BIG)
    assert torch.equal(src.to(dev).cpu(), src)  # the lane is still in step


def test_a_refused_direct_post_is_reported_by_the_next_sync(dev):
    from genie.errors import RemoteExecutionError

    rt = genie.get_runtime()
    link, stream = rt.links[0], rt.stream(0)
    torch.remote_accelerator.synchronize()
    bad = {"dev": 0, "stream": -1, "ops": [], "frees": [], "fetch": [], "report": False}  # a bad stream id
    assert link.post_direct(bad, [], stream)
    with pytest.raises(RemoteExecutionError, match="stream"):
        torch.remote_accelerator.synchronize()
    torch.remote_accelerator.synchronize()  # said once
    assert (torch.ones(3, device=dev) * 2).cpu().tolist() == [2.0, 2.0, 2.0]


def test_only_fetches_of_big_tensors_ask_for_the_bulk_lane(dev):
    # A request without bulk_min may be answered on the daemon's event loop (no worker hop).
    import gc

    stream = genie.get_runtime().stream(0)
    threshold = genie.get_runtime().links[0].bulk_min_bytes
    # Nothing queued, so the _take calls below drop no ops and no frees: earlier tests' garbage
    # collected first (once, a collection right after synchronize queued two frees), and no
    # collection meanwhile.
    gc.collect()
    torch.remote_accelerator.synchronize()
    gc.disable()
    try:
        with stream.lock:
            assert not stream.ops and not stream.deaths.dead
            assert "bulk_min" not in stream._take(fetch=[1], report=False, largest=threshold - 1)[0]
            assert stream._take(fetch=[1], report=False, largest=threshold)[0]["bulk_min"] == threshold
            assert stream._take(fetch=[1], report=False)[0]["bulk_min"] == threshold  # size unknown
    finally:
        gc.enable()
    small, big = torch.randn(1000), torch.randn(BIG)
    assert torch.equal(small.to(dev).cpu(), small) and torch.equal(big.to(dev).cpu(), big)


def test_threads_sharing_a_shared_memory_lane_get_their_own_bytes_back():
    import threading

    with _ipc_daemon():
        lane = _lane()
        errors = []

        def work(seed):
            try:
                g = torch.Generator().manual_seed(seed)
                for i in range(12):
                    n = (1 + (seed + i) % 3) * (1 << 20) // 4 * 2  # 2, 4 or 6 MiB
                    src = torch.randn(n, generator=g)
                    y = (src.to("remote_accelerator:0") + seed).cpu()
                    if not torch.equal(y, src + seed):
                        errors.append(f"thread {seed} round {i}: wrong bytes")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {seed}: {e!r}")

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads) and errors == []
        assert not lane.closed
        deadline = time.monotonic() + 10
        while lane._incoming.in_use() or any(s.busy for s in lane._outgoing._segments.values()):
            assert time.monotonic() < deadline, "segments were not all handed back"
            time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lane_port_fixes_where_both_lanes_connect():
    """--lane-port: a firewall can open the lanes' port beside the --listen one (by default it is any free port)."""
    port = _free_port()
    with DaemonProcess(extra=["--lane-port", str(port)], local_lane=False) as d:
        genie.init(d.endpoint)
        try:
            link = genie.get_runtime().links[0]
            assert link.bulk_lane.sock.getpeername()[1] == port
            assert link.channel.direct_stream.getpeername()[1] == port
            src = torch.randn(BIG)
            assert torch.equal(src.to("remote_accelerator:0").cpu(), src)
        finally:
            genie.shutdown()


def test_a_lane_port_in_use_stops_the_daemon_with_the_reason():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(RuntimeError, match=f"cannot listen for lanes on port {taken.getsockname()[1]}"):
            DaemonProcess(extra=["--lane-port", str(taken.getsockname()[1])]).start(timeout=60)


def test_an_unreachable_lane_listener_is_tried_once(monkeypatch, caplog):
    """Both lanes connect to one listener: when the bulk lane cannot reach it (a firewall dropping
    the port waits out the connect timeout, 10 s), the direct lane is not tried too."""
    closed = _free_port()  # nothing listens: refused
    real = bulk.connect_address
    monkeypatch.setattr(bulk, "connect_address", lambda advertised, endpoint: (
        lambda a: (a[0], (a[1][0], closed)) if a else a)(real(advertised, endpoint)))
    attempts = []
    real_greeted = bulk.connect_greeted
    monkeypatch.setattr(bulk, "connect_greeted", lambda *a, **k: attempts.append(a) or real_greeted(*a, **k))
    with DaemonProcess(local_lane=False) as d:
        with caplog.at_level("WARNING", logger="genie"):
            genie.init(d.endpoint)
        try:
            assert genie.transport_info()["links"][d.endpoint]["path"] == "zmq"
            assert len(attempts) == 1 and attempts[0][1] != stream_framing.MAGIC  # the bulk lane's, not the direct
            messages = " ".join(r.getMessage() for r in caplog.records)
            assert f"at port {closed}" in messages and "--lane-port" in messages and "unreachable" in messages
            src = torch.randn(BIG)
            assert torch.equal(src.to("remote_accelerator:0").cpu(), src)
        finally:
            genie.shutdown()


def test_uploads_no_request_names_are_let_go_after_the_transfer_timeout():
    """Bytes on the bulk lane that no request ever names (a client interrupted between sending
    them and the batch that reads them, or one that sends bytes alone) are let go after twice
    the transfer timeout, as a peer's unclaimed deposit is, instead of held until the client
    leaves; bytes a request has named wait for it however long it queues."""
    with DaemonProcess(extra=["--transfer-timeout", "0.5"]) as d:
        genie.init(d.endpoint)
        try:
            def waiting() -> int:
                return genie.get_runtime().links[0].request("stats", {"dev": 0}).body["upload_bytes_waiting"]

            lane = _lane()
            lane.send(lane.next_id(), memoryview(bytes(2 << 20)))  # no request will name it
            deadline = time.monotonic() + 5
            while waiting() < 2 << 20:
                assert time.monotonic() < deadline, "the bytes never showed as waiting"
                time.sleep(0.02)
            deadline = time.monotonic() + 10
            while waiting():
                assert time.monotonic() < deadline, "unclaimed upload bytes were held"
                time.sleep(0.1)
            src = torch.randn(BIG)
            assert torch.equal(src.to("remote_accelerator:0").cpu(), src)  # the lane is in step
        finally:
            genie.shutdown()
