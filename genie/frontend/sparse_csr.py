"""Sparse CSR matrices on remote_accelerator: remote crow_indices, col_indices and values.

As sparse_coo.py does for COO: a tensor of layout torch.sparse_csr over three remote tensors,
each op written in dense ops the daemon runs. 2-D matrices with scalar values (no batch or
dense dimensions), which is what graph networks hand torch.sparse.mm (PyTorch Geometric turns
a COO adjacency into CSR first): made on the device (.to_sparse_csr() of a dense or COO
tensor, torch.sparse_csr_tensor) or moved there, read back (.cpu(), .to_dense(),
crow_indices / col_indices / values, .to_sparse()), scaled, and multiplied with dense matrices
(torch.sparse.mm, @, addmm), with the dense operand's gradient. A transpose comes back as sparse
COO (a CSR matrix's transpose is CSC, which is not held here). Anything else is refused by name.
"""
from __future__ import annotations

import torch
from torch._C import DispatchKey, DispatchKeySet

from genie.errors import UnsupportedOperationError

from .meta import only_strided
from .sparse_coo import (RemoteSparse, RemoteSparseCOO, coo_addmm, coo_mm, dense_to_sparse, scaling_handlers,
                         to_copy)

_aten = torch.ops.aten
_CSR_KEYS = DispatchKeySet(DispatchKey.SparseCsrPrivateUse1)
_ONLY_2D = ("only 2-D sparse CSR matrices with scalar values live on remote_accelerator (no batch or dense "
            "dimensions): keep it dense (.to_dense()) or sparse COO (.to_sparse())")


class RemoteSparseCSR(RemoteSparse):
    """A 2-D sparse CSR matrix on a remote device."""

    _layout_name = "CSR"

    @staticmethod
    def __new__(cls, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size) -> "RemoteSparseCSR":
        # dispatch_layout: with the sparse CSR key, PyTorch asks the tensor's own class for its layout.
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(size), dtype=values.dtype, layout=torch.sparse_csr,
                                                device=values.device, dispatch_layout=True,
                                                _extra_dispatch_keys=_CSR_KEYS)
        t._crow, t._col, t._values_ = crow, col, values
        return t

    def to_coo(self) -> RemoteSparseCOO:
        """The same entries as a coalesced sparse COO tensor (CSR keeps them sorted by row, then column)."""
        rows_cols = _aten._convert_indices_from_csr_to_coo.default(self._crow, self._col)
        return RemoteSparseCOO(rows_cols.long(), self._values_, self.shape, coalesced=True)

    def parts(self) -> list:
        return [self._crow, self._col, self._values_]

    def with_parts(self, parts: list) -> "RemoteSparseCSR":
        return RemoteSparseCSR(*parts, self.shape)

    def cpu_from(self, parts: list) -> torch.Tensor:
        return torch.sparse_csr_tensor(*parts, self.shape)

    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_sparse_tensor,
                (torch.sparse_csr, (self._crow, self._col, self._values_, self.shape)))


def from_parts(func, args, kwargs):
    """aten::_sparse_compressed_tensor_unsafe / _sparse_csr_tensor_unsafe with remote parts
    (torch.sparse_csr_tensor, `.to()` of a CPU CSR tensor)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    crow = bound.get("crow_indices", bound.get("compressed_indices"))
    col = bound.get("col_indices", bound.get("plain_indices"))
    values = bound["values"]
    if bound.get("layout") not in (None, torch.sparse_csr):
        raise UnsupportedOperationError(str(func.name()), only_strided(f"sparse {str(bound['layout']).split('_')[-1].upper()}"))
    if bound.get("size") is not None:
        size = tuple(bound["size"])
    else:  # as torch infers it: rows from crow_indices, columns from the largest column index (a read)
        size = (crow.shape[0] - 1, int(col.max()) + 1 if col.numel() else 0)
    if len(size) != 2 or crow.dim() != 1 or col.dim() != 1 or values.dim() != 1:
        raise UnsupportedOperationError(str(func.name()), _ONLY_2D)
    return RemoteSparseCSR(crow, col, values.to(bound.get("dtype") or values.dtype), size)


def from_strided_or_coo(x, dense_dim=None):
    """.to_sparse_csr() of a dense remote matrix or a remote sparse COO one."""
    if dense_dim or x.dim() != 2:
        raise UnsupportedOperationError("aten::_to_sparse_csr", _ONLY_2D)
    coo = x.coalesce() if isinstance(x, RemoteSparseCOO) else dense_to_sparse(_aten._to_sparse.default, (x,), {})
    if coo.dense_dim():
        raise UnsupportedOperationError("aten::_to_sparse_csr", "a hybrid sparse COO tensor (dense dimensions) to CSR "
                                        "on remote_accelerator")
    rows, cols = coo._indices()
    crow = _aten._convert_indices_from_coo_to_csr.default(rows, x.shape[0])
    return RemoteSparseCSR(crow, cols, coo._values(), x.shape)


def _to_sparse(s, layout=None, blocksize=None, dense_dim=None):
    if layout in (None, torch.sparse_coo) and blocksize is None and not dense_dim:
        return s.to_coo()
    if layout == torch.sparse_csr and blocksize is None and not dense_dim:
        return s
    raise UnsupportedOperationError("aten::_to_sparse", only_strided(f"sparse {str(layout).split('_')[-1].upper()}"))


def _as_coo(s, what: str) -> RemoteSparseCOO:
    """The sparse operand of a product, in COO form (the products are COO's)."""
    if not isinstance(s, RemoteSparseCSR):
        raise UnsupportedOperationError(f"aten::{what}", "on remote_accelerator only sparse @ dense: convert the "
                                        "sparse operand on the right with .to_dense()")
    return s.to_coo()


_HANDLERS = {
    torch.ops.prim.layout.default: lambda s: torch.sparse_csr,
    _aten.crow_indices.default: lambda s: s._crow,
    _aten.col_indices.default: lambda s: s._col,
    _aten.values.default: lambda s: s._values_,
    _aten._nnz.default: lambda s: s._col.shape[0],
    _aten.sparse_dim.default: lambda s: 2,
    _aten.dense_dim.default: lambda s: 0,
    _aten._to_copy.default: to_copy,
    _aten._to_dense.default: lambda s, dtype=None, masked_grad=None: s.to_coo().to_dense().to(dtype or s.dtype),
    _aten._to_sparse.default: _to_sparse,
    _aten._to_sparse_csr.default: lambda s, dense_dim=None: s,
    _aten.clone.default: lambda s, memory_format=None: s.with_parts([p.clone() for p in s.parts()]),
    _aten.detach.default: lambda s: s.with_parts(s.parts()),
    _aten.mm.default: lambda s, dense: coo_mm(_as_coo(s, "mm"), dense),
    _aten.matmul.default: lambda s, dense: coo_mm(_as_coo(s, "matmul"), dense),
    _aten.addmm.default: lambda input, s, dense, beta=1, alpha=1: coo_addmm(input, _as_coo(s, "addmm"), dense,
                                                                            beta, alpha),
    _aten._sparse_addmm.default: lambda input, s, dense, beta=1, alpha=1: coo_addmm(
        input, _as_coo(s, "_sparse_addmm"), dense, beta, alpha),
    _aten.t.default: lambda s: s.to_coo().t(),
    _aten.transpose.int: lambda s, dim0, dim1: s.to_coo().transpose(dim0, dim1),
    _aten.sum.default: lambda s, dtype=None: s._values_.sum(dtype=dtype),
    **scaling_handlers(RemoteSparseCSR),
}
RemoteSparseCSR._handlers = _HANDLERS
