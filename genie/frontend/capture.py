"""Capture: turn each ATen op on LazyTensors into an entry of a device's op stream.

For every op: walk the arguments once (find the device, collect tensors, build
the metadata-cache key), get the output plan (cache, else meta execution),
create the output LazyTensors, and append ``[name, args, kwargs, outs]`` to the
device's stream. Nothing runs locally and no shape is guessed. Ops that need
real data for their output metadata run on the daemon right away. Ops with
handlers of their own are looked up first (SPECIAL): `.item()`, library ops, sparse
layouts here; moves across devices and storage ops in `transfers`.
"""
from __future__ import annotations

import importlib
import logging
import threading

import torch

from genie import config as config_module
from genie.errors import GenieConnectionError, UnsupportedOperationError
from genie.runtime import get_runtime
from genie.runtime.device_type import DEVICE_TYPE
from genie.runtime.stream import thread_streams
from genie.transport import cuda_ipc, protocol
from genie.transport.hostmem import snapshot
from genie.transport.tensors import DTYPE_NAMES, is_dense, parse_dtype, tensor_to_frames

from . import collectives, generators, meta, padded_sequences, shape_rules, sparse_coo, sparse_csr, sync_debug
from .lazy_tensor import LazyTensor, OtherSubclassDecides, storage_identity

log = logging.getLogger("genie.capture")
_LOG_INTERCEPTS = config_module.load().log_intercepts

meta_cache = meta.MetaCache()
_plans_get = meta_cache._plans.get  # the hot path's lookup (MetaCache.get counts the same way)
_REMOTE, _NewTensor = meta.REMOTE, meta.NewTensor
contiguous_strides = meta.contiguous_strides
_planned = LazyTensor.planned
_storage_identity = storage_identity

_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
_names: dict = {}


def op_name(func) -> str:
    # Keyed by id(): OpOverload.__hash__ is Python code, and overloads live as long as torch.
    name = _names.get(id(func))
    if name is None:
        overload = func._overloadname
        name = func._schema.name + ("" if overload == "default" else "." + overload)
        _names[id(func)] = name
    return name


# ---------------------------------------------------------------- argument walk


class _Walk:
    """Result of one pass over an op's arguments."""

    __slots__ = ("tensors", "sizes", "stream", "foreign_device", "key", "scalar_blind", "cpu_grad")

    def __init__(self, scalar_blind: bool = False) -> None:
        self.tensors: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.stream = None
        self.foreign_device = False  # an explicit non-remote device argument (e.g. device="cpu")
        self.scalar_blind = scalar_blind  # key Python numbers by type only (see _blind_to_scalars)
        self.cpu_grad = False  # a CPU tensor that requires grad, not a 0-dim one, is an argument


# Ops whose outputs' metadata cannot depend on the values of Python numbers among their arguments,
# only on their types (int, float, bool: type promotion): pointwise ops (torch.Tag.pointwise),
# foreach ops, and fills. Their cache keys hold those numbers' types, not values. An optimizer's
# step sizes and bias corrections change every step (Adam: `exp_avg_sq.sqrt() / bias_correction2_sqrt`,
# `p.addcdiv_(m, d, value=-step_size)`; any LR schedule: `p.add_(g, alpha=-lr)`): keyed by value,
# each step planned those ops anew and added ~12 KiB of plans to the cache (a 4-tensor model under
# Adam: +53 MiB of the client's memory over 3,000 steps, until the cache's bound cleared it all).
_SCALAR_BLIND_EXTRA = frozenset({
    "aten::fill_.Scalar", "aten::fill.Scalar", "aten::masked_fill_.Scalar", "aten::masked_fill.Scalar",
    "aten::where.ScalarOther", "aten::where.ScalarSelf", "aten::where.Scalar", "aten::full_like",
    "aten::bernoulli_.float", "aten::bernoulli.p", "aten::uniform_", "aten::normal_", "aten::exponential_",
    "aten::log_normal_", "aten::cauchy_", "aten::geometric_",
})
_scalar_blind: dict = {}  # id(op overload) -> whether its keys hold number types only


def _blind_to_scalars(func) -> bool:
    blind = _scalar_blind.get(id(func))
    if blind is None:
        name = op_name(func)
        blind = _scalar_blind[id(func)] = (
            name.startswith("aten::") and (torch.Tag.pointwise in getattr(func, "tags", ())
                                           or name.startswith("aten::_foreach_")
                                           or name in _SCALAR_BLIND_EXTRA))
    return blind


def _check_stream(w: _Walk, ref) -> None:
    """All remote tensors of one op must live on one device (the op's stream)."""
    if w.stream is None:
        w.stream = ref.stream
    elif ref.stream is not w.stream:
        for stream in (w.stream, ref.stream):
            if stream.link.lost is not None:  # one is from a lost connection (or from before a fork): say so
                raise GenieConnectionError(stream.link.lost)
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{w.stream.device} and {ref.stream.device}!"
        )


_NO_TORCH_DISPATCH = torch._C._disabled_torch_dispatch_impl  # a plain tensor's (and nn.Parameter's)


def _walk(value, w: _Walk, seen: dict):
    """Returns the cache-key part of `value`, recording tensors and the device in `w`."""
    if isinstance(value, torch.Tensor):
        idx = seen.get(id(value))
        if idx is None:
            idx = seen[id(value)] = len(w.tensors)
            w.tensors.append(value)
            if type(value) is LazyTensor:
                ref = value._genie
                w.sizes.append(ref.storage_nbytes)
                _check_stream(w, ref)
            else:
                if type(value).__torch_dispatch__ is not _NO_TORCH_DISPATCH:
                    raise OtherSubclassDecides  # e.g. a nested jagged tensor: it runs the op on our values
                if value.device.type == "meta" or value.is_sparse:
                    raise UnsupportedOperationError("argument", f"{value.device.type}/{value.layout} tensors cannot be sent")
                if value.requires_grad and value.dim():
                    w.cpu_grad = True
                w.sizes.append(value.untyped_storage().nbytes())
        if type(value) is LazyTensor:
            return (True, idx, value._genie.meta_key)
        return (False, idx, value.dtype, value.shape, value.stride(), value.storage_offset(), w.sizes[idx])
    if isinstance(value, (list, tuple)):
        return (type(value), *(_walk(v, w, seen) for v in value))
    if isinstance(value, torch.device):
        if value.type != DEVICE_TYPE:
            w.foreign_device = True
        return value
    if isinstance(value, torch.Generator):  # plans do not depend on which one; the cache must not keep it alive
        return (torch.Generator, value.device)
    kind = type(value)
    if w.scalar_blind and (kind is float or kind is int or kind is bool):
        return (kind,)
    return (kind, value)


# ---------------------------------------------------------------- wire encoding (stream lock held)


_ENCODED_BY_TYPE = {torch.dtype: protocol.encode_dtype, torch.memory_format: protocol.encode_memory_format,
                    torch.layout: protocol.encode_layout}


def encode_call(args, kwargs, stream) -> tuple[list, dict]:
    """The wire form of an op's arguments. Bulk transfers claimed on the way are dropped if a
    later argument fails: no op will read them."""
    try:
        return _encode(args, stream), {k: _encode(v, stream) for k, v in kwargs.items()}
    except BaseException:
        stream.discard_pending_bulk()
        raise


class _Borrowing(threading.local):
    source = False  # encoding a non_blocking copy: its source's memory may leave as it is, later


_borrowing = _Borrowing()  # set by transfers' copy_


def _encode(value, stream):
    t = type(value)
    if t is LazyTensor:
        return value._genie.wire
    # Keyword constants of factories and .to() (dtype, device, memory format), before the general
    # isinstance chain below: encode_call of empty_strided's arguments 4.8 -> 3.2 us.
    by_type = _ENCODED_BY_TYPE.get(t)
    if by_type is not None:
        return by_type(value)
    if t is torch.device and value == stream.device:
        return protocol.encode_device("remote", stream.local_index)
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            if value.device.type == "cuda" and stream.link.cuda_ipc_for(value.device):
                # Same host: the daemon copies from this GPU's memory, no bytes on the wire.
                return protocol.encode_cuda_ipc(cuda_ipc.describe(value.detach()))
            value = value.cpu()
        if value.requires_grad:  # the bytes are all that is sent (and numpy() refuses such a tensor)
            value = value.detach()
        xfer = stream.send_bulk(value)
        if xfer is not None:
            return protocol.encode_bulk(xfer, DTYPE_NAMES[value.dtype], value.shape)
        if not _borrowing.source and is_dense(value):
            # An inline payload leaves with its batch, later: a copy taken now is what the daemon
            # gets, as `.to(device)` promises, whatever the program writes into `value` meanwhile
            # (and numpy's export, below, then pins the copy's storage size, not the program's).
            value = snapshot(value)
        frames = [stream.add_frame(b) for b in tensor_to_frames(value)]
        if len(frames) == 1:
            return protocol.encode_inline_one(frames[0], DTYPE_NAMES[value.dtype], value.shape)
        return protocol.encode_inline(frames, DTYPE_NAMES[value.dtype], value.shape)
    if isinstance(value, (list, tuple)):
        if all(type(v) is int and _INT64_MIN <= v <= _UINT64_MAX for v in value):  # sizes, dims: the common case
            return list(value)
        return [_encode(v, stream) for v in value]
    if value is None or isinstance(value, (bool, float, str)):
        return value
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise OverflowError(f"integer argument {value} does not fit in 64 bits")
        return value
    if isinstance(value, torch.dtype):
        return protocol.encode_dtype(value)
    if isinstance(value, torch.device):
        if value.type != DEVICE_TYPE:
            return protocol.encode_device("cpu", 0)
        target = stream if value.index is None else get_runtime().stream(value.index)
        if target.link is not stream.link:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found {value} "
                               f"and {stream.device}")
        return protocol.encode_device("remote", target.local_index)
    if isinstance(value, torch.memory_format):
        return protocol.encode_memory_format(value)
    if isinstance(value, torch.layout):
        return protocol.encode_layout(value)
    if isinstance(value, complex):
        return protocol.encode_complex(value)
    if isinstance(value, torch.Generator):
        return generators.encode(value, stream)
    raise UnsupportedOperationError(type(value).__name__, f"cannot send an argument of type {type(value).__name__}")


# ---------------------------------------------------------------- outputs


def _build_outputs(plan_out, stream, inputs):
    """Output objects and the matching wire `outs` structure."""
    if type(plan_out) is meta.NewTensor:
        h = stream.new_handle()
        return LazyTensor.planned(stream, h, plan_out), h
    if type(plan_out) is meta.SameAsInput:
        return inputs[plan_out.index], None
    if type(plan_out) is meta.Value:
        return plan_out.value, None
    pairs = [_build_outputs(p, stream, inputs) for p in plan_out]
    return type(plan_out)(p[0] for p in pairs), [p[1] for p in pairs]


def _share_storage(outputs, identity) -> None:
    """Views made by one op (`split`, `unbind` make several) share their base's storage identity."""
    if isinstance(outputs, LazyTensor):
        outputs._genie.storage = identity
    elif isinstance(outputs, (list, tuple)):
        for o in outputs:
            _share_storage(o, identity)


def _stride_hints(plan_out):
    """protocol.OpCall.strides for outputs planned as `plan_out` (the structure of its `outs`), or
    None when no output has one (meta.NewTensor.stride_hint)."""
    if type(plan_out) is meta.NewTensor:
        return plan_out.stride_hint
    if type(plan_out) in (meta.SameAsInput, meta.Value):
        return None
    hints = [_stride_hints(p) for p in plan_out]
    return hints if any(h is not None for h in hints) else None


class _StorageDonor(torch.Tensor):
    """A data-less wrapper whose only use is to lend a larger storage to a resized LazyTensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"internal: {func} reached a storage donor")


def _apply_mutations(mutations, inputs) -> None:
    """Mirror metadata changes of in-place view ops and out= resizes on the wrappers."""
    from torch.utils._mode_utils import no_dispatch

    for index, shape, stride, offset, storage_nbytes in mutations:
        t = inputs[index]
        if type(t) is not LazyTensor:
            continue
        with no_dispatch():
            if storage_nbytes != t._genie.storage_nbytes:  # grown (out= resizes) or another storage (set_)
                donor = torch.Tensor._make_wrapper_subclass(
                    _StorageDonor, (0,), dtype=t.dtype, device=t.device, storage_size=storage_nbytes)
                torch._functionalize_unsafe_set(t, donor)
                t._genie.storage_nbytes = storage_nbytes
            # As return_and_correct_aliasing does: run the metadata change on the wrapper itself.
            prev = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                torch.ops.aten.as_strided_.default(t, shape, stride, offset)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(prev)
        t._refresh_meta_key()


# ---------------------------------------------------------------- dispatch


def dispatch(func, args: tuple, kwargs: dict):
    special = SPECIAL.get(id(func))
    if special is not None:
        return special(func, args, kwargs)
    if not kwargs and not _LOG_INTERCEPTS:  # capture(), minus one call frame on the hottest path
        outputs = _capture_hot(func, args)
        if outputs is not _NOT_HOT:
            return outputs
    return _capture_general(func, args, kwargs)


_NOT_HOT = object()  # what _capture_hot returns when the general walk must do the work instead


def _capture_hot(func, args: tuple):
    """The common case in one pass: no kwargs, remote tensors on one stream and plain scalars, a
    cached plan with one new output and no metadata mutation. When the walk succeeds but the
    plan is missing or not that simple, the general path continues from this walk (and its result,
    None included, is final); _NOT_HOT: the arguments need the general walk (other types, two
    devices, no remote tensor).

    The walk stays inline here, not in a helper: one function on the hottest path is what
    keeps capture near 2x the floor (a shared walk helper measured 7-15% slower per op)."""
    key, wire, seen, stream, blind = [], [], None, None, None
    for a in args:
        t = type(a)
        if t is LazyTensor:
            ref = a._genie
            if stream is None:
                stream = ref.stream
            elif ref.stream is not stream:
                return _NOT_HOT
            if seen is None:
                seen = [a]
                key.append((True, 0, ref.meta_key))
            else:
                for i, other in enumerate(seen):
                    if other is a:
                        break
                else:
                    i = len(seen)
                    seen.append(a)
                key.append((True, i, ref.meta_key))
            wire.append(ref.wire)
        elif t is float or t is bool or (t is int and _INT64_MIN <= a <= _UINT64_MAX):
            if blind is None:  # looked up only for ops given numbers
                blind = _scalar_blind.get(id(func))
                if blind is None:
                    blind = _blind_to_scalars(func)
            key.append((t,) if blind else (t, a))
            wire.append(a)
        elif a is None:
            key.append(None)
            wire.append(None)
        elif (t is list or t is tuple) and all(type(x) is int for x in a):
            key.append((t, *a))
            wire.append(list(a))
        else:
            return _NOT_HOT
    if stream is None:
        return _NOT_HOT
    key = (id(func), tuple(key), None)
    plan = _plans_get(key)
    if plan is None or plan is _REMOTE or plan.mutations or type(plan.outputs) is not _NewTensor:
        return _capture_general(func, args, {}, (key, wire, seen, stream, plan))
    meta_cache.hits += 1
    out_plan = plan.outputs
    with stream.lock:
        outs = next(stream.link.handle_ids)
        if plan.view:
            if args[0].is_inference() is not _inference_mode_enabled():
                with torch.inference_mode(args[0].is_inference()):
                    outputs = _planned(stream, outs, out_plan)
            else:
                outputs = _planned(stream, outs, out_plan)
            outputs._genie.storage = _storage_identity(args[0]._genie)  # a view: the same storage
            stream.views_captured += 1
        else:
            outputs = _planned(stream, outs, out_plan)
        entry = [_names.get(id(func)) or op_name(func), wire, {}, outs]
        if out_plan.stride_hint is not None and not plan.view:
            entry.append(out_plan.stride_hint)
        # DeviceStream.append inlined for the case where the batch neither changes stream nor fills up.
        ids = thread_streams.ids
        ops = stream.ops
        if ((ids.get(stream.global_index, 0) if ids else 0) == stream.batch_stream and stream.recording is None
                and len(ops) + 1 < stream.batch_ops and stream.inline_bytes < stream.batch_bytes):
            ops.append(entry)
            stream.ops_captured += 1
        else:
            stream.append(entry)
    return outputs


def capture(func, args: tuple, kwargs: dict):
    if not kwargs and not _LOG_INTERCEPTS:
        outputs = _capture_hot(func, args)
        if outputs is not _NOT_HOT:
            return outputs
    return _capture_general(func, args, kwargs)


# Ops whose autograd formulas move gradients between devices themselves (`.to()`, `copy_`).
_CROSSING_DEVICES = frozenset({id(torch.ops.aten._to_copy.default), id(torch.ops.aten.copy_.default)})


def _refuse_cpu_grad(func, stream) -> None:
    """A CPU tensor other than a 0-dim one mixed into a remote op runs (its values are sent), but
    when it requires grad, autograd would send that gradient to it from the device: PyTorch's
    engine stopped such a backward with an internal assert. CUDA refuses the mix at the op, with
    this message; so does Genie, for tensors that require grad, saying what to do instead."""
    raise RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {stream.device} and cpu! "
        f"({op_name(func)} was given a CPU tensor that requires grad: move it to the device first, e.g. "
        f"t.to('{stream.device}'), whose gradient autograd carries back to the CPU tensor)")


def _capture_general(func, args: tuple, kwargs: dict, walked: tuple | None = None):
    """Any op on remote tensors. `walked`: (key, wire args, tensors, stream, cached plan or None)
    from `_capture_hot`, whose walk of plain arguments need not be done again."""
    if walked is not None:
        key, wire_args, tensors, stream, plan = walked
        sizes = None
    else:
        w = _Walk(_blind_to_scalars(func))
        seen: dict = {}
        wire_args = None
        key = (id(func), _walk(args, w, seen), _walk(tuple(kwargs.items()), w, seen) if kwargs else None)
        if w.stream is None:
            raise UnsupportedOperationError(op_name(func), "no remote tensor among its arguments")
        if w.foreign_device:
            return run_locally(func, args, kwargs)
        if w.cpu_grad and torch.is_grad_enabled() and id(func) not in _CROSSING_DEVICES:
            _refuse_cpu_grad(func, w.stream)
        tensors, sizes, stream = w.tensors, w.sizes, w.stream
        try:
            plan = _plans_get(key)
        except TypeError:  # an unhashable argument: plan without caching
            plan, key = None, None
    if plan is not None:
        meta_cache.hits += 1
    else:
        if sizes is None:
            sizes = [t._genie.storage_nbytes for t in tensors]
        if getattr(func, "namespace", "aten") != "aten":
            return _library_op(func, args, kwargs)
        rule = shape_rules.RULES.get(id(func))
        plan = rule(args, kwargs) if rule is not None else None
        loose = None
        if plan is None and key is not None:
            loose = _loose_key(func, key)
            plan = _plans_get(loose) if loose is not None else None
        if plan is None:
            try:
                plan = meta.plan_op(func, args, kwargs, tensors, sizes)
            except meta.NeedsRemoteExecution:
                plan = meta.REMOTE  # remembered: the next identical call skips meta execution
            if loose is not None:
                meta_cache.put(loose, plan)
        if plan is not _REMOTE and _views_of_first(func):
            plan = meta.Plan(plan.outputs, plan.mutations, view=True)
        if key is not None:
            meta_cache.put(key, plan)
    if plan is _REMOTE:
        meta_cache.bypasses += 1
        return run_reported(func, args, kwargs, stream, wire_args)
    with stream.lock:
        out_plan = plan.outputs
        if plan.view and tensors[0].is_inference() is not _inference_mode_enabled():
            with torch.inference_mode(tensors[0].is_inference()):
                outputs, outs = _build_outputs(out_plan, stream, tensors)
        elif type(out_plan) is _NewTensor:  # the common case, without the general walk
            outs = next(stream.link.handle_ids)
            outputs = _planned(stream, outs, out_plan)
        else:
            outputs, outs = _build_outputs(out_plan, stream, tensors)
        if plan.view:
            stream.views_captured += 1
            if isinstance(tensors[0], LazyTensor):
                _share_storage(outputs, _storage_identity(tensors[0]._genie))
        if wire_args is not None:
            entry = [_names.get(id(func)) or op_name(func), wire_args, {}, outs]
        else:
            entry = [op_name(func), *encode_call(args, kwargs, stream), outs]
        if not plan.view:
            hints = _stride_hints(out_plan)
            if hints is not None:
                entry.append(hints)
        stream.append(entry)
    if plan.mutations:
        _apply_mutations(plan.mutations, tensors)
    if _LOG_INTERCEPTS:
        log.debug("captured %s on %s", entry[0], stream.device)
    return outputs


# Redispatching here runs an op's kernel for this device (PrivateUse1: remote_accelerator), or
# its kernel for every device (CompositeExplicitAutograd).
DEVICE_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
ANY_DEVICE_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _library_op(func, args, kwargs):
    """An op outside aten: a library's or the program's own (`torch.library.custom_op`). A daemon
    runs aten ops only (it imports no code a client names), so an op with a kernel for this
    device (a library's registered for "PrivateUse1", as FSDP2's are, or a custom op's for
    device_types="remote_accelerator") or for every device runs that kernel here, on the remote
    tensors, and the aten ops it calls are captured as any others (from now on straight from
    `dispatch`). One whose kernels are all for other devices (CUDA, CPU) cannot run on the
    daemon: refused now, by name, rather than by the daemon when its batch runs."""
    if func.namespace == "c10d":  # torch.distributed's collectives: staged through the CPU backend
        return collectives.run_c10d(func, args, kwargs)
    if func.namespace == "_c10d_functional":
        return collectives.run_functional(func, args, kwargs)
    if func.has_kernel_for_dispatch_key(torch._C.DispatchKey.PrivateUse1):
        kernel = _device_kernel
    elif func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeExplicitAutograd):
        kernel = _any_device_kernel
    elif func.namespace == "quantized":  # a quantized model moved to the device (its packed weights stay on the CPU)
        raise UnsupportedOperationError(op_name(func), QUANTIZED)
    else:
        raise UnsupportedOperationError(
            op_name(func), "it is not an aten operator and has no kernel for this device or for every "
            "device (only aten operators run on a daemon; register one with torch.library.custom_op "
            "for device_types='remote_accelerator' or without device_types, or decompose it into aten "
            "operators)")
    SPECIAL[id(func)] = kernel
    return kernel(func, args, kwargs)


QUANTIZED = ("quantized tensors and models (torch.quantize_per_tensor, torch.ao.quantization) have no remote "
             "counterpart: dequantize() tensors, or quantize and run quantized models on the CPU")


def _device_kernel(func, args, kwargs):
    return func.redispatch(DEVICE_KEYS, *args, **kwargs)


def _any_device_kernel(func, args, kwargs):
    return func.redispatch(ANY_DEVICE_KEYS, *args, **kwargs)


def _views_of_first(func) -> bool:
    """Whether `func` returns views of its first argument (view, t, select, split, detach, ...).
    PyTorch makes such a view an inference tensor exactly when that argument is one, whether or
    not inference mode is on; a wrapper is one when made in inference mode, and torch's autograd
    layer then refuses to give it its base's version counter ("Cannot set version_counter for
    inference tensor", pytorch/pytorch#170419): `x[1]` of a model's tensor inside
    torch.inference_mode() failed. Such outputs are made in the argument's mode."""
    schema = func._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    return (first is not None and not first.is_write
            and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))


_inference_mode_enabled = torch.is_inference_mode_enabled


_FRESH_OUTPUTS: dict[int, bool] = {}  # id(op) -> whether it writes no argument and returns only new tensors


def _fresh_outputs_only(func) -> bool:
    fresh = _FRESH_OUTPUTS.get(id(func))
    if fresh is None:
        schema = func._schema
        fresh = _FRESH_OUTPUTS[id(func)] = (
            schema.name != "aten::_unsafe_view"  # a view that its schema does not mark as one
            and bool(schema.returns) and all(a.alias_info is None for a in schema.arguments)
            and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns))
    return fresh


def _loose_key(func, key: tuple) -> tuple | None:
    """A second cache key for an op whose plan cannot depend on what `key` holds beyond dtypes,
    shapes and contiguity: one that writes no argument and returns only new tensors, all of whose
    tensor arguments are row-major contiguous (torch's own test, which ignores size-1 dimensions)
    and not also channels-last. Its results are then laid out row-major (or, for preserve-format
    copies, like the input: alike but for size-1 dimensions, whose strides address nothing), in
    storage of their own, whatever the inputs' storage offsets, storage sizes and size-1 strides.
    A decode loop reading the newest entry of a growing tensor (`ids[:, -1:]`, a cache position)
    gives such an op new offsets and strides at every step, and each new key cost a meta execution
    of the op (0.1-1 ms here; ~1.4 ms per token of a Hugging Face Llama's generate). None: not
    such an op or arguments."""
    if not _fresh_outputs_only(func):
        return None
    parts = _loosened(key[1])
    if parts is None or key[2] is not None and (extra := _loosened(key[2])) is None:
        return None
    return ("loose", key[0], parts, extra if key[2] is not None else None)


def _loosened(part):
    """`part` of a cache key with each tensor's entry cut to (dtype, shape); None if a tensor is
    not plainly row-major (see _loose_key)."""
    if type(part) is not tuple:
        return part
    if part and (part[0] is True or part[0] is False):  # a tensor: (True, i, meta_key) or (False, i, ...)
        dtype, shape, stride = part[2][:3] if part[0] is True else part[2:5]
        return (part[0], part[1], dtype, shape) if _row_major(shape, stride) else None
    out = []
    for p in part:
        q = _loosened(p)
        if q is None and p is not None:
            return None
        out.append(q)
    return tuple(out)


def _row_major(shape, stride) -> bool:
    expected = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1 and st != expected:
            return False
        expected *= n
    # Also channels-last contiguous (4-D and 5-D with size-1 dimensions): torch's layout choice may differ.
    return not shape_rules.channels_last_contiguous(shape, stride)


def run_reported(func, args, kwargs, stream, wire_args: list | None = None):
    """Run one op on the daemon now and build its outputs from what the daemon reports.
    `wire_args`: the encoded positional arguments when the caller has them (no kwargs)."""
    sync_debug.note(_SYNC_WHAT.get(id(func))
                    or f"{op_name(func)} (run at once: the shapes of its results come from the daemon)")
    returns = _return_types.get(id(func))
    if returns is None:
        returns = _return_types[id(func)] = tuple(str(r.type) for r in func._schema.returns)
    with stream.lock:
        outs = [_report_slots(r, stream) for r in returns]
        if len(outs) <= 1:  # one output, or none (`-> ()`: in-place ops such as _fused_sgd_)
            outs = outs[0] if outs else None
        if wire_args is not None:  # from the hot walk (.item() and the like): not encoded twice
            entry = [op_name(func), wire_args, {}, outs]
        else:
            entry = [op_name(func), *encode_call(args, kwargs, stream), outs]
    return _from_report(stream.run_reported(entry), stream)


_return_types: dict = {}  # id(op overload) -> its schema's return types, as strings
# What sync_debug says for the reads that reach the daemon as these ops.
_SYNC_WHAT = {id(torch.ops.aten._local_scalar_dense.default): "reading a value (.item(), bool(t), if t:, int(t))"}


# Ops that return a list of tensors of data-dependent length get this many handle slots.
_LIST_SLOTS = 64


def _report_slots(return_type: str, stream):
    if return_type in ("Tensor", "Tensor?", "Optional[Tensor]"):
        return stream.new_handle()
    if return_type in ("Tensor[]", "Tensor?[]", "List[Tensor]", "List[Optional[Tensor]]"):
        return [stream.new_handle() for _ in range(_LIST_SLOTS)]
    return None


def _from_report(value, stream):
    if isinstance(value, dict):
        handle, dtype, shape, stride, offset, nbytes = value["tensor"]
        return LazyTensor(stream, handle, shape, stride, offset, parse_dtype(dtype), nbytes)
    if isinstance(value, list):
        return tuple(_from_report(v, stream) for v in value)
    if isinstance(value, protocol.msgpack.ExtType):
        return protocol.decode_ext(value.code, value.data)
    return value




def run_locally(func, args, kwargs):
    """Materialize every remote argument and run the op on the CPU (explicit device='cpu' and the like)."""
    from .materialize import to_cpu_tree

    cpu_args, cpu_kwargs = to_cpu_tree((args, kwargs))
    return func(*cpu_args, **cpu_kwargs)


# ---------------------------------------------------------------- special cases


def _item(func, args, kwargs):
    """`.item()`: always run on the daemon and reported (no plan to look up, no walk to make)."""
    t = args[0] if len(args) == 1 and not kwargs else None
    if type(t) is not LazyTensor:
        return capture(func, args, kwargs)
    meta_cache.bypasses += 1
    return run_reported(func, args, kwargs, t._genie.stream, [t._genie.wire])


def _to_sparse_layout(func, args, kwargs):
    layout = str(func._schema.name).rsplit("_", 1)[-1].upper()  # aten::_to_sparse_csr -> CSR
    raise UnsupportedOperationError(op_name(func), meta.only_strided(f"sparse {layout}"))


def _embedding_bag_backward(func, args, kwargs):
    """nn.EmbeddingBag's backward: with sparse=True a remote sparse COO gradient (genie/frontend/sparse_coo.py)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    if bound.get("sparse"):
        return sparse_coo.embedding_bag_backward(bound)
    return capture(func, args, kwargs)


def _pin_remote(func, args, kwargs):
    # As torch refuses to pin a CUDA tensor, here rather than after a round trip to the daemon
    # (which said "Cannot access accelerator device": DataLoader(pin_memory=True) of remote samples).
    raise RuntimeError("cannot pin a remote_accelerator tensor: only dense CPU tensors can be pinned "
                       "(as with CUDA tensors); pin the CPU tensor before moving it, or leave pin_memory off")


def _record_stream(func, args, kwargs):
    from .streams import record_stream

    tensor, stream = (*args, *kwargs.values())
    record_stream(tensor, stream)


SPECIAL = {
    id(torch.ops.aten._local_scalar_dense.default): _item,
    id(torch.ops.aten.record_stream.default): _record_stream,
    id(torch.ops.aten._pin_memory.default): _pin_remote,
    # Memory on a device is never pinned host memory (CUDA tensors say False too): no round trip.
    id(torch.ops.aten.is_pinned.default): lambda func, args, kwargs: False,
    # Its kernel for every device slices the input by the lengths (a CPU tensor, as torch requires)
    # and makes batch_sizes on the CPU, where PackedSequence wants it: run here, slices captured.
    id(torch.ops.aten._pack_padded_sequence.default): _any_device_kernel,
    # nn.TransformerEncoder's nested fast path (eval, a src_key_padding_mask): kept dense, as padded sequences.
    id(torch.ops.aten._nested_tensor_from_mask.default): padded_sequences.from_mask,
    # torch.tensor(data, device=) marks its result fresh for functionalization: the tensor itself, as
    # torch's own kernel returns (it was captured as an alias op and run on the daemon).
    id(torch.ops.aten.lift_fresh.default): lambda func, args, kwargs: args[0],
    **{id(getattr(packet, overload)): _to_sparse_layout  # (their out= forms)
       for packet in (torch.ops.aten._to_sparse_csr, torch.ops.aten._to_sparse_csc, torch.ops.aten._to_sparse_bsr,
                      torch.ops.aten._to_sparse_bsc)
       for overload in packet.overloads() if overload != "default"},
    # Sparse CSR, CSC, BSR and BSC matrices: remote indices and values (genie/frontend/sparse_csr.py).
    id(torch.ops.aten._to_sparse_csr.default): lambda func, args, kwargs: sparse_csr.from_strided_or_coo(*args, **kwargs),
    id(torch.ops.aten._to_sparse_csc.default): lambda func, args, kwargs: sparse_csr.csc_from_strided_or_coo(*args, **kwargs),
    id(torch.ops.aten._to_sparse_bsr.default): lambda func, args, kwargs: sparse_csr.blocked_from_strided_or_coo(
        *args, **kwargs),
    id(torch.ops.aten._to_sparse_bsc.default): lambda func, args, kwargs: sparse_csr.blocked_from_strided_or_coo(
        *args, **kwargs, layout=torch.sparse_bsc),
    **{id(getattr(packet, overload)): sparse_csr.from_parts
       for packet in (torch.ops.aten._sparse_compressed_tensor_unsafe, torch.ops.aten._sparse_csr_tensor_unsafe,
                      torch.ops.aten._sparse_csc_tensor_unsafe, torch.ops.aten._sparse_bsr_tensor_unsafe,
                      torch.ops.aten._sparse_bsc_tensor_unsafe, torch.ops.aten.sparse_compressed_tensor,
                      torch.ops.aten.sparse_csr_tensor, torch.ops.aten.sparse_csc_tensor,
                      torch.ops.aten.sparse_bsr_tensor, torch.ops.aten.sparse_bsc_tensor)
       for overload in packet.overloads()},
    # Sparse COO: remote indices and values (genie/frontend/sparse_coo.py).
    id(torch.ops.aten._to_sparse.default): sparse_coo.dense_to_sparse,
    id(torch.ops.aten._to_sparse.sparse_dim): sparse_coo.dense_to_sparse,
    id(torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default): sparse_coo.from_parts,
    id(torch.ops.aten._sparse_coo_tensor_unsafe.default): sparse_coo.from_parts,
    id(torch.ops.aten._embedding_bag_backward.default): _embedding_bag_backward,
    # Composite ops that make sparse results, reached below autograd: their ops, one by one.
    id(torch.ops.aten.embedding_sparse_backward.default):
        lambda func, args, kwargs: func.decompose(*args, **kwargs),
}

# Moves across devices and storage ops: their handlers, entered in SPECIAL by that module, which
# imports this one's core (all defined above).
importlib.import_module(".transfers", __package__)

# LazyTensor.__torch_dispatch__ calls this module's dispatch directly from now on.
from . import lazy_tensor as _lazy_tensor_module  # noqa: E402

_lazy_tensor_module._dispatch = dispatch
