"""Tensors <-> raw frames without copies.

A tensor travels as a descriptor in the msgpack header, `[frame, dtype, shape]`,
plus one raw frame holding its bytes in C-contiguous order. Sending exposes
the tensor's own memory as a buffer (no `tobytes`); receiving wraps the frame's
buffer with `torch.frombuffer`, which keeps the frame alive as long as the
tensor lives.
"""
from __future__ import annotations

import warnings

import torch

from .errors import ProtocolError

# Every dtype that may cross the wire, by its stable name. Anything else is refused.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
        # Low-precision formats (the "fnuz" variants; MX scales and packed FP4 of the MX formats):
        # only bytes on the wire; which ops they have is up to the daemon's torch, as on CUDA.
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Payloads larger than this travel as several frames (ZeroMQ cannot carry a message
# part of 2 GiB or more). Settable: the daemon's --max-frame-mb, the client's GENIE_FRAME_MB.
MAX_FRAME_BYTES = 1 << 30

# A CPU tensor a daemon computes on starts at a multiple of this many bytes. The CPU's kernels
# round by alignment: on an AVX-512 machine a float32 matmul, linear or grouped_mm whose input
# starts at 4-12 mod 16 differs in the last bit from the same at 0, 16, 32 or 48 (float64: at 8),
# and ZeroMQ puts message data at 8-56 mod 64. So a daemon computing on a frame as it lay gave
# results unequal to the client's own CPU. malloc and torch's allocator give 16 or more.
COMPUTE_ALIGNMENT = 16


def aligned_for_compute(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its data starts at a multiple of COMPUTE_ALIGNMENT, else a copy (64-aligned,
    same strides) that CPU kernels round on as on any tensor of the user's own."""
    return t if t.data_ptr() % COMPUTE_ALIGNMENT == 0 else t.clone()


def required_alignment(dtype: torch.dtype) -> int:
    """Alignment a received payload needs to be used in place: natural, and 16 for complex types."""
    return 16 if dtype.is_complex else dtype.itemsize


_QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, n))


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        hint = (": quantized tensors are not supported on remote_accelerator (quantize and run quantized "
                "models on the CPU)" if dtype in _QUANTIZED else "")
        raise ProtocolError(f"dtype {dtype} cannot be sent over the wire{hint}") from None


def parse_dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}")
    return DTYPES[name]


def is_dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements are one plain run in memory, sendable as raw bytes without a copy."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when `is_dense`, else such a copy (conj and neg bits resolved)."""
    if not is_dense(t):
        t = t.resolve_conj().resolve_neg().contiguous()
    return t


def fills_one_run(shape, strides) -> bool:
    """Whether a tensor of `shape` and `strides` has its elements in one run of memory, each
    once, in whatever order (non-overlapping and dense): row-major, channels-last, transposed."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(shape, strides) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def travels_as_it_lies(t: torch.Tensor) -> bool:
    """Whether `t` is sent in its own memory order with its strides (see `dense_span`): not
    row-major, and its elements fill one run of memory; not a conjugate or negative view."""
    return not (t.is_contiguous() or t.is_conj() or t.is_neg() or t.numel() == 0) and fills_one_run(t.shape, t.stride())


def dense_span(t: torch.Tensor) -> torch.Tensor | None:
    """For a tensor that is not row-major but whose elements fill one run of memory in another
    order (channels-last, transposed, permuted: non-overlapping and dense), that run as a 1-D
    contiguous view, whose bytes with `t`'s strides give `t` (sent as they lie instead of
    permuted into row-major order); None for any other tensor."""
    return t.as_strided((t.numel(),), (1,)) if travels_as_it_lies(t) else None


def laid_out(values: torch.Tensor, strides) -> torch.Tensor:
    """A received tensor (viewed row-major over its bytes) with the strides it was sent with, when
    its bytes are the run of a channels-last or transposed tensor as it lay (`dense_span`); the
    strides are checked first, as every received field is. `values` as it is without strides."""
    if strides is None:
        return values
    return values.as_strided(values.shape, check_strides(strides, tuple(values.shape)))


def check_strides(strides: object, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides received for a tensor of `shape` whose bytes are a dense run: one per dimension,
    non-negative, and reaching no element past the run (checked, as every received field is)."""
    numel = 1
    for n in shape:
        numel *= n
    if (not isinstance(strides, (list, tuple)) or len(strides) != len(shape)
            or any(type(st) is not int or st < 0 for st in strides)
            or elements_spanned(0, shape, strides) > numel):
        raise ProtocolError(f"bad strides {strides!r} for shape {list(shape)}")
    return tuple(strides)


def dense_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as a flat uint8 tensor on its device (a view when `t` is dense)."""
    return dense(t).reshape(-1).view(torch.uint8)


# dtypes whose CPU tensors `.numpy()` takes as they are (no bfloat16, float8, complex32).
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.complex64, torch.complex128,
                           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})


def tensor_to_buffer(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview over `t`'s memory (made contiguous on the CPU if it is not)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = dense(t)
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype in _NUMPY_DTYPES:
        # The array keeps `t` alive. Every request and answer carrying a tensor comes through
        # here: 1.7 us against 5.7 for the general way below.
        return memoryview(t.numpy()).cast("B")
    # A contiguous tensor's elements are one dense run starting at its offset.
    flat = t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)
    # numpy gives a buffer-protocol object that keeps `flat` (and so `t`) alive.
    return memoryview(flat.numpy())


def tensor_to_frames(t: torch.Tensor) -> list[memoryview]:
    """The tensor's bytes as one frame, or as several of at most MAX_FRAME_BYTES each."""
    buf = tensor_to_buffer(t)
    n = buf.nbytes
    if n <= MAX_FRAME_BYTES:
        return [buf]
    return [buf[i:i + MAX_FRAME_BYTES] for i in range(0, n, MAX_FRAME_BYTES)]


def frames_to_tensor(bufs: list, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of tensor_to_frames: no copy for one frame; one copy to join several."""
    if len(bufs) == 1:
        return buffer_to_tensor(bufs[0], dtype, shape)
    views = [memoryview(b).cast("B") for b in bufs]
    total = sum(v.nbytes for v in views)
    joined = torch.empty(total, dtype=torch.uint8)
    offset = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for v in views:
            if v.nbytes:
                joined[offset:offset + v.nbytes].copy_(torch.frombuffer(v, dtype=torch.uint8))
            offset += v.nbytes
    return buffer_to_tensor(memoryview(joined.numpy()), dtype, shape)


def check_frames(frame, limit: int) -> list[int]:
    """A descriptor's frame reference: one index or a list of them."""
    frames = frame if isinstance(frame, list) else [frame]
    if not frames or len(frames) > limit or not all(type(f) is int and 0 <= f < limit for f in frames):
        raise ProtocolError(f"bad frame reference {frame!r}")
    return frames


def as_marked_view(t: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """`t` as the conjugate and/or negative view these bits mark. Such a view's storage holds its
    values unconjugated and unnegated, with the bits on the tensor: a copy or a saved CPU copy of
    that storage becomes the same view of it again this way."""
    if conj:
        t = torch._conj(t)
    if neg:
        t = torch._neg_view(t)
    return t


def elements_spanned(offset: int, sizes, strides) -> int:
    """Elements of storage, from its start, that a view with these offset, sizes and strides
    reaches (non-negative strides); 0 for a view with no elements."""
    if 0 in sizes:
        return 0
    return offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides))


def check_shape(shape: object) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) > 64:
        raise ProtocolError(f"bad shape {shape!r}")
    for s in shape:
        if type(s) is not int or s < 0 or s > (1 << 40):
            raise ProtocolError(f"bad shape {shape!r}")
    return tuple(shape)


def bytes_as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """A received uint8 tensor (page-aligned: a recycled host block) viewed as `dtype` and `shape`,
    after checking its length against them."""
    numel = 1
    for s in shape:
        numel *= s
    if raw.nbytes != numel * dtype.itemsize:
        raise ProtocolError(f"{what} holds {raw.nbytes} bytes, header says {numel * dtype.itemsize} "
                            f"({dtype}, {list(shape)})")
    return raw.view(dtype).view(shape) if numel else torch.empty(shape, dtype=dtype)


def buffer_to_tensor(buf, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Wrap a received frame as a tensor, without copying, after checking its length."""
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * dtype.itemsize
    length = memoryview(buf).nbytes
    if length != expected:
        raise ProtocolError(f"frame holds {length} bytes, header says {expected} ({dtype}, {list(shape)})")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # ZeroMQ frames are read-only buffers; the tensor owns this frame alone.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    if raw.data_ptr() % required_alignment(dtype):
        # ZeroMQ does not align message data (small messages even live inside its message
        # struct); kernels may assume natural alignment and fault (complex128 did). Copy then.
        raw = raw.clone()
    return raw.view(dtype).view(shape)

