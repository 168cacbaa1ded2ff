"""The wire codec without sockets: extension values, request validation, tensor frames."""
import msgpack
import numpy as np
import pytest
import torch

from genie.transport import protocol
from genie.transport.errors import ProtocolError
from genie.transport import tensors
from genie.transport.tensors import COMPUTE_ALIGNMENT, aligned_for_compute, buffer_to_tensor, tensor_to_buffer


def roundtrip(value):
    return protocol.unpack_header(protocol.pack(value))


def test_extension_values_roundtrip():
    values = [
        protocol.encode_handle(42), protocol.encode_dtype(torch.bfloat16), protocol.encode_device("remote", 0),
        protocol.encode_memory_format(torch.channels_last), protocol.encode_layout(torch.strided),
        protocol.encode_complex(1 + 2j), protocol.encode_inline(3, "int64", [2, 5]),
        protocol.encode_generator(7, 2, (1 << 64) - 1),
    ]
    out = roundtrip(values)
    assert out[0] == protocol.HandleRef(42)
    assert out[1] is torch.bfloat16
    assert out[2] == protocol.DeviceRef("remote", 0)
    assert out[3] is torch.channels_last and out[4] is torch.strided
    assert out[5] == 1 + 2j
    assert out[6] == protocol.InlineTensor((3,), torch.int64, (2, 5))
    assert out[7] == protocol.GeneratorRef(7, 2, (1 << 64) - 1)


@pytest.mark.parametrize("ext", [
    msgpack.ExtType(protocol.EXT_HANDLE, b"\x01"),
    msgpack.ExtType(protocol.EXT_DTYPE, b"float128"),
    msgpack.ExtType(protocol.EXT_DEVICE, msgpack.packb(["cuda", 0])),
    msgpack.ExtType(protocol.EXT_TENSOR, msgpack.packb([0, "float32", [-1]])),
    msgpack.ExtType(protocol.EXT_TENSOR, msgpack.packb([0, "float32"])),
    msgpack.ExtType(protocol.EXT_MEMFMT, b"sideways"),
    msgpack.ExtType(protocol.EXT_COMPLEX, msgpack.packb(["a", 1])),
    msgpack.ExtType(protocol.EXT_GENERATOR, msgpack.packb([1, 2])),
    msgpack.ExtType(protocol.EXT_GENERATOR, msgpack.packb([1, -2, 3])),
    msgpack.ExtType(protocol.EXT_GENERATOR, msgpack.packb([1, 2, 3.5])),
    msgpack.ExtType(protocol.EXT_GENERATOR, msgpack.packb([1, True, 3])),
    msgpack.ExtType(99, b""),
])
def test_bad_extension_values_are_refused(ext):
    with pytest.raises(ProtocolError):
        roundtrip([ext])


def test_garbage_headers_are_protocol_errors():
    for junk in (b"", b"\xc1", b"\x92\x01", bytes(range(256))):
        with pytest.raises(ProtocolError):
            protocol.parse_request(protocol.unpack_header(junk))


@pytest.mark.parametrize("body, message", [
    ({"dev": -1}, "device"),
    ({"ops": {}}, "ops must be a list"),
    ({"ops": [["aten::add", [], {}]]}, "an op must be"),
    ({"ops": [["import os", [], {}, None]]}, "bad op name"),
    ({"ops": [["aten::add", {}, {}, None]]}, "args must be a list"),
    ({"ops": [["aten::add", [], {}, "x"]]}, "bad outs"),
    ({"frees": [1, "2"]}, "handle ids"),
    ({"report": 1}, "report must be a bool"),
    ({"segments": {1: 2}}, "segments must be"),
    ({"segments": [[1, 2]]}, "segments must be"),
    ({"segments": [[1, 2, -3]]}, "segments must be"),
    ({"segments": [[1, 2, "3"]]}, "segments must be"),
    ({"ops": [["aten::add", [], {}, None, None, None]]}, "an op must be"),
    ({"ops": [["aten::add", [], {}, 5, [1, -2]]]}, "bad output strides"),
    ({"ops": [["aten::add", [], {}, 5, [1, 1 << 62]]]}, "bad output strides"),
    ({"ops": [["aten::add", [], {}, 5, [1, 2.0]]]}, "bad output strides"),
    ({"ops": [["aten::add", [], {}, 5, [1] * 65]]}, "bad output strides"),
    ({"ops": [["aten::add", [], {}, [5, 6], [[1]]]]}, "bad output strides"),
    ({"ops": [["aten::add", [], {}, [5, None], [None, [1]]]]}, "bad output strides"),
])
def test_exec_validation(body, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.parse_exec(body)


def test_exec_carries_planned_output_strides():
    ops = protocol.parse_exec({"ops": [["aten::add", [], {}, 5, [2048, 1, 256, 32]],
                                       ["aten::var_mean", [], {}, [6, 7], [None, [8, 1, 1, 1]]],
                                       ["aten::mul", [], {}, 8]]}).ops
    assert [op.strides for op in ops] == [[2048, 1, 256, 32], [None, [8, 1, 1, 1]], None]


def test_exec_names_uploads_in_segments():
    assert protocol.parse_exec({"segments": [[7, 2, 4096]]}).segments == ((7, 2, 4096),)
    assert protocol.parse_exec({}).segments == ()


def test_parse_request_checks_kind_and_id():
    assert protocol.parse_request(["ping", 3, {}]).kind == "ping"
    with pytest.raises(ProtocolError):
        protocol.parse_request(["ping", -3, {}])
    with pytest.raises(ProtocolError):
        protocol.parse_request(["eval", 3, {}])


def test_tensor_frames_are_views_not_copies():
    t = torch.arange(1024, dtype=torch.float32)
    buf = tensor_to_buffer(t)
    assert np.frombuffer(buf, dtype=np.uint8).ctypes.data == t.data_ptr()  # send side: no copy
    frame = bytearray(4096 + 64)
    start = (-np.frombuffer(frame, dtype=np.uint8).ctypes.data) % 64  # an aligned place in the buffer
    view = memoryview(frame)[start:start + 4096]
    view[:] = buf
    r = buffer_to_tensor(view, torch.float32, (32, 32))
    assert r.data_ptr() == np.frombuffer(view, dtype=np.uint8).ctypes.data  # receive side: no copy
    assert torch.equal(r.reshape(-1), t)


def test_a_frame_off_the_compute_alignment_is_copied_before_cpu_kernels_read_it():
    # ZeroMQ puts message data at 8 mod 16: wrapped in place as received, copied for the daemon's kernels.
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    frame = bytearray(256 + 64)
    start = (-np.frombuffer(frame, dtype=np.uint8).ctypes.data) % 64 + 8
    view = memoryview(frame)[start:start + 256]
    view[:] = tensor_to_buffer(t)
    at = np.frombuffer(view, dtype=np.uint8).ctypes.data
    received = buffer_to_tensor(view, torch.float32, (8, 8))
    assert received.data_ptr() == at  # in place: float32 needs only 4
    computed = aligned_for_compute(received.t())
    assert computed.data_ptr() != at and computed.data_ptr() % COMPUTE_ALIGNMENT == 0
    assert torch.equal(computed, t.t()) and computed.stride() == (1, 8)
    aligned = torch.randn(4)
    assert aligned_for_compute(aligned) is aligned


def test_tensor_frame_checks_length_and_handles_odd_layouts():
    with pytest.raises(ProtocolError, match="frame holds"):
        buffer_to_tensor(b"\x00" * 7, torch.float32, (2,))
    x = torch.arange(12.0).reshape(3, 4).t()[1:]  # non-contiguous with an offset
    back = buffer_to_tensor(bytes(tensor_to_buffer(x)), torch.float32, tuple(x.shape))
    assert torch.equal(back, x)
    single = torch.ones(1, 1).expand(1, 1)
    assert bytes(tensor_to_buffer(single)) == b"\x00\x00\x80\x3f"
    assert buffer_to_tensor(b"", torch.float32, (0, 3)).shape == (0, 3)


@pytest.mark.parametrize("name", sorted(tensors.DTYPES))
def test_tensor_buffers_of_every_wire_dtype(name):
    """The bytes sent for a tensor are its memory, for every dtype the wire carries, in any shape
    (0-d, empty, a view at an offset), as one flat run of bytes."""
    dtype = tensors.DTYPES[name]
    if dtype.itemsize == 1 and name.startswith("float4"):  # packed: no conversion kernels, bytes only
        base = torch.arange(40, dtype=torch.uint8).view(dtype)
    else:
        base = torch.arange(40, dtype=torch.float64).to(dtype)
    for t in (base[3:23].reshape(4, 5), base[7], base[:0].reshape(0, 3)):
        buf = tensor_to_buffer(t)
        assert buf.format == "B" and buf.ndim == 1 and buf.nbytes == t.numel() * t.element_size()
        if t.numel():
            assert np.frombuffer(buf, dtype=np.uint8).ctypes.data == t.data_ptr()
            raw = t.reshape(-1).view(torch.uint8)
            assert bytes(buf) == bytes(raw.numpy())
        back = buffer_to_tensor(bytes(buf), dtype, tuple(t.shape))
        assert back.shape == t.shape and bytes(tensor_to_buffer(back)) == bytes(buf)


def test_large_payloads_split_into_frames_and_join(monkeypatch):
    from genie.transport import tensors

    monkeypatch.setattr(tensors, "MAX_FRAME_BYTES", 1000)
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)  # 4000 bytes: four frames
    frames = tensors.tensor_to_frames(t)
    assert [f.nbytes for f in frames] == [1000] * 4
    back = tensors.frames_to_tensor([bytes(f) for f in frames], torch.float32, (10, 100))
    assert torch.equal(back, t)
    ext = protocol.encode_inline([0, 1, 2, 3], "float32", [10, 100])
    assert roundtrip([ext])[0].frames == (0, 1, 2, 3)


def test_quantized_dtypes_are_refused_saying_why():
    with pytest.raises(ProtocolError, match="quantized tensors are not supported on remote_accelerator"):
        tensors.dtype_name(torch.qint8)
    assert tensors.dtype_name(torch.float32)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    lambda: torch.randn(3, 4).t(),
    lambda: torch.randn(5, 3, 4)[1:].permute(2, 0, 1),  # at a storage offset
    lambda: torch.randn(3, 1, 4).transpose(0, 2),  # a size-1 dimension's stride is free
], ids=["channels-last", "transposed", "permuted view", "size-1"])
def test_a_dense_run_in_another_order_is_sent_as_it_lies(make):
    t = make()
    span = tensors.dense_span(t)
    assert span is not None and span.is_contiguous() and span.shape == (t.numel(),)
    assert span.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view, not a copy
    assert torch.equal(span.clone().as_strided(t.shape, tensors.check_strides(list(t.stride()), tuple(t.shape))), t)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4), lambda: torch.randn(4, 6)[:, ::2], lambda: torch.randn(4, 1).expand(4, 3),
    lambda: torch.randn(3, 4, dtype=torch.complex64).t().conj(), lambda: torch.empty(0, 3).t(),
], ids=["row-major", "gaps", "expanded", "conjugate", "empty"])
def test_other_tensors_have_no_dense_run_to_send(make):
    assert tensors.dense_span(make()) is None


@pytest.mark.parametrize("strides", [[1], [1, 5], [1, -4], [1.0, 4], "14", None])
def test_received_strides_must_fit_the_bytes_sent(strides):
    with pytest.raises(ProtocolError, match="bad strides"):
        tensors.check_strides(strides, (4, 3))
