"""Sparse COO tensors on remote_accelerator: remote indices and values, ops in dense ops.

The daemon holds strided tensors only. A `RemoteSparseCOO` is a tensor whose layout is
torch.sparse_coo (`is_sparse` is True, as PyTorch's autograd and optimizers test) over two
remote tensors: indices (sparse_dim, nnz) int64 and values (nnz, *dense dims). Each op on it is
written here in dense ops on those two (gathers, index_put_ with accumulate, cat, unique), which
capture sends like any others. That covers what sparse gradients need, nn.Embedding(sparse=True)
and nn.EmbeddingBag(sparse=True) with SGD, Adagrad and SparseAdam, and sparse-dense products
(torch.sparse.mm, as graph networks use):
creation (torch.sparse_coo_tensor, .to_sparse(), .to() of a CPU sparse tensor), .cpu(),
coalesce, to_dense, indices/values, add / sub (sparse or dense with sparse), mul / div by a
scalar, sparse_mask, mm / addmm of a 2-D sparse and a dense matrix, t / transpose, sum, indexing
with index tensors (the gradient of the values a sparse tensor is made of), torch.save.
Anything else is refused by name, with the way out (.to_dense()).
"""
from __future__ import annotations

import math

import torch
from torch._C import DispatchKey, DispatchKeySet

from genie.errors import UnsupportedOperationError

from .meta import only_strided

_aten = torch.ops.aten
_SPARSE_KEYS = DispatchKeySet(DispatchKey.SparsePrivateUse1)


class RemoteSparse(torch.Tensor):
    """What the remote sparse layouts share: printing, and dispatch to their handlers (`_handlers`,
    {OpOverload: function}), torch.distributed's ops staged through the CPU, composite ops run as
    their decompositions, anything else refused by name."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _handlers: dict = {}
    _layout_name = ""

    def parts(self) -> list:
        """The remote tensors it is made of, values last."""
        raise NotImplementedError

    def with_parts(self, parts: list) -> "RemoteSparse":
        """The same kind of tensor, of the same size and flags, over other (remote) parts."""
        raise NotImplementedError

    def cpu_from(self, parts: list) -> torch.Tensor:
        """PyTorch's own sparse tensor of this layout over `parts` (tensors of another device: the CPU)."""
        raise NotImplementedError

    def at_entries(self, dense: torch.Tensor) -> torch.Tensor:
        """`dense` (of this tensor's shape) at each stored entry, in the order of the values."""
        raise NotImplementedError

    def __repr__(self) -> str:
        on_cpu = repr(self.cpu())
        return f"{on_cpu[:-1]}, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = cls._handlers.get(func)
        if handler is None and func.namespace == "c10d":  # torch.distributed, DDP's sparse gradients
            from .collectives import run_c10d

            return run_c10d(func, args, kwargs or {})
        if handler is None and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Reached below autograd (from inside another op's handling, e.g. `.cpu()` in a
            # collective): the ops it is made of, each handled or refused here.
            return func.decompose(*args, **(kwargs or {}))
        if handler is None:
            raise UnsupportedOperationError(
                str(func.name()), f"a sparse {cls._layout_name} tensor on remote_accelerator has only these ops: "
                f"{', '.join(sorted({str(op.name()).removeprefix('aten::') for op in cls._handlers}))}; "
                "convert with .to_dense() first")
        return handler(*args, **(kwargs or {}))


class RemoteSparseCOO(RemoteSparse):
    """A sparse COO tensor on a remote device: `indices` (sparse_dim, nnz), `values` (nnz, *dense)."""

    _layout_name = "COO"

    @staticmethod
    def __new__(cls, indices: torch.Tensor, values: torch.Tensor, size, coalesced: bool = False,
                requires_grad: bool = False) -> "RemoteSparseCOO":
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(size), dtype=values.dtype, layout=torch.sparse_coo,
                                                device=values.device, requires_grad=requires_grad,
                                                _extra_dispatch_keys=_SPARSE_KEYS)
        t._indices_, t._values_, t._coalesced = indices, values, coalesced
        return t

    @property
    def _sparse_dim(self) -> int:
        return self._indices_.shape[0]

    def parts(self) -> list:
        return [self._indices_, self._values_]

    def with_parts(self, parts: list) -> "RemoteSparseCOO":
        return RemoteSparseCOO(*parts, self.shape, self._coalesced)

    def cpu_from(self, parts: list) -> torch.Tensor:
        return torch.sparse_coo_tensor(*parts, self.shape, is_coalesced=self._coalesced)

    def at_entries(self, dense: torch.Tensor) -> torch.Tensor:
        return dense[tuple(self._indices_)]

    def __reduce_ex__(self, protocol):
        # As torch saves a sparse tensor: its indices and values (remote tensors, saved as such), rebuilt
        # by torch's own function on load (allowed with weights_only=True).
        return (torch._utils._rebuild_sparse_tensor,
                (torch.sparse_coo, (self._indices_, self._values_, self.shape, self._coalesced)))


# ------------------------------------------------------------------ creation


def from_parts(func, args, kwargs):
    """aten::_sparse_coo_tensor_with_dims_and_tensors(sparse_dim, dense_dim, size, indices, values, *,
    dtype, layout, device, pin_memory, is_coalesced) and _sparse_coo_tensor_unsafe(indices,
    values, size, ...) with remote indices and values (torch.sparse_coo_tensor, autograd's sparse
    gradients, `.to()` of a CPU sparse tensor all end here)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    indices, values, size = bound["indices"], bound["values"], tuple(bound["size"])
    if values.device != indices.device:
        raise RuntimeError(f"indices and values must be on the same device, but got {indices.device} and {values.device}")
    if indices.dim() != 2 or values.dim() != 1 + len(size) - indices.shape[0]:
        raise RuntimeError(f"sparse COO: indices {tuple(indices.shape)} and values {tuple(values.shape)} "
                           f"do not fit size {size}")
    dtype = bound.get("dtype") or values.dtype
    return RemoteSparseCOO(indices.to(torch.int64), values.to(dtype), size, bool(bound.get("is_coalesced") or False))


def dense_to_sparse(func, args, kwargs):
    """aten::_to_sparse(self, layout=None, blocksize=None, dense_dim=None) and
    _to_sparse.sparse_dim(self, sparse_dim): COO of the entries that are not all zero
    (a read of how many there are, as on any device)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    x = bound["self"]
    if bound.get("layout") in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        from .sparse_csr import convert

        return convert(x, bound["layout"], bound.get("blocksize"), bound.get("dense_dim"))
    if isinstance(x, RemoteSparseCOO):  # already COO (the backward of a CSR matrix's to_dense asks)
        if bound.get("layout") in (None, torch.sparse_coo) and bound.get("sparse_dim", x._sparse_dim) == x._sparse_dim:
            return x
        raise UnsupportedOperationError(str(func.name()), "this conversion of a sparse COO tensor on remote_accelerator")
    if bound.get("layout") not in (None, torch.sparse_coo) or bound.get("blocksize") is not None:
        raise UnsupportedOperationError(str(func.name()), only_strided(bound.get("layout")))
    sparse_dim = bound.get("sparse_dim")
    if sparse_dim is None:
        sparse_dim = x.dim() - (bound.get("dense_dim") or 0)
    nonzero = x != 0
    if sparse_dim < x.dim():
        nonzero = nonzero.flatten(sparse_dim).any(-1)
    indices = nonzero.nonzero().t().contiguous()
    return RemoteSparseCOO(indices, x[tuple(indices)], x.shape, coalesced=True)


def embedding_bag_backward(bound: dict):
    """aten::_embedding_bag_backward's arguments (by name) with sparse=True: its kernel for every
    device runs the composite sparse path, whose ops capture makes into a RemoteSparseCOO."""
    bound = {k: v for k, v in bound.items() if k not in ("sparse", "maximum_indices")}
    indices, offsets = bound["indices"], bound["offsets"]
    if indices.dtype != offsets.dtype:  # promoteIndicesAndOffsets, as the kernel does
        bound.update(indices=indices.long(), offsets=offsets.long())
    # offset2bag has one entry per index, as on CUDA (a CPU daemon's forward gives it so:
    # daemon/cuda_parity.py), so the kernel's step that makes it when empty is not needed here.
    return _aten._embedding_bag_sparse_backward.default.decompose(**bound)


# ------------------------------------------------------------------ reading it


def _linear(s: RemoteSparseCOO) -> torch.Tensor:
    """Each entry's position in the sparse dimensions, row-major (int64)."""
    sizes = s.shape[:s._sparse_dim]
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    weights = torch.tensor(strides, dtype=torch.int64).to(s.device)
    return (s._indices_ * weights.unsqueeze(1)).sum(0)


def _coalesce(s: RemoteSparseCOO) -> RemoteSparseCOO:
    """Unique indices in row-major order, the values of repeated ones summed (as the CPU's)."""
    if s._coalesced:
        return s
    sizes = s.shape[:s._sparse_dim]
    if s._indices_.shape[1] == 0 or not sizes:
        values = s._values_.sum(0, keepdim=True) if not sizes and s._values_.shape[0] else s._values_
        return RemoteSparseCOO(s._indices_[:, :values.shape[0]], values, s.shape, coalesced=True)
    unique, inverse = torch.unique(_linear(s), sorted=True, return_inverse=True)
    values = s._values_.new_zeros((unique.shape[0], *s._values_.shape[1:])).index_add_(0, inverse, s._values_)
    rows = [(unique // math.prod(sizes[d + 1:])) % sizes[d] for d in range(len(sizes))]
    return RemoteSparseCOO(torch.stack(rows), values, s.shape, coalesced=True)


def _checked_coalesced(what: str):
    def read(s):
        if not s._coalesced:
            raise RuntimeError(f"Cannot get {what} on an uncoalesced tensor, please call .coalesce() first")
        return s._indices_ if what == "indices" else s._values_
    return read


def _to_dense(s, dtype=None, masked_grad=None):
    dense = s._values_.new_zeros(s.shape, dtype=dtype or s.dtype)
    if s._indices_.shape[1]:
        dense.index_put_(tuple(s._indices_), s._values_.to(dense.dtype), accumulate=True)
    return dense


def to_copy(s, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    """aten::_to_copy of a remote sparse tensor (of either layout): its values cast, its parts moved."""
    if layout not in (None, s.layout):
        raise UnsupportedOperationError("aten::_to_copy", f"a sparse {s._layout_name} tensor to layout {layout}: "
                                        "use .to_dense()")
    parts = s.parts()
    if dtype is not None:
        parts[-1] = parts[-1].to(dtype)
    device = torch.device(device) if device is not None else s.device
    if device.type == s.device.type:
        return s.with_parts([p.to(device) for p in parts])
    if device.type == "cpu":  # every part in one round trip
        from .materialize import to_cpu_many

        return to_cpu_many([s.with_parts(parts)])[0]
    return s.cpu_from([p.to(device) for p in parts])


# ------------------------------------------------------------------ arithmetic


def _scalar(other) -> bool:
    return not isinstance(other, torch.Tensor) or other.dim() == 0


def _add(a, b, alpha=1, out_place=True):
    """a + alpha * b: sparse + sparse stays sparse (indices joined, not coalesced, as on CUDA);
    dense + sparse is dense (sparse entries accumulated into a copy, or into `a` in place)."""
    if isinstance(a, RemoteSparseCOO) and isinstance(b, RemoteSparseCOO):
        if a.shape != b.shape:
            raise RuntimeError(f"add: expected sizes of 'self' and 'other' to match, but {tuple(a.shape)} != {tuple(b.shape)}")
        values = b._values_ if alpha == 1 else b._values_ * alpha
        indices, values = torch.cat([a._indices_, b._indices_], 1), torch.cat([a._values_, values.to(a.dtype)])
        if out_place:
            return RemoteSparseCOO(indices, values, a.shape)
        a._indices_, a._values_, a._coalesced = indices, values, False
        return a
    if isinstance(b, RemoteSparseCOO) and not isinstance(a, RemoteSparseCOO):
        if tuple(a.shape) != tuple(b.shape):
            raise RuntimeError(f"add: expected 'self' and 'other' to have same size, but self has size "
                               f"{list(a.shape)} while other has size {list(b.shape)}")
        target = a.clone() if out_place else a
        if b._indices_.shape[1]:
            values = b._values_ if alpha == 1 else b._values_ * alpha
            target.index_put_(tuple(b._indices_), values.to(target.dtype), accumulate=True)
        return target
    raise UnsupportedOperationError("aten::add", "a sparse COO tensor plus a dense one on remote_accelerator: "
                                    "write dense + sparse, or convert with .to_dense()")


def scaled(s, factor, op: str):
    """A remote sparse tensor (of either layout) times or divided by a scalar: its values scaled.
    Times a dense tensor of its shape (or one that broadcasts to it), as on the CPU: each value by
    the dense tensor's element at that entry, the result sparse with the same entries."""
    if not isinstance(factor, RemoteSparse) and not _scalar(factor) and op == "mul" \
            and torch.broadcast_shapes(s.shape, factor.shape) == s.shape:
        *indices, values = s.parts()
        return s.with_parts([*indices, values * s.at_entries(factor.expand(s.shape))])
    if isinstance(factor, RemoteSparse) or not _scalar(factor):
        raise UnsupportedOperationError(f"aten::{op}", f"a sparse {s._layout_name} tensor {op} a tensor on "
                                        "remote_accelerator: only a scalar (or a 0-dim tensor), or times a dense "
                                        "tensor of its shape")
    *indices, values = s.parts()
    return s.with_parts([*indices, values * factor if op == "mul" else values / factor])


def scaling_handlers(cls) -> dict:
    """mul / div / neg of `cls` by scalars (mul by dense tensors too), the sparse operand on either side of mul."""
    return {
        _aten.mul.Tensor: lambda a, b: scaled(a, b, "mul") if isinstance(a, cls) else scaled(b, a, "mul"),
        _aten.mul.Scalar: lambda a, b: scaled(a, b, "mul"),
        _aten.div.Tensor: lambda a, b: scaled(a, b, "div"),
        _aten.div.Scalar: lambda a, b: scaled(a, b, "div"),
        _aten.neg.default: lambda a: scaled(a, -1, "mul"),
    }


def _in_place(op):
    def apply(s, other, **kwargs):
        result = op(s, other, **kwargs)
        s._indices_, s._values_, s._coalesced = result._indices_, result._values_, result._coalesced
        return s
    return apply


def sparse_mask(dense, mask):
    """dense's values where mask (of either layout) has entries, as a sparse tensor of mask's
    layout and entries (`dense` may be sparse itself: a gradient of sampled_addmm is)."""
    if tuple(dense.shape) != tuple(mask.shape):
        raise RuntimeError("sparse_mask(): operands have incompatible sizes")
    if isinstance(dense, RemoteSparse):
        dense = dense.to_dense()
    *indices, _ = mask.parts()
    return mask.with_parts([*indices, mask.at_entries(dense)])


def _matrix(s, what: str) -> None:
    if s.dim() != 2 or s._sparse_dim != 2:
        raise UnsupportedOperationError(f"aten::{what}", "only a 2-D sparse COO matrix (no dense dimensions) "
                                        "times a dense matrix on remote_accelerator")


def coo_mm(s, dense):
    """A 2-D sparse COO matrix @ a dense matrix (a sparse CSR one's too, through its COO form), or
    a dense matrix @ a sparse one: (sparse.t() @ dense.t()).t(), dense as on the CPU."""
    if isinstance(dense, RemoteSparseCOO) and isinstance(s, torch.Tensor) and s.layout == torch.strided:
        if s.dim() != 2 or s.shape[1] != dense.shape[0]:
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({'x'.join(map(str, s.shape))} and "
                               f"{dense.shape[0]}x{dense.shape[1]})")
        return coo_mm(_transpose(dense), s.t()).t().contiguous()
    if not isinstance(s, RemoteSparseCOO) or not isinstance(dense, torch.Tensor) or dense.layout != torch.strided:
        raise UnsupportedOperationError("aten::mm", "on remote_accelerator only sparse @ dense: convert the sparse "
                                        "operand on the right with .to_dense()")
    _matrix(s, "mm")
    if dense.dim() != 2 or dense.shape[0] != s.shape[1]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({s.shape[0]}x{s.shape[1]} and "
                           f"{'x'.join(map(str, dense.shape))})")
    rows, cols = s._indices_
    out = dense.new_zeros((s.shape[0], dense.shape[1]))
    return out.index_add_(0, rows, s._values_.unsqueeze(1) * dense[cols])


def _matmul(a, b):
    if a.dim() != 2 or b.dim() != 2 or isinstance(a, RemoteSparseCOO) == isinstance(b, RemoteSparseCOO):
        raise UnsupportedOperationError("aten::matmul", "on remote_accelerator only a 2-D sparse matrix @ a dense "
                                        "matrix: convert the other sparse operand with .to_dense()")
    return coo_mm(a, b)


def coo_addmm(input, s, dense, beta=1, alpha=1):
    """beta * input + alpha * (s @ dense); input unread when beta is 0, as torch's addmm."""
    product = coo_mm(s, dense)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (input if beta == 1 else input * beta)


def _transpose(s, dim0=0, dim1=1):
    d = s.dim()
    dim0, dim1 = dim0 % d, dim1 % d
    if max(dim0, dim1) >= s._sparse_dim:
        raise UnsupportedOperationError("aten::transpose", "transposing a dense dimension of a sparse COO tensor "
                                        "on remote_accelerator")
    order = list(range(s._sparse_dim))
    order[dim0], order[dim1] = order[dim1], order[dim0]
    size = list(s.shape)
    size[dim0], size[dim1] = size[dim1], size[dim0]
    return RemoteSparseCOO(s._indices_[order], s._values_, size)


def _index(s, indices):
    """s[i0, i1, ...] with index tensors (autograd's backward of the values of a sparse tensor
    made from them): the dense tensor's entries there."""
    return _to_dense(s)[tuple(indices)]


def _copy_(dst, src, non_blocking=False):
    """A sparse tensor's copy_ of another: it takes the other's entries (a collective's result)."""
    if not (dst.is_sparse and src.is_sparse):
        raise UnsupportedOperationError("aten::copy_", "between a sparse COO and a dense tensor on "
                                        "remote_accelerator: use .to_dense() or .to_sparse()")
    if dst.shape != src.shape:
        raise RuntimeError(f"copy_: sizes {tuple(dst.shape)} and {tuple(src.shape)} differ")
    dst._indices_ = src._indices().to(dst.device)
    dst._values_ = src._values().to(device=dst.device, dtype=dst.dtype)
    dst._coalesced = src.is_coalesced()
    return dst


def _to_compressed(layout):
    """COO to CSR, CSC, BSR or BSC (sparse_csr.py holds those)."""
    def convert_to(s, *args, **kwargs):
        from .sparse_csr import convert

        blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
        bound = dict(zip(("blocksize", "dense_dim") if blocked else ("dense_dim",), args), **kwargs)
        return convert(s, layout, bound.get("blocksize"), bound.get("dense_dim"))
    return convert_to


def _zero_(s):
    s._indices_ = s._indices_[:, :0]
    s._values_ = s._values_[:0]
    s._coalesced = True
    return s


def _sum(s, dtype=None):
    return s._values_.sum(dtype=dtype)


_HANDLERS = {
    _aten._indices.default: lambda s: s._indices_,
    _aten._values.default: lambda s: s._values_,
    _aten.indices.default: _checked_coalesced("indices"),
    _aten.values.default: _checked_coalesced("values"),
    _aten._nnz.default: lambda s: s._indices_.shape[1],
    _aten.sparse_dim.default: lambda s: s._sparse_dim,
    _aten.dense_dim.default: lambda s: s.dim() - s._sparse_dim,
    _aten.is_coalesced.default: lambda s: s._coalesced,
    _aten._coalesced_.default: lambda s, coalesced: (setattr(s, "_coalesced", coalesced), s)[1],
    _aten.coalesce.default: _coalesce,
    _aten._coalesce.default: _coalesce,
    _aten._to_dense.default: _to_dense,
    _aten._to_copy.default: to_copy,
    _aten.clone.default: lambda s, memory_format=None: s.with_parts([p.clone() for p in s.parts()]),
    _aten.detach.default: lambda s: s.with_parts(s.parts()),
    _aten.add.Tensor: lambda a, b, alpha=1: _add(a, b, alpha),
    _aten.add_.Tensor: lambda a, b, alpha=1: _add(a, b, alpha, out_place=False),
    _aten.sub.Tensor: lambda a, b, alpha=1: _add(a, b, -alpha),
    _aten.sub_.Tensor: lambda a, b, alpha=1: _add(a, b, -alpha, out_place=False),
    _aten.sparse_mask.default: sparse_mask,
    _aten.mm.default: coo_mm,
    _aten.addmm.default: coo_addmm,
    _aten._sparse_addmm.default: coo_addmm,  # torch.sparse.mm(sparse, dense)
    _aten.matmul.default: _matmul,
    _aten.t.default: lambda s: _transpose(s, 0, 1),
    _aten.transpose.int: _transpose,
    _aten.zero_.default: _zero_,
    _aten._to_sparse_csr.default: _to_compressed(torch.sparse_csr),
    _aten._to_sparse_csc.default: _to_compressed(torch.sparse_csc),
    _aten._to_sparse_bsr.default: _to_compressed(torch.sparse_bsr),
    _aten._to_sparse_bsc.default: _to_compressed(torch.sparse_bsc),
    _aten._to_sparse.default: lambda *args, **kwargs: dense_to_sparse(_aten._to_sparse.default, args, kwargs),
    _aten._to_sparse.sparse_dim: lambda *args, **kwargs: dense_to_sparse(_aten._to_sparse.sparse_dim, args, kwargs),
    _aten.copy_.default: _copy_,
    _aten.index.Tensor: _index,
    _aten.sum.default: _sum,
    _aten.mul_.Tensor: _in_place(lambda s, f: scaled(s, f, "mul")),
    _aten.mul_.Scalar: _in_place(lambda s, f: scaled(s, f, "mul")),
    _aten.div_.Tensor: _in_place(lambda s, f: scaled(s, f, "div")),
    _aten.div_.Scalar: _in_place(lambda s, f: scaled(s, f, "div")),
    **scaling_handlers(RemoteSparseCOO),
}
RemoteSparseCOO._handlers = _HANDLERS
