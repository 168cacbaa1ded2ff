"""Output metadata of an op, from meta-tensor execution behind a cache.

The cache is keyed by (op, every tensor argument's dtype/shape/stride/offset/
storage size, every other argument's type and value). A hit costs one dict
lookup; a miss runs the op on meta tensors once. The plan it stores says, for
each output, whether it is a new tensor (with its metadata), one of the inputs
returned again (in-place and out= ops), or a plain value; and which inputs had
their metadata changed (inplace_view ops such as `t_`, resizes of out=).
An op whose output depends on data (nonzero, item, ...) or that has no meta
kernel raises `NeedsRemoteExecution` and is run on the daemon synchronously.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import forward_ad as _forward_ad

from genie.errors import UnsupportedOperationError
from genie.runtime.device_type import DEVICE_TYPE
from genie.transport import layout_contract
from genie.transport.tensors import elements_spanned

META = torch.device("meta")

# Ops whose non-tensor results depend only on metadata, so meta execution answers them.
METADATA_ONLY_RESULTS = frozenset({
    "is_same_size", "is_contiguous", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "size", "stride", "numel", "dim", "is_complex", "is_floating_point", "is_signed",
    "_has_compatible_shallow_copy_type", "is_strides_like_format", "is_non_overlapping_and_dense",
    "_scaled_dot_product_fused_attention_overrideable",  # max_q, max_k: the sequence lengths
})


def only_strided(layout) -> str:
    """Why an op whose result would have another layout (sparse, ...) is refused."""
    return (f"its result would be a {layout} tensor; only strided (dense), sparse COO and 2-D sparse CSR tensors "
            "live on remote_accelerator: convert with .to_dense() (or .to_sparse()) first")


class NeedsRemoteExecution(Exception):
    """Output metadata can only come from running the op on real data."""


# Cached in place of a plan for ops whose outputs only the daemon can describe.
REMOTE = object()


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class NewTensor:
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int
    storage_nbytes: int
    bits: int = 0  # VIEW_BITS of a conjugate / negative view (x.conj(), x.mH, and views of those)
    # Worked out once per plan, for every output made from it (see LazyTensor.planned):
    meta_key: tuple = field(init=False, compare=False)  # the output's HandleRef.meta_key
    dense: bool = field(init=False, compare=False)  # contiguous, at offset 0, its storage exactly its bytes
    # Its strides, for the daemon to give its tensor (protocol.OpCall.strides), where a meta kernel
    # and a device's may differ and it matters: 4-D and 5-D shapes with a dimension of size 1.
    stride_hint: list | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stride_hint", list(self.stride) if len(self.shape) in (4, 5) and 1 in self.shape
                           and 0 not in self.shape else None)
        object.__setattr__(self, "meta_key", meta_key(self.dtype, self.shape, self.stride, self.offset,
                                                      self.storage_nbytes, self.bits))
        object.__setattr__(self, "dense", self.offset == 0 and self.stride == contiguous_strides(self.shape)
                           and self.storage_nbytes == math.prod(self.shape) * self.dtype.itemsize
                           and not self.bits)


# A tensor's conjugate and negative bits, as PyTorch keeps them on a view (x.conj() is a view of
# x's values with the conjugate bit set; torch._neg_view likewise). A remote tensor's wrapper
# carries the bits its tensor on the daemon has, so PyTorch's own handling of them (the
# conjugate fallback, `.imag` of a conjugate view, resolve_conj) works on the wrapper as on CPU.
CONJ, NEG = 1, 2


def view_bits(t: torch.Tensor) -> int:
    return (CONJ if torch.Tensor.is_conj(t) else 0) | (NEG if torch.Tensor.is_neg(t) else 0)


def set_view_bits(t: torch.Tensor, bits: int) -> None:
    torch._C._set_conj(t, bool(bits & CONJ))
    torch._C._set_neg(t, bool(bits & NEG))


def meta_key(dtype, shape, stride, offset, storage_nbytes, bits=0) -> tuple:
    """A tensor's metadata as a cache-key part (HandleRef.meta_key); the bits only when set, so
    the common key stays five plain fields."""
    if bits:
        return dtype, shape, stride, offset, storage_nbytes, bits
    return dtype, shape, stride, offset, storage_nbytes


def key_bits(key: tuple) -> int:
    return key[5] if len(key) > 5 else 0


@dataclass(frozen=True, slots=True)
class SameAsInput:
    index: int  # position in the flat list of tensor arguments


@dataclass(frozen=True, slots=True)
class Value:
    value: Any


@dataclass(frozen=True, slots=True)
class Plan:
    outputs: Any  # NewTensor | SameAsInput | Value | tuple/list of those
    mutations: tuple  # (input index, shape, stride, offset, storage nbytes)
    view: bool = False  # the outputs are views of the first argument (see capture._views_of_first)


class MetaCache:
    def __init__(self, maxsize: int = 65536) -> None:
        self._plans: dict = {}
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self.bypasses = 0

    def get(self, key):
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
        return plan

    def put(self, key, plan: Plan) -> None:
        self.misses += 1
        if len(self._plans) >= self.maxsize:
            self._plans.clear()
        self._plans[key] = plan

    def info(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "bypasses": self.bypasses, "size": len(self._plans)}


def meta_like(t: torch.Tensor, storage_nbytes: int) -> torch.Tensor:
    """A meta tensor with t's dtype, shape, stride, offset and storage size."""
    needed = elements_spanned(t.storage_offset(), t.shape, t.stride()) * t.element_size()
    storage = torch.UntypedStorage(max(storage_nbytes, needed), device=META)
    m = torch.empty(0, dtype=t.dtype, device=META).set_(storage, t.storage_offset(), t.shape, t.stride())
    bits = view_bits(t)
    if bits:
        set_view_bits(m, bits)
    return m


def import_lazy_dependencies() -> None:
    """Import what PyTorch loads on the first ops on a subclass tensor: torch._dynamo (Python meta
    kernels are wrapped to disable it, and import it on first call) and torch.distributed.tensor
    (looked up on the first __torch_dispatch__ call). Together ~1.4 s on the 2-core test machine,
    paid by the first two remote ops unless done earlier: Genie does it while an embedded daemon
    starts, when this process would only be waiting."""
    import torch._dynamo  # noqa: F401

    if torch.distributed.is_available():
        import torch.distributed.tensor  # noqa: F401


# Ops whose result layout PyTorch leaves to the backend (its meta kernels say contiguous): planned
# by the rule both ends keep (genie/transport/layout_contract.py).
def _convolution_layout(out, bound):
    return out.contiguous(memory_format=layout_contract.convolution_format(bound["input"], bound["weight"]))


def _convolution_backward_layout(out, bound):
    fmt = layout_contract.convolution_format(bound["input"], bound["weight"])
    grad_input, grad_weight, grad_bias = out
    return (None if grad_input is None else grad_input.contiguous(memory_format=fmt),
            None if grad_weight is None else grad_weight.contiguous(memory_format=fmt), grad_bias)


def _padding_layout(out, bound):
    return out.contiguous(memory_format=layout_contract.padding_format(bound["self"]))


_BACKEND_LAYOUTS = {
    torch.ops.aten.convolution.default: _convolution_layout,
    torch.ops.aten.convolution_backward.default: _convolution_backward_layout,
    **{getattr(torch.ops.aten, name).default: _padding_layout for name in layout_contract.PADDING_OPS},
}


@functools.lru_cache(maxsize=None)
def _schema_names(func) -> tuple:
    return tuple(a.name for a in func._schema.arguments)


def _check_in_bounds(t: torch.Tensor) -> None:
    """Raise as the CPU and CUDA do where a view reaches past its storage: meta kernels do not
    check (as_strided with too large an offset or strides plans fine on meta tensors), and the
    daemon's refusal would only surface at the next read."""
    needed = elements_spanned(t.storage_offset(), t.shape, t.stride()) * t.element_size()
    available = t.untyped_storage().nbytes()
    if needed > available:
        raise RuntimeError(
            f"setStorage: sizes {list(t.shape)}, strides {list(t.stride())}, storage offset {t.storage_offset()}, "
            f"and itemsize {t.element_size()} requiring a storage size of {needed} are out of bounds for "
            f"storage of size {available}")


def _replaced(v, tensor, device):
    """An op's argument with each tensor in it replaced by `tensor(t)` and the remote device by
    `device` (lists and tuples walked). Generators go: shapes and dtype rules never depend on
    one, and some meta kernels refuse one."""
    if isinstance(v, torch.Tensor):
        return tensor(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_replaced(x, tensor, device) for x in v)
    if isinstance(v, torch.device) and v.type == DEVICE_TYPE:
        return device
    if isinstance(v, torch.Generator):
        return None
    return v


# Ops whose dtype rules PyTorch checks in its kernels, not in its meta kernels, besides the
# pointwise ones: matrix products (both operands one dtype) and indexed writes and fills.
_KERNEL_CHECKED = frozenset({
    "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::addmm", "aten::addmm_", "aten::baddbmm",
    "aten::baddbmm_", "aten::addbmm", "aten::addbmm_", "aten::addmv", "aten::addmv_", "aten::mv", "aten::dot",
    "aten::vdot", "aten::addr", "aten::addr_", "aten::index_add", "aten::index_add_", "aten::index_copy",
    "aten::index_copy_", "aten::index_fill", "aten::index_fill_", "aten::masked_fill", "aten::masked_fill_",
    "aten::masked_scatter", "aten::masked_scatter_", "aten::scatter_add", "aten::scatter_add_", "aten::fill_",
})
# What those checks say: rules of dtypes (and of integer powers) that hold on every device.
# Refusals for lack of a kernel for a dtype ("not implemented for") differ between devices: raised
# here for a CPU daemon, whose kernels are the ones the stand-ins ran; left to any other daemon.
_NO_KERNEL = "not implemented for"
_DTYPE_RULES = ("can't be cast to the desired output type", "same dtype", "same scalar type", "expected scalar type",
                "only supports boolean masks", "Integers to negative integer powers are not allowed",
                "cannot be converted to type")


def _kernel_checked(func) -> bool:
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    return torch.Tag.pointwise in tags or func._schema.name in _KERNEL_CHECKED


def _kernel_dtype_refusal(func, args, kwargs, cpu_kernels: bool) -> Exception | None:
    """PyTorch checks some dtype rules in its kernels, not its meta kernels: `int_tensor.mul_(0.5)`,
    `x.add_(complex_tensor)`, `float32 @ float64`, `masked_fill_` with a float mask. The CPU and
    CUDA raise at the call; the daemon refused the op at the next read, far from the line at
    fault. The op runs here on one-element CPU stand-ins (zeros) of the same dtypes and
    dimensions, whose type promotion is the same (it depends on dtypes and on which tensors are
    0-dim), and only a refusal by such a rule is returned, with PyTorch's own message (and, for a
    daemon that runs `cpu_kernels`, one for lack of a kernel: `lt` of complex numbers). Once per
    plan: a cached plan skips it."""
    def stand_in(t):
        return torch.zeros((1,) * t.dim(), dtype=t.dtype)

    cpu = torch.device("cpu")
    try:
        func(*_replaced(args, stand_in, cpu), **{k: _replaced(v, stand_in, cpu) for k, v in kwargs.items()})
    except (RuntimeError, IndexError, TypeError, ValueError) as e:
        message = str(e)
        if any(rule in message for rule in _DTYPE_RULES) or cpu_kernels and _NO_KERNEL in message:
            return type(e)(message)
    except Exception:  # noqa: BLE001 - anything else is for the daemon's kernel to say
        pass
    return None


def _runs_cpu_kernels(flat_tensors) -> bool:
    ref = next((t._genie for t in flat_tensors if hasattr(t, "_genie")), None)
    return ref is not None and ref.stream.runs_cpu_kernels


def plan_op(func, args, kwargs, flat_tensors: list[torch.Tensor], storage_sizes: list[int]) -> Plan:
    """Run `func` on meta stand-ins of the arguments and describe its outputs."""
    metas = [meta_like(t, n) for t, n in zip(flat_tensors, storage_sizes)]
    by_id = {id(t): i for i, t in enumerate(flat_tensors)}
    meta_index = {id(m): i for i, m in enumerate(metas)}

    def meta_of(t):
        return metas[by_id[id(t)]]

    before = [(m.shape, m.stride(), m.storage_offset()) for m in metas]
    meta_args = _replaced(args, meta_of, META)
    meta_kwargs = {k: _replaced(v, meta_of, META) for k, v in kwargs.items()}
    # Meta tensors have no tangents. With a forward-AD level open (torch.func.jvp), a meta kernel
    # formatting a tensor into its error message (quantile's) asked for one below autograd and hit
    # PyTorch's internal assert in _fw_primal: plan outside any level.
    level = _forward_ad._current_level
    if level >= 0:  # torch's global: touched only while a level is open
        _forward_ad._current_level = -1
    refusal = None
    try:
        out = func(*meta_args, **meta_kwargs)
        if _kernel_checked(func) and "out" not in kwargs:  # out=: the meta kernels check its cast
            refusal = _kernel_dtype_refusal(func, args, kwargs, _runs_cpu_kernels(flat_tensors))
    except NotImplementedError as e:
        raise NeedsRemoteExecution(str(e)) from None
    except RuntimeError as e:
        msg = str(e)
        if "meta" in msg.lower() or "data-dependent" in msg or "data dependent" in msg:
            raise NeedsRemoteExecution(msg) from None
        raise
    finally:
        if level >= 0:
            _forward_ad._current_level = level
    if refusal is not None:  # raised here: a NotImplementedError above means "no meta kernel"
        raise refusal

    layout_rule = _BACKEND_LAYOUTS.get(func)
    if layout_rule is not None:
        out = layout_rule(out, dict(zip(_schema_names(func), meta_args), **meta_kwargs))

    def describe(o):
        if isinstance(o, torch.Tensor):
            idx = meta_index.get(id(o))
            if idx is not None:
                return SameAsInput(idx)
            if o.device.type != "meta":
                raise NeedsRemoteExecution("op produced a non-meta tensor")
            if o.layout != torch.strided:
                raise UnsupportedOperationError(func._schema.name, only_strided(o.layout))
            _check_in_bounds(o)
            return NewTensor(o.dtype, tuple(o.shape), tuple(o.stride()), o.storage_offset(),
                             o.untyped_storage().nbytes(), view_bits(o))
        if isinstance(o, (list, tuple)):
            return type(o)(describe(x) for x in o)
        if o is None or func._schema.name.split("::")[-1] in METADATA_ONLY_RESULTS:
            return Value(o)
        raise NeedsRemoteExecution("op returns a value that depends on data")

    outputs = describe(out)
    for m, b in zip(metas, before):
        if (m.shape, m.stride(), m.storage_offset()) != b:
            _check_in_bounds(m)
    mutations = tuple(
        (i, tuple(m.shape), tuple(m.stride()), m.storage_offset(), m.untyped_storage().nbytes())
        for i, (m, b) in enumerate(zip(metas, before))
        if (m.shape, m.stride(), m.storage_offset()) != b
    )
    return Plan(outputs, mutations)
