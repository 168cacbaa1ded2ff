"""A daemon answers bad requests with errors and keeps serving (raw ZeroMQ client, no genie runtime)."""
import msgpack
import pytest
import torch
import zmq

from genie.transport import numerics, protocol

TIMEOUT_MS = 10_000


@pytest.fixture
def sock(daemon_endpoint):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    s.connect(daemon_endpoint)
    try:
        yield s
        s.send_multipart([protocol.pack(["bye", 999, {}])])
        s.recv_multipart()
    finally:
        ctx.destroy(linger=0)


def call(sock, frames):
    sock.send_multipart(frames)
    header, *payload = sock.recv_multipart()
    return msgpack.unpackb(header, raw=False, strict_map_key=False), payload


def op(name, args, outs, kwargs=None):
    return [name, args, kwargs or {}, outs]


def test_hello(sock):
    (rid, ok, body), _ = call(sock, [protocol.pack(["hello", 1, {"version": protocol.VERSION}])])
    expected = "cuda" if torch.cuda.is_available() else "cpu"  # the daemon serves every GPU there is
    assert rid == 1 and ok and body["version"] == protocol.VERSION and body["devices"][0]["type"] == expected


@pytest.mark.parametrize("body", [{}, {"version": protocol.VERSION - 1}, {"version": "2"}])
def test_a_hello_from_another_protocol_version_is_refused_and_the_daemon_carries_on(sock, body):
    (rid, ok, reply), _ = call(sock, [protocol.pack(["hello", 2, body])])
    assert rid == 2 and not ok and f"protocol version {protocol.VERSION}" in reply["message"]
    assert "install the same Genie version" in reply["message"]
    (rid, ok, reply), _ = call(sock, [protocol.pack(["hello", 3, {"version": protocol.VERSION}])])
    assert rid == 3 and ok


def error_text(ok, body):
    """The request's error, or (for an op that failed inside a valid request) the fetched output's error."""
    return body["message"] if not ok else body["fetched"][0]["error"]["message"]


@pytest.mark.parametrize("frames, expected", [
    ([b"\xc1garbage"], "undecodable"),
    ([protocol.pack({"a": 1})], "header must be"),
    ([protocol.pack(["launch_missiles", 2, {}])], "unknown request kind"),
    ([protocol.pack(["exec", 3, {"ops": [op("aten::from_file", ["/etc/passwd"], 1)], "fetch": [1]}])],
     "not allowed"),
    ([protocol.pack(["exec", 4, {"ops": [op("os::system", ["ls"], 1)], "fetch": [1]}])], "only aten"),
    ([protocol.pack(["exec", 4, {"ops": [op("__import__('os')", [], 1)]}])], "bad op name"),
    ([protocol.pack(["exec", 5, {"ops": [op("aten::add.Tensor", [protocol.encode_handle(12345)] * 2, 1)],
                                 "fetch": [1]}])], "does not exist"),
    ([protocol.pack(["exec", 6, {"ops": "nope"}])], "ops must be a list"),
    ([protocol.pack(["exec", 7, {"ops": [op("aten::ones", [[2]], 1, {"dtype": msgpack.ExtType(3, b"float99")})]}])],
     "unknown dtype"),
])
def test_bad_requests_get_error_replies(sock, frames, expected):
    import re

    (rid, ok, body), _ = call(sock, frames)
    assert re.search(expected, error_text(ok, body)), body
    # ... and the daemon still serves.
    (rid, ok, body), _ = call(sock, [protocol.pack(["ping", 77, {}])])
    assert rid == 77 and ok


def test_frame_length_mismatch_is_refused(sock):
    inline = protocol.encode_inline(0, "float32", [4])
    header = protocol.pack(["exec", 8, {"ops": [op("aten::clone", [inline], 1)], "fetch": [1]}])
    (rid, ok, body), _ = call(sock, [header, b"\x00" * 15])
    assert "frame holds 15 bytes" in error_text(ok, body)


def test_exec_and_fetch_roundtrip(sock):
    ops = [op("aten::ones", [[3]], 1), op("aten::mul.Scalar", [protocol.encode_handle(1), 4], 2)]
    (rid, ok, body), payload = call(sock, [protocol.pack(["exec", 9, {"ops": ops, "fetch": [2]}])])
    assert ok
    frame, dtype, shape = body["fetched"][0]
    assert dtype == "float32" and shape == [3] and payload[frame] == b"\x00\x00\x80\x40" * 3


def test_another_clients_handles_cannot_be_read_freed_or_overwritten(sock, dev):
    import torch

    victim = torch.full((4,), 7.0, device=dev)
    victim_id = victim._genie.id
    torch.remote_accelerator.synchronize()
    read, _ = call(sock, [protocol.pack(["exec", 1, {"fetch": [victim_id]}])])
    assert "error" in read[2]["fetched"][0]  # no such handle for this client
    write, _ = call(sock, [protocol.pack(["exec", 2, {"ops": [op("aten::zero_", [protocol.encode_handle(victim_id)],
                                                                   None)], "report": True}])])
    assert write[1] is False
    call(sock, [protocol.pack(["exec", 3, {"frees": [victim_id]}])])
    assert victim.cpu().tolist() == [7.0] * 4  # untouched, still there


@pytest.mark.skipif(torch.cuda.is_available(), reason="the daemon here has a GPU (tests/test_cuda_paths.py: CUDA IPC)")
def test_a_daemon_without_a_gpu_refuses_cuda_ipc_handles_and_carries_on(sock):
    (_, ok, body), _ = call(sock, [protocol.pack(["hello", 40, {"version": protocol.VERSION}])])
    assert ok and "cuda_ipc" not in body  # nothing offered: clients send bytes
    shared = protocol.encode_cuda_ipc(["GPU-0a1b2c3d-0000-1111-2222-333344445555", b"\0" * 66, 64, 0, 0,
                                       b"/torch_1_2_3", 0, None, False, "float32", [4]])
    (rid, ok, body), _ = call(sock, [protocol.pack(["exec", 41, {"ops": [op("genie::adopt", [shared], 1)],
                                                                 "fetch": [1]}])])
    assert rid == 41 and not ok and "CUDA IPC" in body["message"]
    (rid, ok, _), _ = call(sock, [protocol.pack(["ping", 42, {}])])
    assert rid == 42 and ok


@pytest.mark.parametrize("extra, expected", [
    ([], [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]),  # as sent: a 1-D run
    ([[2, 3], [1, 2]], [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]),  # the run of a transposed tensor, kept so
    ([[2, 3], [1, 3]], "bad strides"),  # reaching past the run
    ([[2, 2], [1, 2]], "a run of 6 elements for shape"),
    ([[2, 3]], "takes one inline tensor"),
    ([[2, -3], [1, 2]], "bad shape"),
])
def test_adopt_keeps_an_upload_as_a_run_with_strides(sock, extra, expected):
    """genie::adopt of a channels-last or transposed upload: [run, shape, strides], checked like
    any field; anything malformed is refused and the daemon carries on."""
    import re

    run = torch.arange(6.0)
    args = [protocol.encode_inline(0, "float32", [6])] + extra
    ops = [op("genie::adopt", args, 1)]
    if not extra:
        ops.append(op("aten::view", [protocol.encode_handle(1), [2, 3]], 2))
    (rid, ok, body), frames = call(sock, [protocol.pack(["exec", 43, {"ops": ops, "fetch": [2 if not extra else 1]}]),
                                          run.numpy().tobytes()])
    if isinstance(expected, str):
        assert re.search(expected, error_text(ok, body)), body
    else:
        assert ok and "error" not in str(body["fetched"][0]), body
        desc = body["fetched"][0]
        got = torch.frombuffer(bytearray(frames[0]), dtype=torch.float32)
        if len(desc) == 4:  # sent as it lies, with its strides
            got = got.as_strided(desc[2], desc[3])
        assert got.reshape(desc[2]).tolist() == expected
    (rid, ok, _), _ = call(sock, [protocol.pack(["ping", 44, {}])])
    assert rid == 44 and ok


@pytest.mark.parametrize("strides, expected", [
    (None, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]),
    ([1, 2], [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]),  # a transposed tensor's run, kept with its strides
    ([1, 3], "bad strides"),  # reaching past the run
    ([2, 1, 1], "bad strides"),
    ("x", "bad strides"),
])
def test_a_deposit_may_carry_its_memory_order(sock, strides, expected):
    """A deposit (a peer daemon's tensor for genie::recv) with strides: its bytes are the run of a
    channels-last or transposed tensor, and genie::recv gives that tensor; bad strides are refused
    and the daemon carries on."""
    import re
    import secrets

    tid = secrets.token_hex(16)
    body = {"tid": tid, "dtype": "float32", "shape": [2, 3], **({} if strides is None else {"strides": strides})}
    (rid, ok, reply), _ = call(sock, [protocol.pack(["deposit", 45, body]), torch.arange(6.0).numpy().tobytes()])
    if isinstance(expected, str):
        assert rid == 45 and not ok and re.search(expected, reply["message"]), reply
    else:
        assert ok, reply
        ops = [op(protocol.RECV_OP, [tid], 1), op("aten::clone", [protocol.encode_handle(1)], 2,
                                                   {"memory_format": protocol.encode_memory_format(torch.contiguous_format)})]
        (rid, ok, reply), frames = call(sock, [protocol.pack(["exec", 46, {"ops": ops, "fetch": [2]}])])
        assert ok and "error" not in str(reply["fetched"][0]), reply
        assert torch.frombuffer(bytearray(frames[0]), dtype=torch.float32).reshape(2, 3).tolist() == expected
    (rid, ok, _), _ = call(sock, [protocol.pack(["ping", 47, {}])])
    assert rid == 47 and ok


@pytest.mark.parametrize("offset, sizes, strides, expected", [
    (0, [2, 2], [2, 1], None),                 # 16 of the 16 bytes
    (1, [2, 2], [2, 1], "outside the 16-byte storage"),
    (0, [5], [1], "outside the 16-byte storage"),
    (0, [2, 2], [4, 1], "outside the 16-byte storage"),
    (-1, [1], [1], "outside|takes"),
    (0, [2], [-1], "takes \\[handle, dtype"),
])
def test_alias_storage_stays_inside_the_clients_own_storage(sock, offset, sizes, strides, expected):
    """genie::alias_storage (torch.load onto the device) views one of the client's tensors'
    storage; any view reaching past it is refused (aten::set_ itself is refused outright)."""
    import re

    ops = [op("aten::zeros", [[16]], 1, {"dtype": protocol.encode_dtype(torch.uint8)}),
           op("genie::alias_storage", [protocol.encode_handle(1), protocol.encode_dtype(torch.float32),
                                       offset, sizes, strides], 2)]
    (rid, ok, body), payload = call(sock, [protocol.pack(["exec", 10, {"ops": ops, "fetch": [2]}])])
    if expected is None:
        assert ok and "error" not in str(body["fetched"][0])
        assert body["fetched"][0][2] == sizes
    else:
        assert re.search(expected, error_text(ok, body)), body
    (rid, ok, body), _ = call(sock, [protocol.pack(["ping", 78, {}])])
    assert rid == 78 and ok


@pytest.mark.parametrize("args, outs, expected", [
    ([protocol.encode_handle(1)], [[2, None, None, None, None]], None),
    ([protocol.encode_handle(1), protocol.encode_handle(0)], [[2, None, None, None, None], [3, None, None, None, None]], None),
    ([protocol.encode_handle(9)], [[2, None, None, None, None]], "9"),  # not this client's handle
    ([protocol.encode_handle(1)], [2, None, None, None, None], "outputs \\[handle, None, None, None, None\\] for each"),
    ([protocol.encode_handle(1)], 2, "for each"),
    ([protocol.encode_handle(1)], [[2, 3, None, None, None]], "for each"),
    ([protocol.encode_handle(1)], [[2, None, None, None]], "for each"),
    ([protocol.encode_handle(1), protocol.encode_handle(0)], [[2, None, None, None, None]], "for each"),
    ([1], [[2, None, None, None, None]], "for each"),
    ([], [], "takes handles"),
])
def test_storage_of_reports_tensors_storages_and_places_in_them(sock, args, outs, expected):
    """genie::storage_of (torch.save of remote tensors) names the whole storage of each of the
    client's own tensors it is given, in one call; anything else is refused and the daemon
    carries on."""
    import re

    ops = [op("aten::arange", [12], 0, {"dtype": protocol.encode_dtype(torch.float32)}),
           op("aten::as_strided", [protocol.encode_handle(0), [2, 3], [1, 4], 1], 1),
           op("genie::storage_of", args, outs)]
    (rid, ok, body), _ = call(sock, [protocol.pack(["exec", 11, {"ops": ops, "report": True}])])
    if expected is None:
        assert ok, body
        assert len(body["report"]) == len(args)
        whole, name, offset, strides, bits = body["report"][0]
        assert whole["tensor"][1:] == ["uint8", [48], [1], 0, 48] and name != 0
        assert (offset, strides, bits) == (1, [1, 4], [False, False])
        (_, ok, body2), _ = call(sock, [protocol.pack(["exec", 12, {"fetch": [2]}])])
        assert ok and body2["fetched"][0][2] == [48]
        if len(args) == 2:  # the arange itself: the same storage, its own place in it
            whole, name2, offset, strides, bits = body["report"][1]
            assert (name2, offset, strides) == (name, 0, [1]) and whole["tensor"][0] == 3
    else:
        assert re.search(expected, error_text(ok, body)), body
    (rid, ok, body), _ = call(sock, [protocol.pack(["ping", 79, {}])])
    assert rid == 79 and ok


@pytest.mark.parametrize("args, outs, expected", [
    ([protocol.encode_handle(1), protocol.encode_handle(50)], 2, None),
    ([protocol.encode_handle(9), protocol.encode_handle(50)], 2, "9"),  # not this client's handle
    ([protocol.encode_handle(1), protocol.encode_handle(0)], 2, "names a tensor"),
    ([protocol.encode_handle(1), 50], 2, "takes \\[handle, memo handle\\]"),
    ([protocol.encode_handle(1)], 2, "takes \\[handle, memo handle\\]"),
    ([protocol.encode_handle(1), protocol.encode_handle(50)], [2], "one output handle"),
])
def test_copy_storage_copies_a_tensors_storage_once_per_memo(sock, args, outs, expected):
    """genie::copy_storage (copy.deepcopy) copies one of the client's own tensors into a copy of
    its storage kept per memo handle; anything else is refused and the daemon carries on."""
    import re

    ops = [op("aten::arange", [12], 0, {"dtype": protocol.encode_dtype(torch.float32)}),
           op("aten::as_strided", [protocol.encode_handle(0), [2, 3], [1, 4], 1], 1),
           op("genie::copy_storage", args, outs)]
    (rid, ok, body), _ = call(sock, [protocol.pack(["exec", 15, {"ops": ops, "fetch": [2]}])])
    if expected is None:
        assert ok, body
        assert body["fetched"][0][1:3] == ["float32", [2, 3]]
        # The same memo: a second view of that storage lands in the same copy of it.
        ops = [op("genie::copy_storage", [protocol.encode_handle(0), protocol.encode_handle(50)], 3),
               op("aten::fill_.Scalar", [protocol.encode_handle(3), 7.0], None)]
        (_, ok, body), frames = call(sock, [protocol.pack(["exec", 16, {"ops": ops, "fetch": [2], "frees": [50]}])])
        assert ok, body
        assert torch.frombuffer(bytearray(frames[0]), dtype=torch.float32).tolist() == [7.0] * 6
    else:
        assert re.search(expected, error_text(ok, body)), body
    (rid, ok, body), _ = call(sock, [protocol.pack(["ping", 80, {}])])
    assert rid == 80 and ok


@pytest.mark.parametrize("args, outs, expected", [
    ([protocol.encode_handle(0)], None, None),
    ([protocol.encode_handle(9)], None, "9"),  # not this client's handle
    ([protocol.encode_handle(0)], 2, "takes \\[handle\\] and no output"),
    ([0], None, "takes \\[handle\\] and no output"),
    ([protocol.encode_handle(0), protocol.encode_handle(0)], None, "takes \\[handle\\] and no output"),
])
def test_record_stream_takes_one_of_the_clients_tensors(sock, args, outs, expected):
    """genie::record_stream (t.record_stream(s)) names one of the client's own tensors and leaves it
    as it was; anything else is refused and the daemon carries on."""
    import re

    ops = [op("aten::arange", [6], 0, {"dtype": protocol.encode_dtype(torch.float32)}),
           op("genie::record_stream", args, outs)]
    fetch = [outs] if type(outs) is int else [0]  # an output it was given is poisoned, and says why
    (rid, ok, body), frames = call(sock, [protocol.pack(["exec", 17, {"ops": ops, "stream": 3, "fetch": fetch}])])
    if expected is None:
        assert ok and "failed" not in body, body
        assert torch.frombuffer(bytearray(frames[0]), dtype=torch.float32).tolist() == [0, 1, 2, 3, 4, 5]
    else:
        # An op without outputs poisons nothing: its failure comes with the request's answer.
        text = body["failed"]["message"] if ok and "failed" in body else error_text(ok, body)
        assert re.search(expected, text), body
    (rid, ok, body), _ = call(sock, [protocol.pack(["ping", 81, {}])])
    assert rid == 81 and ok


@pytest.mark.parametrize("args, expected", [
    ([protocol.encode_handle(0), 8], None),  # 6 floats -> 2: what it held is kept up to there
    ([protocol.encode_handle(9), 8], "9"),  # not this client's handle
    ([protocol.encode_handle(0), -1], "takes \\[handle, 0 <= nbytes"),
    ([protocol.encode_handle(0), 1 << 63], "takes \\[handle, 0 <= nbytes"),
    ([protocol.encode_handle(0), 2.5], "takes \\[handle, 0 <= nbytes"),
    ([protocol.encode_handle(0)], "takes \\[handle, 0 <= nbytes"),
])
def test_resize_storage_takes_a_clients_tensor_and_a_sane_size(sock, args, expected):
    """genie::resize_storage (t.untyped_storage().resize_(n), FSDP2's free and re-allocation)
    resizes one of the client's own storages; anything else is refused and the daemon carries on."""
    import re

    ops = [op("aten::arange", [6], 0, {"dtype": protocol.encode_dtype(torch.float32)}),
           op("genie::resize_storage", args, None),
           op("aten::as_strided", [protocol.encode_handle(0), [2], [1]], 1)]
    (rid, ok, body), frames = call(sock, [protocol.pack(["exec", 18, {"ops": ops, "fetch": [1]}])])
    if expected is None:
        assert ok and "failed" not in body, body
        assert torch.frombuffer(bytearray(frames[0]), dtype=torch.float32).tolist() == [0, 1]
    else:
        text = body["failed"]["message"] if ok and "failed" in body else error_text(ok, body)
        assert re.search(expected, text), body
    (rid, ok, body), _ = call(sock, [protocol.pack(["ping", 82, {}])])
    assert rid == 82 and ok


@pytest.mark.parametrize("settings", ["tf32", [], [True] * 17, ["fast"] + [True] * 16])
def test_malformed_numerics_settings_get_an_error_and_the_daemon_carries_on(sock, settings):
    ops = [op("aten::zeros", [[4]], 1, {"dtype": protocol.encode_dtype(torch.float32)})]
    (rid, ok, body), _ = call(sock, [protocol.pack(["exec", 13, {"ops": ops, "fetch": [1], "num": settings}])])
    assert rid == 13 and "numerics" in error_text(ok, body)
    (rid, ok, body), _ = call(sock, [protocol.pack(["exec", 14, {"ops": ops, "fetch": [1]}])])
    assert rid == 14 and ok and "error" not in str(body["fetched"][0])


@pytest.mark.parametrize("settings, expected", [
    (None, None), (numerics.DEFAULT, None), ("tf32", "numerics"), (numerics.DEFAULT[:-1], "numerics"),
])
def test_a_program_keeps_the_settings_it_was_recorded_under(sock, settings, expected):
    """genie::define_program takes the recording's numerics settings as an optional third
    argument, checked like a batch's; anything malformed is refused and the daemon carries on."""
    batch = [[op("aten::ones", [[2]], 5, {"dtype": protocol.encode_dtype(torch.float32)})], []]
    args = [900 + len(str(settings)), [batch]] + ([] if settings is None else [settings])
    ops = [op("aten::zeros", [[1]], 4, {"dtype": protocol.encode_dtype(torch.float32)}),
           op("genie::define_program", args, None)]
    (rid, ok, body), _ = call(sock, [protocol.pack(["exec", 17, {"ops": ops, "fetch": [4]}])])
    assert rid == 17 and ok, body
    failed = body.get("failed")
    if expected is None:
        assert failed is None, failed
    else:
        assert failed is not None and expected in failed["message"], body
    (rid, ok, body), _ = call(sock, [protocol.pack(["ping", 81, {}])])
    assert rid == 81 and ok


@pytest.mark.parametrize("segment, frames", [([1, 24], False), ([1, 24], True), ("x", False), ([1], False),
                                             ([1.5, 24], False)])
def test_a_deposit_naming_a_shared_segment_without_a_shared_lane_is_refused(sock, segment, frames):
    """A deposit may name [segment, bytes] of the sender's shared memory (peer daemons on one
    host); from a sender with no shared lane here, or malformed, it is refused and the daemon
    carries on."""
    import secrets

    body = {"tid": secrets.token_hex(16), "dtype": "float32", "shape": [2, 3], "segment": segment}
    parts = [protocol.pack(["deposit", 48, body])] + ([torch.arange(6.0).numpy().tobytes()] if frames else [])
    (rid, ok, reply), _ = call(sock, parts)
    assert rid == 48 and not ok and "segment" in reply["message"], reply
    (rid, ok, _), _ = call(sock, [protocol.pack(["ping", 49, {}])])
    assert rid == 49 and ok
