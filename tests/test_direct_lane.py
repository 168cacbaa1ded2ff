"""The direct lane: blocking requests and their answers on a plain socket beside ZeroMQ."""
from __future__ import annotations

import logging
import struct
import threading
import time

import pytest
import torch
import zmq

import genie
from genie.transport import bulk, protocol, stream_framing


def _link():
    return genie.get_runtime().links[0]


class FakeClient:
    """A client of its own (a ZeroMQ DEALER that said hello) with a raw direct-lane socket."""

    def __init__(self, link) -> None:
        self.token = bulk.new_token()
        self.ctx = zmq.Context()
        self.sock = None
        try:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.ROUTING_ID, self.token)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.connect(link.endpoint)
            self.dealer.send(protocol.pack(["hello", 70000, {"version": protocol.VERSION}]))
            assert self.dealer.poll(10_000), "no hello answer"
            self.dealer.recv()
            self.sock, _ = bulk.connect_greeted(_lane_address(link), stream_framing.MAGIC, self.token, 10.0)
        except BaseException:
            self.close()  # a context collected with its socket open would hang the run in term()
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.ctx.destroy(linger=0)


def _lane_address(link) -> tuple:
    """The lane listener `link`'s bulk lane went to (a tcp port, or a local lane's Unix socket)."""
    sock = link.bulk_lane.sock
    return (sock.family, sock.getpeername())


def test_blocking_reads_go_on_the_direct_lane(dev):
    link = _link()
    assert genie.transport_info()["links"][link.endpoint]["direct_lane"] is True
    x = torch.arange(6.0, device=dev)
    assert (x * 2).sum().item() == 30.0
    assert torch.equal((x + 1).cpu(), torch.arange(1.0, 7.0))
    assert link.channel._direct is None  # no ZeroMQ direct socket was needed


def test_without_the_direct_lane_blocking_reads_use_zeromq(monkeypatch, daemon_endpoint):
    import dataclasses

    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, direct_lane=False))  # GENIE_DIRECT_LANE=0
    genie.init(daemon_endpoint)
    try:
        link = _link()
        assert genie.transport_info()["links"][link.endpoint]["direct_lane"] is False
        assert (torch.ones(3, device="remote_accelerator:0") * 2).sum().item() == 6.0
        assert link.channel._direct is not None
    finally:
        monkeypatch.undo()
        genie.init(daemon_endpoint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_over_zeromq_results_equal_the_cpus_to_the_bit(monkeypatch, daemon_endpoint, dtype):
    """ZeroMQ puts message data at 8 mod 16, and a matmul over an input there rounds otherwise than
    the same matmul on the client's CPU (see tensors.COMPUTE_ALIGNMENT). The daemon realigns such
    payloads before its CPU kernels read them: its results equal the client's own to the bit,
    whether the inputs came with the op or were uploaded first."""
    import dataclasses

    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, direct_lane=False))  # GENIE_DIRECT_LANE=0
    genie.init(daemon_endpoint)
    try:
        torch.manual_seed(0)
        for shape in [(10, 8), (7, 33), (3, 1000)]:
            a = torch.randn(shape, dtype=dtype)
            assert torch.equal((a.to("remote_accelerator:0") @ a.T.to("remote_accelerator:0")).cpu(), a @ a.T)
            x = a.to("remote_accelerator:0")
            genie.synchronize()  # uploaded on its own
            assert torch.equal(torch.nn.functional.linear(x, x).cpu(), torch.nn.functional.linear(a, a))
    finally:
        monkeypatch.undo()
        genie.init(daemon_endpoint)


def test_a_message_on_the_direct_lane_gets_its_answer(dev):
    fake = FakeClient(_link())
    try:
        stream_framing.send_message(fake.sock, [protocol.pack(["ping", 70001, {}])])
        reply = stream_framing.receive_message(fake.sock, 4, 1 << 20, 1 << 20)
        assert protocol.unpack_header(reply[0].buffer) == [70001, True, {}]
    finally:
        fake.close()
    assert (torch.ones(2, device=dev) + 1).sum().item() == 4.0


def test_an_unknown_token_gets_no_direct_lane(dev):
    link = _link()
    with pytest.raises(ConnectionError):
        bulk.connect_greeted(_lane_address(link), stream_framing.MAGIC, bulk.new_token(), 10.0)


@pytest.mark.parametrize("garbage", [
    struct.pack("<I", 0),                                   # a message of no frames
    struct.pack("<I", protocol.MAX_FRAMES + 10),            # too many frames
    struct.pack("<IQ", 1, 1 << 50),                         # a frame larger than any allowed
    struct.pack("<IQ", 1, 5) + b"\xc1\xc1\xc1\xc1\xc1",     # a header that is not msgpack
])
def test_a_bad_message_closes_that_lane_and_the_daemon_carries_on(dev, garbage):
    fake = FakeClient(_link())
    sock = fake.sock
    try:
        sock.sendall(garbage)
        sock.settimeout(10)
        data = sock.recv(1 << 16)
        if data:  # a malformed header is answered with an error, like on ZeroMQ
            frames = struct.unpack_from("<I", data)[0]
            assert frames == 1 and b"ProtocolError" in data
        else:
            assert data == b""  # framing violations close the lane
    finally:
        fake.close()
    assert (torch.ones(2, device=dev) * 3).sum().item() == 6.0


def test_half_a_message_does_not_hold_the_daemon(dev):
    fake = FakeClient(_link())
    try:
        whole = b"".join(bytes(b) for b in stream_framing.encode([protocol.pack(["ping", 70002, {}])]))
        fake.sock.sendall(whole[:7])  # the rest never comes
        time.sleep(0.2)
        assert (torch.ones(4, device=dev) * 2).sum().item() == 8.0  # others are served meanwhile
        fake.sock.sendall(whole[7:])
        fake.sock.settimeout(10)
        reply = stream_framing.receive_message(fake.sock, 4, 1 << 20, 1 << 20)
        assert protocol.unpack_header(reply[0].buffer)[:2] == [70002, True]
    finally:
        fake.close()


def test_an_answer_the_client_does_not_read_does_not_hold_the_daemon(dev):
    fake = FakeClient(_link())
    try:
        # 4 x 2.8 MiB of answer (under the bulk threshold: inline), more than the socket holds.
        body = {"dev": 0, "stream": 0, "ops": [["aten::ones", [[700_000]], {}, 1 << 20]], "frees": [],
                "fetch": [1 << 20] * 4, "report": False, "wait": True}
        stream_framing.send_message(fake.sock, [protocol.pack(["exec", 70003, body])])
        time.sleep(0.5)  # nobody reads it
        assert (torch.ones(3, device=dev) + 2).sum().item() == 9.0  # others are served meanwhile
        fake.sock.settimeout(30)
        reply = stream_framing.receive_message(fake.sock, 8, 1 << 30, 1 << 30)  # all there, in order
        assert protocol.unpack_header(reply[0].buffer)[:2] == [70003, True] and len(reply) == 5
        assert all(f.buffer.nbytes == 700_000 * 4 for f in reply[1:])
    finally:
        fake.close()


def test_a_client_gone_before_its_answer_does_not_disturb_the_daemon(dev):
    for _ in range(3):
        fake = FakeClient(_link())
        body = {"dev": 0, "stream": 0, "ops": [["aten::ones", [[1 << 20]], {}, 1 << 20]], "frees": [],
                "fetch": [1 << 20], "report": False, "wait": True}
        stream_framing.send_message(fake.sock, [protocol.pack(["exec", 70004, body])])
        fake.close()  # before the 4 MiB answer (bulk-sized, but this client has no bulk lane: inline)
    assert (torch.ones(5, device=dev) * 2).sum().item() == 10.0


def test_full_batches_go_ahead_on_the_direct_lane_and_are_read_in_order(dev, monkeypatch):
    # A batch that fills up is posted on the direct socket (the daemon runs it while the client
    # captures the next), answers read later in order, at most MAX_OPS_AHEAD ops of them unread.
    from genie.runtime import link as link_module

    link, stream = _link(), genie.get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    monkeypatch.setattr(stream, "batch_ops", 4)
    monkeypatch.setattr(link_module, "MAX_OPS_AHEAD", 16)
    sent, unread_seen = [], []
    send_direct, post_threadsafe = link.channel.send_direct, link.channel.post_threadsafe

    def spy_send(kind, body, frames):
        sent.append(len(body["ops"]))
        unread_seen.append(link._direct_unread_ops)
        return send_direct(kind, body, frames)

    def spy_post(loop, kind, body, *rest):
        if kind == "exec":
            sent.append("loop")
        return post_threadsafe(loop, kind, body, *rest)

    monkeypatch.setattr(link.channel, "send_direct", spy_send)
    monkeypatch.setattr(link.channel, "post_threadsafe", spy_post)
    x = torch.zeros(3, device=dev)
    for _ in range(60):
        x = x + 1
    assert x.sum().item() == 180.0
    assert "loop" not in sent
    # zeros (one op), 60 adds, sum and .item(): each sent once, in batches of 4 to 8
    assert sum(sent) == 63 and len(sent) >= 63 // 8
    assert max(unread_seen) == 16  # bounded: the oldest answers are read first
    assert not link._direct_unread and link._direct_unread_ops == 0


@pytest.mark.parametrize("read", ["item", "nonzero"])
def test_a_reported_op_that_fills_its_batch_is_sent_once_and_reported(dev, monkeypatch, sent_ops, read):
    # The op a blocking read waits on (.item(), a data-dependent shape) is the last of its batch
    # and reported with it, even when it is the op that fills the batch. It went out unreported
    # in the full batch before, its answer was empty, and the capture ran it a second time.
    stream = genie.get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    monkeypatch.setattr(stream, "batch_ops", 8)
    y = torch.zeros(4, device=dev)
    torch.remote_accelerator.synchronize()
    sent_ops.clear()
    adds = 6 if read == "item" else 7
    for _ in range(adds):
        y = y + 1
    assert len(stream.ops) == adds
    if read == "item":
        assert y.sum().item() == 24.0  # sum is the 7th op, the read the 8th
        assert sent_ops.count("aten::_local_scalar_dense") == 1
    else:
        assert torch.equal(torch.nonzero(y).cpu(), torch.arange(4).reshape(4, 1))  # the 8th op
        assert sent_ops.count("aten::nonzero") == 1


def test_a_failed_posted_batch_is_reported_once_by_the_next_sync(dev, monkeypatch):
    # The daemon refuses a malformed batch at once, ahead of the answers to batches posted before
    # it: the client keeps that answer until it reads its turn.
    from genie.errors import RemoteExecutionError
    from genie.runtime import link as link_module

    link, stream = _link(), genie.get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    monkeypatch.setattr(link_module, "MAX_OPS_AHEAD", 4)
    good = {"dev": 0, "stream": 0, "ops": [], "frees": [], "fetch": [], "report": False}
    bad = dict(good, stream=-1)  # a bad stream id: the daemon refuses the batch
    for body in [good, good, bad] + [good] * 6:
        assert link.post_direct(dict(body), [], stream)
        assert link._direct_unread_ops <= 4
    with pytest.raises(RemoteExecutionError, match="stream"):
        torch.remote_accelerator.synchronize()
    assert not link._direct_unread
    torch.remote_accelerator.synchronize()  # said once
    assert (torch.ones(3, device=dev) * 2).cpu().tolist() == [2.0, 2.0, 2.0]


async def test_an_awaited_materialization_does_not_block_its_event_loop_on_posted_batches(dev, monkeypatch):
    # Its fetch goes behind the posted batches on the direct socket, and a thread of Genie's reads
    # their answers: the caller's event loop never blocks on them.
    link, stream = _link(), genie.get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    monkeypatch.setattr(stream, "batch_ops", 4)
    caller, reads_on_caller = threading.get_ident(), []
    forget = link._forget_oldest_posted

    def spy():
        if threading.get_ident() == caller:
            reads_on_caller.append(len(link._direct_unread))
        forget()

    monkeypatch.setattr(link, "_forget_oldest_posted", spy)
    x = torch.zeros(64, 64, device=dev)
    adds = 0
    while adds < 40 or not stream.ops:
        x, adds = x + 1, adds + 1
    posted = len(link._direct_unread)
    assert posted >= 5  # not read yet
    stream.flush()  # a post that nobody waits for goes behind them too
    assert len(link._direct_unread) == posted + 1
    assert (await genie.materialize(x)).sum().item() == adds * 64 * 64
    assert reads_on_caller == []
    torch.remote_accelerator.synchronize()
    assert not link._direct_unread and link._direct_unread_ops == 0


def test_shutdown_says_bye_behind_posted_batches(dev, monkeypatch, caplog):
    # The bye goes on the direct lane behind them (the daemon frees this client's tensors after
    # they ran, not before), and the daemon reads it even though the client closes right after.
    # Its answer comes on that lane too, before the daemon closes it (closed first, the client
    # read the end of the stream where the answer was due, warned, and failed the posted batches).
    caplog.set_level(logging.WARNING, logger="genie")
    link, stream = _link(), genie.get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    before = torch.remote_accelerator.memory_allocated()
    monkeypatch.setattr(stream, "batch_ops", 2)
    kept = [torch.ones(256, 1024, device=dev) * i for i in range(8)]  # 1 MiB each, posted and unanswered
    assert link._direct_unread
    sent, send_direct = [], link.channel.send_direct
    monkeypatch.setattr(link.channel, "send_direct", lambda kind, body, frames: sent.append(kind) or
                        send_direct(kind, body, frames))
    genie.shutdown()
    assert sent[-1] == "bye"
    assert not [r.getMessage() for r in caplog.records if "direct lane" in r.getMessage()]
    assert stream._async_error is None and not link._direct_unread
    genie.init(link.endpoint)
    deadline = time.monotonic() + 10
    while torch.remote_accelerator.memory_allocated() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert torch.remote_accelerator.memory_allocated() <= before
    del kept


def test_batches_grow_while_many_answers_are_unread(dev, monkeypatch):
    # Running far ahead of its reads, a program sends fewer, larger batches (up to 8x).
    link, stream = _link(), genie.get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    monkeypatch.setattr(stream, "batch_ops", 4)
    sizes, send_direct = [], link.channel.send_direct
    monkeypatch.setattr(link.channel, "send_direct", lambda kind, body, frames: sizes.append(len(body["ops"])) or
                        send_direct(kind, body, frames))
    x = torch.zeros(3, device=dev)
    for _ in range(200):
        x = x + 1
    assert x.sum().item() == 600.0
    posted = sizes[:-1]  # then the read
    assert posted[:4] == [4, 4, 4, 4] and posted[4] == 8 and max(posted) == 32


def test_answers_read_late_do_not_count_as_waiting(dev, monkeypatch):
    # The client polls for an answer only while answers lately came quickly (Channel._spin_for_reply):
    # posted batches whose answers are read after the program did other work must not count
    # the time since they were sent (that turned polling off for the reads that followed).
    link, stream = _link(), genie.get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    monkeypatch.setattr(stream, "batch_ops", 2)
    x = torch.ones(4, device=dev)
    for _ in range(6):
        x = x + 1
    assert link._direct_unread
    time.sleep(0.3)  # the program is busy elsewhere; the answers are in meanwhile
    link.channel._typical_wait = 0.0
    torch.remote_accelerator.synchronize()
    assert link.channel._typical_wait < 0.05
    assert x.sum().item() == 28.0
