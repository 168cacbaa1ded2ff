"""Fuzz a live genie-daemon with over 10,000 malformed and hostile messages (hypothesis).

Every message must get exactly one well-formed reply; afterwards the daemon still
computes correctly for a real client, and what it holds (handle-accounted tensors,
handles, mailbox, parked requests) is back to its baseline, its RSS close to it.
The daemon runs with a small memory limit and no bulk lane, so its process memory
cap (see daemon/memory_guard.py) turns absurd allocations into quick errors.
"""
from __future__ import annotations

import os
import struct

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemons import DaemonProcess
from genie.transport import protocol

MESSAGES = 10_000
REPLY_TIMEOUT_MS = 20_000
RSS_SLACK = 256 << 20  # allocator caches and arenas; a leak of what the fuzz allocates would be GBs

# ---------------------------------------------------------------- strategies

SMALL_INTS = st.integers(-4, 16)
HOSTILE_INTS = st.sampled_from([-1, -(1 << 31), (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 40, 1 << 62,
                                (1 << 63) - 1, -(1 << 63), (1 << 64) - 1])
INTS = st.one_of(SMALL_INTS, SMALL_INTS, HOSTILE_INTS)
SHAPES = st.lists(INTS, max_size=5)
DTYPE_NAMES = st.one_of(
    st.sampled_from(["float32", "float64", "int64", "int8", "bool", "uint8", "complex64", "bfloat16",
                     "float8_e4m3fn", "float99", "", "torch.float32", "object", "__class__"]),
    st.text(max_size=8))
# Strings an op might take: reduce modes, loopback-only peer endpoints, transfer ids (never real hosts).
STRINGS = st.one_of(
    st.sampled_from(["sum", "mean", "none", "tanh", "tcp://127.0.0.1:1", "ipc:///nonexistent/genie-fuzz",
                     "0" * 32, "f" * 32, "../../etc/passwd", "__import__('os').system('true')"]),
    st.text(max_size=12))
KNOWN_OP_NAMES = st.sampled_from([
        "aten::add.Tensor", "aten::mul.Scalar", "aten::ones.default", "aten::zeros.default", "aten::empty.memory_format",
        "aten::full.default", "aten::arange.start_step", "aten::randn.default", "aten::view.default",
        "aten::reshape.default", "aten::expand.default", "aten::as_strided.default", "aten::index_select.default",
        "aten::cat.default", "aten::mm.default", "aten::sum.dim_IntList", "aten::clone.default", "aten::copy_.default",
        "aten::add_.Tensor", "aten::index_put_.default", "aten::_index_put_impl_.default", "aten::repeat.default",
        "aten::slice.Tensor", "aten::select.int", "aten::nonzero.default", "aten::_local_scalar_dense.default",
        "aten::embedding.default", "aten::gather.default", "aten::scatter.src", "aten::topk.default",
        "aten::segment_reduce.default", "aten::from_file.default", "aten::set_.source_Storage", "aten::_print.default",
        "aten::_unsafe_index.Tensor", "aten::nope.default", "aten::add.nope", "prims::add.default",
        "os::system", "genie::recv", "genie::send", "genie::adopt", "genie::kv_append", "genie::kv_get",
        "genie::kv_close", "genie::manual_seed", "genie::event_record", "genie::event_wait",
        "genie::mark_persistent", "genie::define_program", "genie::replay", "genie::drop_program",
        "genie::storage_of", "genie::alias_storage", "genie::copy_storage", "genie::record_stream",
        "genie::resize_storage"])
OP_NAMES = st.one_of(KNOWN_OP_NAMES, st.text(max_size=24))


def _ext(code: int, payload) -> msgpack.ExtType:
    return msgpack.ExtType(code, payload if isinstance(payload, bytes) else msgpack.packb(payload))


EXTS = st.one_of(
    st.builds(lambda i: _ext(protocol.EXT_HANDLE, struct.pack("<q", max(-(1 << 63), min(i, (1 << 63) - 1)))), INTS),
    st.builds(lambda frame, dt, shape: _ext(protocol.EXT_TENSOR, [frame, dt, shape]),
              st.one_of(INTS, st.lists(INTS, max_size=3)), DTYPE_NAMES, SHAPES),
    st.builds(lambda x, dt, shape: _ext(protocol.EXT_BULK, [x, dt, shape]), INTS, DTYPE_NAMES, SHAPES),
    st.builds(lambda dt: _ext(protocol.EXT_DTYPE, dt.encode("utf-8", "replace")), DTYPE_NAMES),
    st.builds(lambda k, i: _ext(protocol.EXT_DEVICE, [k, i]), st.sampled_from(["remote", "cpu", "cuda", "x"]), INTS),
    st.builds(lambda n: _ext(protocol.EXT_MEMFMT, n.encode()), st.sampled_from(["channels_last", "bogus"])),
    st.builds(lambda n: _ext(protocol.EXT_LAYOUT, n.encode()), st.sampled_from(["strided", "sparse_coo"])),
    st.builds(lambda a, b: _ext(protocol.EXT_COMPLEX, [a, b]), st.floats(), st.one_of(st.floats(), st.text())),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)),
)
LEAVES = st.one_of(st.none(), st.booleans(), INTS, st.floats(), STRINGS, st.binary(max_size=12), EXTS)
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=10)
OUTS = st.one_of(st.none(), st.integers(1, 12), INTS, st.lists(st.one_of(st.none(), st.integers(1, 12)), max_size=3),
                 VALUES)
HANDLE_IDS = st.lists(st.one_of(st.integers(1, 12), INTS), max_size=4)
FRAMES = st.lists(st.binary(max_size=64), max_size=3)


def _op(name, args, kwargs, outs):
    return [name, args, kwargs, outs]


OPS = st.builds(_op, OP_NAMES, st.lists(VALUES, max_size=5),
                st.dictionaries(st.sampled_from(["dtype", "device", "generator", "unsafe", "out", "alpha", "dim"]),
                                VALUES, max_size=2), OUTS)
# Real tensors under handles 1..12, so hostile ops also meet real inputs (aliasing, in-place, views).
SEED_OPS = st.builds(lambda n, h: _op("aten::ones.default", [[n, 3]], {}, h), st.integers(0, 8), st.integers(1, 12))
EXEC_BODIES = st.fixed_dictionaries(
    {"ops": st.lists(st.one_of(OPS, SEED_OPS), max_size=4)},
    optional={"dev": st.one_of(SMALL_INTS, VALUES), "fetch": st.one_of(HANDLE_IDS, VALUES),
              "frees": st.one_of(HANDLE_IDS, VALUES), "report": st.one_of(st.booleans(), VALUES),
              "stream": st.one_of(SMALL_INTS, VALUES), "bulk_min": st.one_of(INTS, VALUES)})
OTHER_BODIES = st.fixed_dictionaries({}, optional={
    "dev": INTS, "query": st.one_of(st.lists(INTS, max_size=3), VALUES), "elapsed": st.one_of(st.lists(INTS), VALUES),
    "tid": STRINGS, "dtype": DTYPE_NAMES, "shape": SHAPES})
KINDS = st.one_of(st.sampled_from(protocol.KINDS), STRINGS, VALUES)
# "bye" frees everything the fuzzing client holds: keep it rare so state builds up between byes.
REQUEST_KINDS = st.one_of(*[st.just(k) for k in protocol.KINDS if k != "bye"] * 8, st.just("bye"))
RIDS = st.one_of(st.integers(0, 1 << 20), INTS, VALUES)

# Well-formed at the protocol level (valid markers, handles 1..12, real dtypes), hostile in values:
# these reach the operators themselves.
HANDLES = st.builds(protocol.encode_handle, st.integers(1, 12))
REAL_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64])
PLAUSIBLE_LEAVES = st.one_of(HANDLES, HANDLES, INTS, st.floats(), st.booleans(), st.none(),
                             st.builds(protocol.encode_dtype, REAL_DTYPES), st.just(protocol.encode_device("remote", 0)),
                             st.just(protocol.encode_device("cpu", 0)), SHAPES, st.lists(HANDLES, max_size=3), STRINGS)
PLAUSIBLE_OPS = st.builds(_op, KNOWN_OP_NAMES, st.lists(PLAUSIBLE_LEAVES, max_size=5),
                          st.dictionaries(st.sampled_from(["dtype", "alpha", "dim", "keepdim", "unsafe", "out"]),
                                          PLAUSIBLE_LEAVES, max_size=2),
                          st.one_of(st.integers(1, 12), st.lists(st.integers(1, 12), max_size=3), st.none()))
PLAUSIBLE_EXEC = st.builds(
    lambda r, ops, fetch, frees, report: ["exec", r, {"ops": ops, "fetch": fetch, "frees": frees, "report": report}],
    st.integers(0, 1 << 20), st.lists(st.one_of(PLAUSIBLE_OPS, PLAUSIBLE_OPS, SEED_OPS), min_size=1, max_size=5),
    st.lists(st.integers(1, 12), max_size=2), st.lists(st.integers(1, 12), max_size=1), st.booleans())

VALID = protocol.pack(["exec", 5, {"ops": [_op("aten::add.Tensor", [protocol.encode_handle(1), 2.0], {}, 2)],
                                   "fetch": [2], "report": True}])


def _mutate(data: bytes, edits: list) -> bytes:
    out = bytearray(data)
    for position, byte, cut in edits:
        if not out:
            break
        if cut:
            del out[position % len(out):]
        else:
            out[position % len(out)] = byte
    return bytes(out)


def _frames(header, frames):
    return [header if isinstance(header, bytes) else protocol.pack(header), *frames]


MESSAGE = st.one_of(
    # garbage frames
    st.lists(st.binary(max_size=48), min_size=1, max_size=4),
    # any msgpack value as a header
    st.builds(_frames, VALUES, FRAMES),
    # well-shaped requests of every kind, hostile bodies
    st.builds(lambda k, r, b, f: _frames([k, r, b], f), REQUEST_KINDS, RIDS, OTHER_BODIES, FRAMES),
    st.builds(lambda r, b, f: _frames(["exec", r, b], f), st.integers(0, 1 << 20), EXEC_BODIES, FRAMES),
    st.builds(lambda r, b, f: _frames(["exec", r, b], f), st.integers(0, 1 << 20), EXEC_BODIES, FRAMES),
    st.builds(lambda k, r, b: _frames([k, r, b], []), KINDS, RIDS, VALUES),
    st.builds(_frames, PLAUSIBLE_EXEC, st.just([])),
    st.builds(_frames, PLAUSIBLE_EXEC, st.just([])),
    st.builds(_frames, PLAUSIBLE_EXEC, st.just([])),
    st.builds(_frames, PLAUSIBLE_EXEC, FRAMES),
    # a valid request with bytes flipped or cut
    st.builds(lambda edits, f: _frames(_mutate(VALID, edits), f),
              st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255), st.booleans()), min_size=1, max_size=4),
              FRAMES),
)

# ---------------------------------------------------------------- the daemon and the fuzzing client


@pytest.fixture(scope="module")
def fuzz_daemon():
    # --no-bulk-lane: no receive pool, so the process cap is limit + margin (quick allocation failures)
    with DaemonProcess(extra=["--memory-limit", "0.25", "--transfer-timeout", "0.05", "--no-bulk-lane"]) as d:
        yield d


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class RawClient:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
        self.sock.connect(endpoint)
        self.sent = 0

    def exchange(self, frames: list) -> list:
        self.sock.send_multipart(frames)
        self.sent += 1
        reply = self.sock.recv_multipart()  # zmq.Again after the timeout: the daemon failed to answer
        header = msgpack.unpackb(reply[0], raw=False, strict_map_key=False)
        assert isinstance(header, list) and len(header) == 3 and type(header[1]) is bool, header
        assert isinstance(header[2], dict), header
        if not header[1] and set(header[2]) >= {"type", "message"}:
            assert header[2]["message"] or header[2]["type"], header
        return header

    def stats(self) -> dict:
        rid, ok, body = self.exchange([protocol.pack(["stats", 1, {}])])
        assert ok, body
        return body

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # closes the socket too; safe to call twice


@pytest.fixture
def raw_clients():
    """Makes RawClients, all closed however the test ends (see conftest.zmq_ctx)."""
    made = []

    def make(endpoint: str) -> RawClient:
        made.append(RawClient(endpoint))
        return made[-1]

    yield make
    for client in made:
        client.close()


def _held(stats: dict) -> dict:
    return {k: stats[k] for k in ("resident", "handles", "persistent_handles", "mailbox_bytes", "parked_requests",
                                  "kv_sessions", "kv_bytes", "copy_memos")}


def test_daemon_survives_10k_hostile_messages_and_returns_to_baseline(fuzz_daemon, raw_clients):
    pid = fuzz_daemon.proc.pid
    observer = raw_clients(fuzz_daemon.endpoint)
    baseline = _held(observer.stats())
    rss_before = _rss(pid)
    fuzzer = raw_clients(fuzz_daemon.endpoint)
    replies = {"ok": 0, "error": 0}

    @settings(max_examples=MESSAGES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(MESSAGE)
    def one_message(frames):
        header = fuzzer.exchange(frames)
        replies["ok" if header[1] else "error"] += 1

    one_message()
    sent = fuzzer.sent
    assert fuzz_daemon.proc.poll() is None, "the daemon died"
    assert sent >= MESSAGES, f"only {sent} messages were generated"
    fuzzer.exchange([protocol.pack(["bye", 2, {}])])  # frees what the fuzzing client holds
    fuzzer.close()

    # A real client still gets correct answers.
    import genie

    genie.init(fuzz_daemon.endpoint)
    try:
        x = torch.arange(12, dtype=torch.float32, device="remote_accelerator:0").reshape(3, 4)
        y = (x @ x.T + 1).softmax(-1)
        expected = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        torch.testing.assert_close(y.cpu(), (expected @ expected.T + 1).softmax(-1))
    finally:
        genie.shutdown()  # says bye: its tensors are freed too

    import time

    deadline = time.monotonic() + 10
    while True:
        after = _held(observer.stats())  # unclaimed deposits expire after 2 x the transfer timeout
        if after == baseline or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    rss_after = _rss(pid)
    print(f"fuzz: {sent} messages, {replies['ok']} ok / {replies['error']} error replies; "
          f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    observer.close()
    assert after == baseline, (baseline, after)
    assert rss_after - rss_before < RSS_SLACK, (rss_before, rss_after)


def test_deeply_nested_header_gets_an_error_reply(fuzz_daemon):
    client = RawClient(fuzz_daemon.endpoint)
    try:
        header = client.exchange([b"\x91" * 100_000 + b"\xc0"])  # a list in a list ... 100k deep
        assert header[1] is False
        header = client.exchange([protocol.pack(["exec", 3, {"ops": [], "fetch": [[[[[1]]]]] * 2}])])
        assert header[1] is False and "handle ids" in header[2]["message"]
    finally:
        client.close()


def test_unsafe_ops_keep_their_bounds_checks(fuzz_daemon):
    """Ops named unsafe and `unsafe=True` arguments skip bounds checks in their own kernels: the
    daemon runs their checked equivalents (daemon/checked_ops.py), under every overload name. In
    bounds they give the op's result; out of bounds, an error for that request, and the daemon
    carries on. (They were refused before, in bounds too.)"""
    client = RawClient(fuzz_daemon.endpoint)
    long = {"dtype": protocol.encode_dtype(torch.int64)}
    try:
        ops = [_op("aten::arange.default", [4.0], {}, 1),
               _op("aten::full.default", [[1], 9], long, 2),  # out of bounds for 4 elements
               _op("aten::full.default", [[1], 2], long, 3),
               _op("aten::full.default", [[1], 5.0], {}, 4)]
        rid, ok, body = client.exchange([protocol.pack(["exec", 4, {"ops": ops, "fetch": []}])])
        assert ok, body
        for n, (name, index) in enumerate([("aten::_index_put_impl_.default", 2), ("aten::_unsafe_index.Tensor", 2),
                                           ("aten::_unsafe_index.Tensor_hacked_twin", 2),
                                           ("aten::_unsafe_index_put.hacked_twin", 2)]):
            args = [protocol.encode_handle(1), [protocol.encode_handle(index)]]
            if "put" in name:
                args += [protocol.encode_handle(4), False]  # values, accumulate
            if name.startswith("aten::_index_put_impl_"):
                args.append(True)  # unsafe=True
            rid, ok, body = client.exchange([protocol.pack(["exec", 10 + n, {"ops": [_op(name, args, {}, 20 + n)],
                                                                              "fetch": [20 + n]}])])
            assert ok and "out of bounds" in body["fetched"][0]["error"]["message"], (name, body)
        # In bounds (a fresh tensor: the failed in-place op above poisoned handle 1, as it should).
        ops = [_op("aten::arange.default", [4.0], {}, 5),
               _op("aten::_unsafe_index.Tensor", [protocol.encode_handle(5), [protocol.encode_handle(3)]], {}, 30),
               _op("aten::_index_put_impl_.default", [protocol.encode_handle(5), [protocol.encode_handle(3)],
                                                      protocol.encode_handle(30), True, True], {}, None)]
        rid, ok, body = client.exchange([protocol.pack(["exec", 40, {"ops": ops, "fetch": [30, 5]}])])
        assert ok and not any("error" in f for f in body["fetched"]), body
    finally:
        client.exchange([protocol.pack(["bye", 50, {}])])
        client.close()


if os.environ.get("GENIE_FUZZ_MESSAGES"):  # a longer run: GENIE_FUZZ_MESSAGES=100000 pytest tests/test_fuzz_daemon.py
    MESSAGES = int(os.environ["GENIE_FUZZ_MESSAGES"])
