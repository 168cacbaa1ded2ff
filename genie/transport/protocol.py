"""Genie wire protocol, version 1. This docstring is the specification.

A message is a ZeroMQ multipart message: frame 0 is a msgpack header, frames
1..n are raw tensor payloads (see `tensors`). Nothing is pickled.

Client -> daemon header: ``[kind, request_id, body]``

  hello  {}                                   -> {version, devices: [{name, type, total_memory, flops}]}
         (heartbeat?: seconds between the client's pings, 0 for none: a client that promised pings, whose
          direct lane closed and that then stays silent for several of them, is gone and its memory freed)
  hello  {} -> also {bulk: ["tcp", port] | ["unix", path]} when the daemon offers a bulk lane (see `bulk`)
  hello  {} -> also {cuda_ipc: {host, uid, gpus, local_lane?}} when it accepts CUDA IPC handles (see `cuda_ipc`;
            local_lane: true, from a daemon listening beyond this host, which takes them only from
            clients whose lanes came to its local listener from its own user)
  hello  {} -> also {local_lane: {host, uid, path}} when a tcp daemon also takes lanes on an abstract
            Unix socket, for clients and peers on its host as its user (see `bulk.local_lane_address`);
            plain lanes there, under CURVE too (then from the daemon's own uid only, by SO_PEERCRED)
  exec   {dev, stream, ops, frees, fetch, report, bulk_min?, wait?, num?} -> {fetched: [...], report: value | None, time: [t0, t1]}
         (wait: true says the client is blocked on this reply, so an idle daemon may run it at once;
         num: the numerics settings its ops run under, absent for PyTorch's defaults: see `numerics`)
  event  {query: [ids]} | {elapsed: [a, b]}    -> {done: [bool]} | {ms}  (answered without waiting)
  stats  {dev}                                -> {allocated, reserved, peak, handles, clients}
  ping   {}                                   -> {}
  probe  {} + frames                          -> {bytes}  (bandwidth measurement)
  deposit {tid, dtype, shape, strides?} + 1 frame -> {}   (daemon to daemon: a tensor for `genie::recv`;
         with strides, a channels-last or transposed tensor's elements in its own memory order)
  bye    {}                                   -> {}   (frees everything the client holds)

Daemon -> client header: ``[request_id, ok, body]``; when ok is false, body is
``{type, message, op}`` describing the failure.

An op is ``[name, args, kwargs, outs]`` (or with ``strides`` after `outs`, below): `name` is an ATen overload name such
as ``"aten::add.Tensor"``; `args`/`kwargs` are msgpack values in which these
extension types stand for what msgpack cannot say:

  1 HANDLE  int64 little-endian: a tensor resident on the daemon (client-scoped id)
  2 TENSOR  msgpack [frame, dtype, shape]: an inline tensor carried in a frame (or in the
            frames listed, in order, when it is larger than one frame may be)
  3 DTYPE   dtype name (`tensors.DTYPES`)
  4 DEVICE  msgpack [type, index]: "remote" with the daemon's device index, or "cpu"
  5 MEMFMT  memory format name
  6 LAYOUT  layout name
  7 COMPLEX msgpack [real, imag]
  8 BULK    msgpack [transfer id, dtype, shape]: an inline tensor whose bytes travel on the
            client's bulk lane (`bulk`), under that transfer id
  9 CUDA_IPC msgpack [gpu uuid, handle, storage bytes, storage offset, byte offset, ref counter,
            slot, event handle, event sync, dtype, shape]: a CUDA tensor of a process on the
            daemon's host, shared by CUDA IPC (`cuda_ipc`)

`outs` mirrors the op's return value: an int is the handle id under which the
daemon keeps that tensor, null means "do not keep". An op may add a fifth element,
``strides``, shaped as `outs` (a list of ints for a handle, null for none): the
strides the client planned for those outputs, which the daemon gives them where
they differ from its kernel's in dimensions of size 1 only (see `OpCall`). Ops run in order; when one
fails, its outputs and the tensors it writes become poisoned with the error, and
everything computed from them is poisoned in turn. Fetching a poisoned handle
returns that error, naming the op that failed. `fetch` returns each handle as a
C-contiguous descriptor ``[frame, dtype, shape]`` (frame: an index or a list), or, when
the request set `bulk_min` and the tensor has at least that many bytes, ``{bulk: transfer id,
dtype, shape}`` with the bytes sent on the client's bulk lane before the reply. A tensor whose
elements fill one run of memory in another order (channels-last, transposed) is sent as it lies,
its strides added (``[frame, dtype, shape, strides]``, ``{..., strides}``). `report` asks for the last
op's outputs described as values: tensors as ``[handle, dtype, shape, stride,
offset, storage_nbytes]`` (for ops whose output shape depends on data).
"""
from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from . import cuda_ipc, numerics
from .errors import ProtocolError
from .tensors import check_frames, check_shape, parse_dtype

# Clients and daemons of different versions refuse each other at hello with a clear error,
# instead of misreading ops, lanes or replies later. 2: hello carries the client's version.
# 3: WRITING records on shared-memory bulk lanes. 4: an op may carry its outputs' planned strides.
# 5: genie::storage_of names several tensors; a fetched tensor and genie::adopt may carry strides.
# 6: a deposit (daemon to daemon) may carry strides: its bytes are then in that memory order.
# 7: a deposit may name [segment, bytes] of the sender's shared segments (peers on one host).
# 8: hello's local_lane; its cuda_ipc host is a digest of the boot id (and may say local_lane).
VERSION = 8

# The longest ping period a client may state in hello (it then promises no pings: 0).
MAX_HEARTBEAT_S = 3600

# Genie's own ops, which clients queue beside ATen's and daemons run (daemon/executor.py).
ADOPT_OP = "genie::adopt"  # [tensor] or [dense run, shape, strides]: keep an upload as received (`.to(device)`)
DROP_PROGRAM_OP = "genie::drop_program"  # let a recorded program (genie.graph) go: its Graph died
DEFINE_PROGRAM_OP = "genie::define_program"  # [id, [[ops, frees], ...], settings?]: record a program
REPLAY_OP = "genie::replay"  # [id, ...]: run a recorded program
SEED_OP = "genie::manual_seed"
FREE_GENERATORS_OP = "genie::free_generators"  # [ids]: torch.Generators the client dropped
RNG_STATE_OP = "genie::rng_state"  # -> a copy of this client's generator state on the device (CPU uint8)
SET_RNG_STATE_OP = "genie::set_rng_state"  # [state]: this client's generator on the device takes it
PERSIST_OP = "genie::mark_persistent"  # a long-lived tensor (a KV cache), not a temporary
SEND_OP, RECV_OP = "genie::send", "genie::recv"  # a tensor from one daemon to another
EVENT_RECORD_OP, EVENT_WAIT_OP = "genie::event_record", "genie::event_wait"
RECORD_STREAM_OP = "genie::record_stream"  # [handle]: t.record_stream(the request's stream)
RESIZE_STORAGE_OP = "genie::resize_storage"  # [handle, nbytes]: t.untyped_storage().resize_(nbytes)
SHARE_CUDA_OP = "genie::share_cuda"  # a resident GPU tensor for a client on this host, by CUDA IPC
ALIAS_STORAGE_OP = "genie::alias_storage"  # a tensor over one of the client's tensors' storage (torch.load)
STORAGE_OF_OP = "genie::storage_of"  # [handles]: each one's whole storage as uint8, its name, its place (torch.save)
COPY_STORAGE_OP = "genie::copy_storage"  # a tensor in a copy of its storage, one copy per storage per memo (deepcopy)
KV_APPEND_OP, KV_GET_OP, KV_CLOSE_OP = "genie::kv_append", "genie::kv_get", "genie::kv_close"
# The error type of an answer saying the daemon's GPU context was lost and the daemon restarts
# (daemon/device_faults.py): the client takes its link as lost.
DEVICE_LOST_ERROR = "DeviceLost"

EXT_HANDLE, EXT_TENSOR, EXT_DTYPE, EXT_DEVICE, EXT_MEMFMT, EXT_LAYOUT, EXT_COMPLEX, EXT_BULK, EXT_CUDA_IPC, EXT_GENERATOR = (
    range(1, 11))

MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
MEMORY_FORMAT_NAMES = {v: k for k, v in MEMORY_FORMATS.items()}
LAYOUTS = {"strided": torch.strided}
LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}

# Limits on what one message may ask for; named, not literals in the code below.
MAX_HEADER_BYTES = 64 << 20
MAX_OPS_PER_EXEC = 1 << 20
MAX_FRAMES = 1 << 16
MAX_NESTING = 16
MAX_DIMS = 64  # of a tensor's shape or strides (as tensors.check_shape)

_OP_NAME = re.compile(r"^[a-z_][a-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_HANDLE = struct.Struct("<q")

KINDS = ("hello", "exec", "stats", "empty_cache", "reset_peak", "ping", "probe", "deposit", "event", "bye")


# ---------------------------------------------------------------- value markers


class HandleRef:
    """A tensor resident on the daemon, by its client-scoped id (the most common marker: kept cheap)."""

    __slots__ = ("id",)

    def __init__(self, id: int) -> None:  # noqa: A002 - the wire name
        self.id = id

    def __eq__(self, other) -> bool:
        return type(other) is HandleRef and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"HandleRef({self.id})"


@dataclass(frozen=True, slots=True)
class InlineTensor:
    frames: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BulkTensor:
    xfer: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GeneratorRef:
    """A torch.Generator of the client's, by its id; `version` counts its seedings, `seed` is the
    latest. The daemon keeps a twin per id and re-seeds it when the version it holds differs."""
    id: int
    version: int
    seed: int


@dataclass(frozen=True, slots=True)
class DeviceRef:
    type: str  # "remote" (the exec's device) or "cpu"
    index: int


def encode_handle(handle_id: int) -> msgpack.ExtType:
    # tuple.__new__ skips ExtType's argument checks (known-good here): this runs once per captured op.
    return tuple.__new__(msgpack.ExtType, (EXT_HANDLE, _HANDLE.pack(handle_id)))


def encode_inline(frame, dtype_name: str, shape) -> msgpack.ExtType:
    """`frame`: the payload's frame index, or a list of indices for a payload split in chunks."""
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb([frame, dtype_name, list(shape)]))


@functools.lru_cache(maxsize=1024)
def encode_inline_one(frame: int, dtype_name: str, shape: tuple) -> msgpack.ExtType:
    """encode_inline of a one-frame payload, remembered: a step's small uploads repeat (frame,
    dtype, shape) from batch to batch."""
    return encode_inline(frame, dtype_name, shape)


def encode_bulk(xfer: int, dtype_name: str, shape) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_BULK, msgpack.packb([xfer, dtype_name, list(shape)]))


def encode_cuda_ipc(fields: list) -> msgpack.ExtType:
    """A CUDA tensor shared with a daemon on this host (see cuda_ipc.describe)."""
    return msgpack.ExtType(EXT_CUDA_IPC, msgpack.packb(fields, use_bin_type=True))


def encode_generator(uid: int, version: int, seed: int) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_GENERATOR, msgpack.packb([uid, version, seed]))


# The encoders of dtypes, devices, memory formats and layouts are cached: factory calls and
# .to() pass them with every op, and an ExtType (a namedtuple, immutable) costs microseconds to build.
@functools.lru_cache(maxsize=None)
def encode_dtype(dtype: torch.dtype) -> msgpack.ExtType:
    from .tensors import dtype_name

    return msgpack.ExtType(EXT_DTYPE, dtype_name(dtype).encode())


@functools.lru_cache(maxsize=256)
def encode_device(kind: str, index: int = 0) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_DEVICE, msgpack.packb([kind, index]))


@functools.lru_cache(maxsize=None)
def encode_memory_format(fmt: torch.memory_format) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_MEMFMT, MEMORY_FORMAT_NAMES[fmt].encode())


@functools.lru_cache(maxsize=None)
def encode_layout(layout: torch.layout) -> msgpack.ExtType:
    if layout not in LAYOUT_NAMES:
        raise ProtocolError(f"layout {layout} cannot be sent over the wire")
    return msgpack.ExtType(EXT_LAYOUT, LAYOUT_NAMES[layout].encode())


def encode_complex(z: complex) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_COMPLEX, msgpack.packb([z.real, z.imag]))


def decode_ext(code: int, data: bytes, bulk_seen: list | None = None) -> Any:
    """msgpack ext_hook on the receiving side: every payload is checked.

    `bulk_seen` collects the bulk-lane tensors and CUDA IPC tensors met, so a receiver knows
    what a message waits for and what it must import without walking it again.
    """
    if code == EXT_HANDLE:
        if len(data) != 8:
            raise ProtocolError("bad handle payload")
        return HandleRef(int.from_bytes(data, "little", signed=True))
    if code == EXT_TENSOR:
        frame, dtype, shape = _unpack_list(data, 3, "tensor")
        return InlineTensor(tuple(check_frames(frame, MAX_FRAMES)), parse_dtype(dtype), check_shape(shape))
    if code == EXT_BULK:
        xfer, dtype, shape = _unpack_list(data, 3, "bulk tensor")
        if type(xfer) is not int or not 0 < xfer < 1 << 63:
            raise ProtocolError(f"bad bulk transfer id {xfer!r}")
        tensor = BulkTensor(xfer, parse_dtype(dtype), check_shape(shape))
        if bulk_seen is not None:
            bulk_seen.append(tensor)
        return tensor
    if code == EXT_CUDA_IPC:
        try:
            fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:
            raise ProtocolError(f"bad CUDA IPC payload: {e}") from None
        shared = cuda_ipc.parse(fields)
        if bulk_seen is not None:
            bulk_seen.append(shared)
        return shared
    if code == EXT_DTYPE:
        return parse_dtype(_text(data))
    if code == EXT_DEVICE:
        kind, index = _unpack_list(data, 2, "device")
        if kind not in ("remote", "cpu") or type(index) is not int or not 0 <= index < 1 << 16:
            raise ProtocolError(f"bad device {kind!r}:{index!r}")
        return DeviceRef(kind, index)
    if code == EXT_MEMFMT:
        name = _text(data)
        if name not in MEMORY_FORMATS:
            raise ProtocolError(f"unknown memory format {name!r}")
        return MEMORY_FORMATS[name]
    if code == EXT_LAYOUT:
        name = _text(data)
        if name not in LAYOUTS:
            raise ProtocolError(f"unknown layout {name!r}")
        return LAYOUTS[name]
    if code == EXT_GENERATOR:
        uid, version, seed = _unpack_list(data, 3, "generator")
        if not all(type(v) is int and 0 <= v < 1 << 64 for v in (uid, version, seed)):
            raise ProtocolError("bad generator payload")
        return GeneratorRef(uid, version, seed)
    if code == EXT_COMPLEX:
        re_, im = _unpack_list(data, 2, "complex")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (re_, im)):
            raise ProtocolError("bad complex payload")
        return complex(re_, im)
    raise ProtocolError(f"unknown extension type {code}")


def _text(data: bytes) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("non-ascii name") from None


def _unpack_list(data: bytes, n: int, what: str) -> list:
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"bad {what} payload: {e}") from None
    if not isinstance(value, list) or len(value) != n:
        raise ProtocolError(f"bad {what} payload")
    return value


# ---------------------------------------------------------------- headers


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack_header(frame, bulk_seen: list | None = None) -> Any:
    """Decode a received header frame, turning extension types into markers (see `decode_ext`)."""
    data = bytes(frame) if not isinstance(frame, bytes) else frame
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    hook = decode_ext if bulk_seen is None else (lambda code, payload: decode_ext(code, payload, bulk_seen))
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=hook, use_list=True,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several types for garbage
        raise ProtocolError(f"undecodable header: {type(e).__name__}: {e}") from None


@dataclass(frozen=True, slots=True)
class Request:
    kind: str
    request_id: int
    body: dict


def parse_request(header: Any) -> Request:
    if not isinstance(header, list) or len(header) != 3:
        raise ProtocolError("request header must be [kind, request_id, body]")
    kind, request_id, body = header
    if kind not in KINDS:
        raise ProtocolError(f"unknown request kind {kind!r}")
    if type(request_id) is not int or not 0 <= request_id < 1 << 63:
        raise ProtocolError(f"bad request id {request_id!r}")
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a map")
    return Request(kind, request_id, body)


def request_id_of(header: Any) -> int:
    """Best-effort request id of a message that failed validation, so the error reply can be matched."""
    if isinstance(header, list) and len(header) >= 2 and type(header[1]) is int and 0 <= header[1] < 1 << 63:
        return header[1]
    return 0


@dataclass(slots=True)  # not frozen: built once per op of every request, and frozen init is slow
class OpCall:
    name: str
    args: list
    kwargs: dict
    outs: Any
    # The strides the client planned for outputs of 4-D and 5-D shapes with a dimension of size 1
    # (the structure of `outs`: a list of ints per tensor, None where there is none): a size-1
    # dimension's stride moves no element, so PyTorch's meta kernels (which the client plans
    # with) and its CPU and CUDA kernels may each choose their own, but suggest_memory_format()
    # reads it. The daemon gives its outputs the client's, so that a composite op the client
    # decomposed (group_norm: channels-last or not) and the kernel it calls on the daemon agree.
    strides: Any = None


@dataclass(slots=True)  # not frozen (see OpCall): built for every request
class Exec:
    device: int
    ops: list[OpCall]
    frees: list[int]
    fetch: list[int]
    report: bool
    stream: int = 0
    bulk_min: int = 0  # fetch tensors of at least this many bytes over the bulk lane; 0: never
    waited: bool = False  # the client blocks on the reply
    shared: tuple = ()  # the CUDA IPC tensors in its arguments (set by the receiver, see decode_ext)
    # (transfer id, segment, bytes) of uploads named here instead of on the bulk lane: in the
    # client's shared segments, still being copied in (see bulk.Lane.send's `records`).
    segments: tuple = ()
    numerics: list | None = None  # the client's numerics settings (see numerics); None: PyTorch's defaults


_GOOD_NAMES: set[str] = set()  # op names already seen to be well formed (bounded below)


def _check_op_name(name: Any) -> None:
    if not isinstance(name, str) or not _OP_NAME.match(name):
        raise ProtocolError(f"bad op name {name!r}")
    if len(_GOOD_NAMES) < 65536:
        _GOOD_NAMES.add(name)


def _handle_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a list of handle ids")
    for h in value:
        if type(h) is not int:
            raise ProtocolError(f"{what} must be a list of handle ids")
    return value


def _check_strides(strides: Any, outs: Any, depth: int = 0) -> None:
    """OpCall.strides: shaped as `outs`, a list of non-negative ints (at most MAX_DIMS) for a handle."""
    if strides is None:
        return
    if type(outs) is int:
        if (type(strides) is list and len(strides) <= MAX_DIMS
                and all(type(s) is int and 0 <= s < 1 << 62 for s in strides)):
            return
    elif type(outs) is list and type(strides) is list and len(strides) == len(outs) and depth < MAX_NESTING:
        for s, o in zip(strides, outs):
            _check_strides(s, o, depth + 1)
        return
    raise ProtocolError(f"bad output strides {strides!r} for outs {outs!r}")


def found_in(value, kind: type):
    """Each `kind` in `value`: itself, or those in nested lists."""
    if isinstance(value, kind):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from found_in(v, kind)


def handles_in(outs):
    """The handles an op call's `outs` names (an int, or nested lists of them): the client's
    recordings and the daemon's executor both read them."""
    return found_in(outs, int)


def _check_outs(outs: Any, depth: int = 0) -> None:
    if outs is None or type(outs) is int:
        return
    if isinstance(outs, list) and depth < MAX_NESTING:
        for o in outs:
            _check_outs(o, depth + 1)
        return
    raise ProtocolError(f"bad outs {outs!r}")


def parse_exec(body: dict) -> Exec:
    device = body.get("dev", 0)
    if type(device) is not int or device < 0:
        raise ProtocolError(f"bad device index {device!r}")
    ops_raw = body.get("ops", [])
    if not isinstance(ops_raw, list) or len(ops_raw) > MAX_OPS_PER_EXEC:
        raise ProtocolError("ops must be a list")
    ops = []
    for entry in ops_raw:
        if type(entry) is not list or not 4 <= len(entry) <= 5:
            raise ProtocolError("an op must be [name, args, kwargs, outs] or [name, args, kwargs, outs, strides]")
        name, args, kwargs, outs = entry[:4]
        if name not in _GOOD_NAMES:
            _check_op_name(name)
        if type(args) is not list or type(kwargs) is not dict:
            raise ProtocolError(f"{name}: args must be a list and kwargs a map")
        if kwargs and not all(type(k) is str for k in kwargs):
            raise ProtocolError(f"{name}: kwarg names must be strings")
        if outs is not None and type(outs) is not int:
            _check_outs(outs)
        if len(entry) == 5:
            _check_strides(entry[4], outs)
            ops.append(OpCall(name, args, kwargs, outs, entry[4]))
        else:
            ops.append(OpCall(name, args, kwargs, outs))
    report = body.get("report", False)
    if type(report) is not bool:
        raise ProtocolError("report must be a bool")
    stream = body.get("stream", 0)
    if type(stream) is not int or not 0 <= stream < 1 << 31:
        raise ProtocolError(f"bad stream id {stream!r}")
    bulk_min = body.get("bulk_min", 0)
    if type(bulk_min) is not int or not 0 <= bulk_min < 1 << 62:
        raise ProtocolError(f"bad bulk_min {bulk_min!r}")
    waited = body.get("wait", False)
    if type(waited) is not bool:
        raise ProtocolError("wait must be a bool")
    segments = body.get("segments", ())
    if segments:
        if type(segments) is not list or len(segments) > MAX_FRAMES or not all(
                type(r) is list and len(r) == 3 and all(type(v) is int and 0 <= v < 1 << 63 for v in r)
                for r in segments):
            raise ProtocolError("segments must be a list of [transfer id, segment, bytes]")
        segments = tuple(tuple(r) for r in segments)
    settings = body.get("num")
    return Exec(
        numerics=None if settings is None else numerics.parse(settings),
        segments=segments,
        waited=waited,
        bulk_min=bulk_min,
        stream=stream,
        device=device,
        ops=ops,
        frees=_handle_list(body.get("frees", []), "frees"),
        fetch=_handle_list(body.get("fetch", []), "fetch"),
        report=report,
    )


def error_body(exc: BaseException, op: str | None = None) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "op": op}
