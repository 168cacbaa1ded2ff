"""Ops that move values across devices or point tensors at storages, captured apart from the rest.

- `.to()` / `_to_copy`: a cast on the device (its own plan key, without the general walk),
  remote to remote (daemon to daemon, never through this process), remote to the CPU (a fetch,
  or a value read ahead with its module: `read_ahead`) or to local CUDA (by CUDA IPC from a
  daemon on this host, else through the CPU).
- `copy_`: host to device as an upload the daemon may adopt, device to host as a fetch.
- `set_` on a storage or a tensor: torch.load's rebuild of checkpoint tensors onto the device
  (`serialization`), and views of a remote tensor's own storage.
- The storages behind torch.save (`storages_of`) and copy.deepcopy (`copy_in_storage_copy`).

Their handlers are entered in capture's table of special ops when this module loads (capture
imports it last; it imports capture's core).
"""
from __future__ import annotations

import torch

from genie.errors import UnsupportedOperationError
from genie.runtime import get_runtime
from genie.runtime.device_type import DEVICE_TYPE
from genie.runtime.stream import HandleRef
from genie.transport import cuda_ipc, protocol
from genie.transport.tensors import dense_span, fills_one_run, travels_as_it_lies

from . import meta, read_ahead
from .capture import (SPECIAL, _borrowing, _NewTensor, _apply_mutations, _capture_general, _from_report, _planned, _plans_get,
                      capture, contiguous_strides, encode_call, meta_cache, op_name)
from .lazy_tensor import LazyTensor, StorageIdentity, storage_identity



_CAST = object()  # first element of _cast's plan keys, apart from every other key's


def _cast(func, src: LazyTensor, dtype: torch.dtype):
    """`_to_copy(src, dtype=...)` (.to(dtype), .float(), .half(), .bfloat16(): several per layer of a
    half-precision model, around its norms and softmax) without the general walk of its keyword
    argument: 35 -> 19 us per cast here. Planned as the general path plans it, kept under a key of
    its own."""
    ref = src._genie
    stream = ref.stream
    key = (_CAST, ref.meta_key, dtype)
    plan = _plans_get(key)
    if plan is None:
        plan = meta.plan_op(func, (src,), {"dtype": dtype}, [src], [ref.storage_nbytes])
        meta_cache.put(key, plan)
    else:
        meta_cache.hits += 1
    if type(plan.outputs) is not _NewTensor or plan.mutations:
        return _capture_general(func, (src,), {"dtype": dtype})
    with stream.lock:
        outs = next(stream.link.handle_ids)
        outputs = _planned(stream, outs, plan.outputs)
        stream.append([op_name(func), [ref.wire], {"dtype": protocol.encode_dtype(dtype)}, outs])
    return outputs


def _same_as_source(name: str, value, src) -> bool:
    """A `_to_copy` keyword that asks for nothing `src` (a fetched CPU tensor, or a copy moved
    between daemons) does not already have."""
    if value is None or name == "non_blocking":
        return True
    if name == "dtype":
        return value == src.dtype
    if name == "layout":
        return value == torch.strided
    if name == "memory_format":
        return value in (torch.preserve_format, torch.contiguous_format) and src.is_contiguous()
    if name == "pin_memory":
        return value is False
    return False


def _to_copy(func, args, kwargs):
    src = args[0]
    target = kwargs.get("device")
    if target is None or (target.type == DEVICE_TYPE and (target.index is None or target.index == src.device.index)):
        if len(kwargs) == 1 and "dtype" in kwargs and len(args) == 1 and type(src) is LazyTensor:
            return _cast(func, src, kwargs["dtype"])
        return capture(func, args, kwargs)
    if target.type == DEVICE_TYPE:
        # Remote to remote: directly between daemons, never through this process. The moved copy
        # is new, dense and row-major: `.to()`'s own keywords (dtype, layout, memory_format it
        # already has) ask for no second copy on the receiver (64 MiB between two daemons here:
        # ~50 -> ~17 ms, most of it that copy into fresh memory).
        moved = move_between_devices(src, get_runtime().stream(target.index))
        rest = {k: v for k, v in kwargs.items() if k != "device" and not _same_as_source(k, v, moved)}
        return capture(func, (moved,), rest) if rest else moved
    from .materialize import to_cpu

    rest = {k: v for k, v in kwargs.items() if k != "device" and not _same_as_source(k, v, src)}
    if target.type == "cuda":
        local = _fetch_by_cuda_ipc(src, target)
        if local is not None:
            return torch.ops.aten._to_copy.default(local, **rest) if rest else local
    cpu = read_ahead.take(src)  # fetched with its module's other tensors (model.cpu())
    if cpu is None:
        narrowed = _narrowed_there(src, rest.get("dtype"))
        if narrowed is not None:
            src, cpu = narrowed, to_cpu(narrowed)
            rest.pop("dtype")
        else:
            cpu = to_cpu(src)  # already a fresh tensor: no second copy unless something changes
    if rest.get("memory_format", torch.preserve_format) is torch.preserve_format and not src.is_contiguous():
        cpu = _in_layout_of(src, cpu)
        rest.pop("memory_format", None)
    local = torch.ops.aten._to_copy.default(cpu, **rest) if rest else cpu
    if target.type == "cpu":
        return local
    return torch.ops.aten._to_copy.default(local, device=target)


def _narrowed_there(src: LazyTensor, dtype: torch.dtype | None) -> LazyTensor | None:
    """`x.to("cpu", torch.float16)` of a float32 remote tensor: cast on the daemon (queued with the
    read), so the wire carries the smaller elements. Only between floating types (or complex ones),
    whose narrowing rounds to nearest even on every device, as PyTorch's CUDA copy converts on the
    CPU: the values are the same. A cast to an integer type, or one that widens, happens here."""
    if dtype is None or dtype == src.dtype or dtype.itemsize >= src.dtype.itemsize:
        return None
    if not (src.dtype.is_floating_point and dtype.is_floating_point or src.is_complex() and dtype.is_complex):
        return None
    return src.to(dtype)


def _in_layout_of(src: LazyTensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (a fetch: row-major) laid out as PyTorch's `.cpu()` / `.to()` lays out a copy of
    `src` (memory_format=torch.preserve_format, the default): a channels-last or transposed tensor
    keeps its strides, one with gaps or overlaps gets dense strides in the same order. It came
    back row-major: `y.cpu().is_contiguous(memory_format=torch.channels_last)` was False for a
    channels-last `y`, where CUDA keeps it True. A CPU daemon sends channels-last and transposed
    tensors as they lie, with their strides; others (a GPU daemon's, strided views) cost one copy
    here."""
    planned = torch.empty_like(torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta"))
    if values.stride() == planned.stride():  # a daemon sends a dense run as it lies: already so
        return values
    return torch.empty_like(planned, device="cpu").copy_(values)


SHARE_CUDA_OP = protocol.SHARE_CUDA_OP


def _fetch_by_cuda_ipc(src: LazyTensor, target: torch.device) -> torch.Tensor | None:
    """`.to("cuda")` from a daemon on this host: the daemon shares a snapshot of the tensor by CUDA
    IPC and this process copies it on its GPU (no host memory, no bytes on the wire). None where
    that path is not open (another host, a CPU daemon, GENIE_CUDA_IPC=0): fetch bytes instead."""
    stream = src._genie.stream
    device = torch.device("cuda", target.index if target.index is not None else torch.cuda.current_device())
    if not stream.link.cuda_ipc_for(device):
        return None
    # Replies are decoded with protocol.decode_ext: a descriptor arrives checked and parsed.
    shared = stream.run_reported([SHARE_CUDA_OP, [protocol.encode_handle(src._genie.id)], {}, None])
    if type(shared) is not cuda_ipc.SharedCudaTensor:
        return None  # the daemon could not share it (e.g. it lives on its CPU)
    # Waits for the copy (a blocking read anyway), so the daemon's snapshot is freed at once.
    # The daemon is trusted like its results are: its counter file may belong to another user.
    return cuda_ipc.client_importer().copy_in(shared, device, wait=True, check_owner=False)


STORAGE_OF_OP = protocol.STORAGE_OF_OP


def storages_of(tensors: list[LazyTensor]) -> list[tuple[LazyTensor, tuple, int, tuple[int, ...], tuple[bool, bool]]]:
    """For each of `tensors` (all on one device): its whole storage on its daemon as a 1-D uint8
    remote tensor, with that storage's identity (equal for every tensor sharing it), the tensor's
    place in it (storage offset and strides in elements) and whether it is a conjugate / negative
    view of it, as the daemon holds them. One round trip for all of them."""
    stream = tensors[0]._genie.stream
    with stream.lock:
        entry = [STORAGE_OF_OP, [t._genie.wire for t in tensors], {},
                 [[stream.new_handle(), None, None, None, None] for _ in tensors]]
    return [(whole, (stream.link, name), offset, tuple(strides), (bool(conj), bool(neg)))
            for whole, name, offset, strides, (conj, neg) in _from_report(stream.run_reported(entry), stream)]


def storage_of(t: LazyTensor) -> tuple[LazyTensor, tuple, int, tuple[int, ...], tuple[bool, bool]]:
    """`storages_of([t])[0]`."""
    return storages_of([t])[0]


COPY_STORAGE_OP = protocol.COPY_STORAGE_OP
_COPY_MEMOS = "genie copy memos"  # the key of this module's entry in a copy.deepcopy memo (its keys are ints)
_COPIED_STORAGES = "storages"  # that entry's key of {id(source storage identity): (it, its copy's)}


def copy_in_storage_copy(t: LazyTensor, memo: dict) -> LazyTensor:
    """The copy of `t` copy.deepcopy makes of a CPU tensor: the same view of a copy of t's whole
    storage, which the daemon makes once per storage for the deepcopy whose `memo` this is, so
    copied views of one storage stay views of one another. Queued, no round trip; the memo's
    handle on the daemon goes when the memo does (the end of the deepcopy)."""
    stream = t._genie.stream
    memos = memo.get(_COPY_MEMOS)
    if memos is None:
        memos = memo[_COPY_MEMOS] = {}
    with stream.lock:
        stream._not_while_recording("copy.deepcopy")
        memo_ref = memos.get(stream)
        if memo_ref is None:
            memo_ref = memos[stream] = HandleRef(stream, stream.new_handle(), 0)
        h = stream.new_handle()
        out = LazyTensor(stream, h, t.shape, t.stride(), t.storage_offset(), t.dtype, t._genie.storage_nbytes)
        # Copies of views of one storage are views of one copy: one identity per source storage
        # (the source's kept in the memo, so that its id names no other storage meanwhile).
        source = storage_identity(t._genie)
        copies = memos.setdefault(_COPIED_STORAGES, {})
        out._genie.storage = copies.setdefault(id(source), (source, StorageIdentity()))[1]
        bits = meta.view_bits(t)
        if bits:  # the daemon's copy is the same conjugate / negative view
            meta.set_view_bits(out, bits)
            out._refresh_meta_key()
        stream.append([COPY_STORAGE_OP, [t._genie.wire, memo_ref.wire], {}, h])
    return out


ADOPT_OP = protocol.ADOPT_OP


def _try_adopt(dst: LazyTensor, src: torch.Tensor) -> bool:
    """`.to(device)` of a CPU (or CUDA) tensor is empty() then copy_(): when the empty is the last queued op
    and shapes, dtypes and layouts agree, let the daemon keep the received frame as the tensor
    instead (no allocation, no copy on the daemon). A channels-last or transposed CPU tensor (a
    model made channels-last before it moves) goes as its memory lies, with its strides: it was
    permuted to row-major here and back on the daemon (64 MiB: ~115 ms against ~8 contiguous)."""
    stream = dst._genie.stream
    if (src.device.type not in ("cpu", "cuda") or src.dtype != dst.dtype or src.shape != dst.shape
            or dst.storage_offset() != 0):
        return False
    span = None
    if not dst.is_contiguous():
        span = dense_span(src) if src.device.type == "cpu" and src.stride() == dst.stride() else None
        if span is None:
            return False
    with stream.lock:
        last = stream.ops[-1] if stream.ops else None
        if last is None or last[3] != dst._genie.id or last[0] not in ("aten::empty.memory_format", "aten::empty_strided"):
            return False
        stream.ops.pop()
        if span is None:
            args = encode_call([src], {}, stream)[0]
        else:
            args = encode_call([span], {}, stream)[0] + [list(src.shape), list(src.stride())]
        stream.append([ADOPT_OP, args, {}, dst._genie.id])
    return True


def _narrowed_here(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A host tensor converted to a smaller `dtype` before it is sent (`x.to(dev, torch.float16)`,
    `model.to(dev, torch.bfloat16)`), so the wire carries the smaller elements (float32 -> float16:
    half the bytes). PyTorch's own CPU-to-GPU copy converts on the CPU too, so values (an
    out-of-range float to an integer, say) and warnings (complex to real) are CUDA's. A cast that
    widens stays on the daemon: fewer bytes travel, and widening is exact either way. None when
    nothing is to be cast here."""
    if src.device.type != "cpu" or src.dtype == dtype or dtype.itemsize >= src.dtype.itemsize:
        return None
    return src.detach().to(dtype)


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if type(dst) is LazyTensor and type(src) is not LazyTensor and isinstance(src, torch.Tensor):
        # non_blocking=True from pinned memory: the program promises, as with CUDA, not to write the
        # source until the copy is done (synchronize), so its memory goes out without a copy. From
        # pageable memory CUDA's copy has taken the bytes when it returns (the program may write
        # the source at once, and does: a refilled host buffer), so it is copied here too.
        _borrowing.source = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) \
            and src.is_pinned()
        narrowed = _narrowed_here(src, dst.dtype)
        if narrowed is not None:
            # Converted here, the new tensor is this copy's own: its memory may go as it is.
            src, args, _borrowing.source = narrowed, (dst, narrowed, *args[2:]), True
        try:
            if _try_adopt(dst, src):
                return dst
            return capture(func, args, kwargs)
        finally:
            _borrowing.source = False
    if type(dst) is not LazyTensor:
        from .materialize import to_cpu

        return dst.copy_(to_cpu(src), *args[2:], **kwargs)
    if type(src) is LazyTensor and src._genie.stream is not dst._genie.stream:
        src = move_between_devices(src, dst._genie.stream)
        return capture(func, (dst, src, *args[2:]), kwargs)
    return capture(func, args, kwargs)


SEND_OP, RECV_OP = protocol.SEND_OP, protocol.RECV_OP


def move_between_devices(src: LazyTensor, dst_stream) -> LazyTensor:
    """A copy of `src` on dst_stream's device. Different daemons: daemon to daemon (genie::send on the
    source, genie::recv on the destination); the same daemon: a device-to-device copy there."""
    import secrets

    src_stream = src._genie.stream
    if src_stream.link is dst_stream.link:
        # One daemon, one handle table: copy there. Flushing around the op keeps the source's
        # handle alive until the copy has run (frees of the source travel after it). A tensor whose
        # elements fill one run (channels-last, transposed) keeps its strides, as PyTorch's
        # preserve_format copy keeps them; any other (a view with gaps) is copied row-major.
        keeps_strides = src.numel() > 0 and fills_one_run(src.shape, src.stride())
        memory_format = torch.preserve_format if keeps_strides else torch.contiguous_format
        src_stream.flush()
        with dst_stream.lock:
            h = dst_stream.new_handle()
            strides = tuple(src.stride()) if keeps_strides else contiguous_strides(src.shape)
            out = LazyTensor(dst_stream, h, src.shape, strides, 0, src.dtype, src.numel() * src.element_size())
            dst_stream.append(["aten::_to_copy", [protocol.encode_handle(src._genie.id)],
                               {"device": protocol.encode_device("remote", dst_stream.local_index),
                                "memory_format": protocol.encode_memory_format(memory_format)}, h])
        dst_stream.flush()
        return out
    tid = secrets.token_hex(16)
    with src_stream.lock:
        src_stream.append([SEND_OP, [protocol.encode_handle(src._genie.id), dst_stream.link.endpoint, tid], {}, None])
    src_stream.flush()
    # A channels-last or transposed tensor goes in its own memory order and keeps its strides, as
    # PyTorch's .to() keeps them (the sending daemon decides the same way: peers.PeerLinks.send).
    strides = tuple(src.stride()) if travels_as_it_lies(src) else contiguous_strides(src.shape)
    with dst_stream.lock:
        h = dst_stream.new_handle()
        out = LazyTensor(dst_stream, h, src.shape, strides, 0, src.dtype, src.numel() * src.element_size())
        dst_stream.append([RECV_OP, [tid], {}, h])
    return out


ALIAS_STORAGE_OP = protocol.ALIAS_STORAGE_OP


def _set_storage(func, args, kwargs):
    """`t.set_(storage[, offset, size, stride])` for a storage of this device: one torch.load placed
    there (see serialization), or a remote tensor's (handed out by its untyped_storage() /
    storage(); storage reads like `storage.tolist()` go this way). t becomes a view of the
    storage of the tensor holding it on the daemon."""
    from .lazy_tensor import storage_owner
    from .serialization import uploaded

    bound = _bound_set_args(args, kwargs)
    dst, storage = bound["self"], bound["source"]
    source = None
    if isinstance(storage, torch.UntypedStorage):
        loaded = uploaded(storage, dst.device)
        source = loaded._genie if loaded is not None else storage_owner(storage)
    if type(dst) is not LazyTensor or source is None or source.stream is not dst._genie.stream:
        raise UnsupportedOperationError(op_name(func), "a remote tensor can be pointed only at a storage of its "
                                        "device whose tensor is alive (or that torch.load placed there); "
                                        "t.set_(source_tensor) also works")
    if func is torch.ops.aten.set_.source_Storage:
        return _point_at(dst, source, 0, (storage.nbytes() // dst.element_size(),), (1,))
    return _point_at(dst, source, *_requested_geometry(bound))


def _set_to_tensor(func, args, kwargs):
    """`t.set_(source)`, `t.set_(source, offset, size, stride)`: t becomes a view of the storage
    of `source`, a tensor on the same remote device."""
    bound = _bound_set_args(args, kwargs)
    dst, source = bound["self"], bound["source"]
    if type(dst) is not LazyTensor or type(source) is not LazyTensor or source.device != dst.device:
        raise RuntimeError(f'Attempted to set the storage of a tensor on device "{dst.device}" to a storage on '
                           f'different device "{source.device}".  This is no longer allowed; the devices must match.')
    if source.dtype != dst.dtype:  # PyTorch's refusal, in its words (its meta kernel checks the dtypes)
        torch.empty(0, dtype=dst.dtype, device="meta").set_(torch.empty(0, dtype=source.dtype, device="meta"))
    if func is torch.ops.aten.set_.source_Tensor:
        return _point_at(dst, source._genie, source.storage_offset(), tuple(source.shape), tuple(source.stride()))
    return _point_at(dst, source._genie, *_requested_geometry(bound))


def _bound_set_args(args, kwargs) -> dict:
    """The arguments of any `set_` overload by name."""
    return dict(zip(("self", "source", "storage_offset", "size", "stride"), args), **kwargs)


def _requested_geometry(bound: dict) -> tuple:
    """(offset, size, stride) that a `set_` overload taking them was given (strides row-major when absent)."""
    size = tuple(bound["size"])
    return bound["storage_offset"], size, tuple(bound.get("stride") or contiguous_strides(size))


def _point_at(dst: LazyTensor, source: HandleRef, offset: int, size: tuple, stride: tuple) -> LazyTensor:
    """dst becomes the view (offset, size, stride, in dst's dtype) of source's storage on the
    daemon (genie::alias_storage, which checks it lies inside; so does this side, with PyTorch's
    message, which its meta kernel does not give). The wrapper takes the new metadata as after
    any in-place view op."""
    nbytes, itemsize = source.storage_nbytes, dst.element_size()
    needed = meta.elements_spanned(offset, size, stride) * itemsize
    if offset < 0 or needed > nbytes:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
                           f"itemsize {itemsize} requiring a storage size of {needed} are out of bounds for "
                           f"storage of size {nbytes}")
    stream = dst._genie.stream
    with stream.lock:
        stream.append([ALIAS_STORAGE_OP, [source.wire, protocol.encode_dtype(dst.dtype), offset, list(size),
                                          list(stride)], {}, dst._genie.id])
        _apply_mutations([(0, size, stride, offset, nbytes)], [dst])
        dst._genie.storage = storage_identity(source)
    return dst


# Entered in capture's table of ops with handlers of their own.
SPECIAL.update({
    id(torch.ops.aten._to_copy.default): _to_copy,
    id(torch.ops.aten.copy_.default): _copy_,
    id(torch.ops.aten.set_.source_Storage_storage_offset): _set_storage,
    id(torch.ops.aten.set_.source_Storage): _set_storage,
    id(torch.ops.aten.set_.source_Tensor): _set_to_tensor,
    id(torch.ops.aten.set_.source_Tensor_storage_offset): _set_to_tensor,
})
