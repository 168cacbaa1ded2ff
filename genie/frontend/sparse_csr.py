"""Sparse compressed matrices on remote_accelerator (CSR, CSC, BSR, BSC): remote indices and values.

As sparse_coo.py does for COO: a tensor of layout torch.sparse_csr over three remote tensors,
each op written in dense ops the daemon runs. 2-D matrices with scalar values (no batch or
dense dimensions), which is what graph networks hand torch.sparse.mm (PyTorch Geometric turns
a COO adjacency into CSR first): made on the device (.to_sparse_csr() of a dense or COO
tensor, torch.sparse_csr_tensor) or moved there, read back (.cpu(), .to_dense(),
crow_indices / col_indices / values, .to_sparse()), scaled, multiplied elementwise by a dense
matrix, masked (sparse_mask), and multiplied with dense matrices (torch.sparse.mm, @, addmm, with
the dense operand's gradient; dense @ sparse; torch.sparse.mm(s, d, reduce) and
torch.sparse.sampled_addmm, with gradients). A transpose is CSC, as on the CPU. Anything else
is refused by name.

2-D sparse CSC matrices too (RemoteSparseCSC): a CSC matrix is the CSR matrix of its transpose,
so it holds that one's parts as they are: made (.to_sparse_csc(), torch.sparse_csc_tensor) or
moved there, read back, its transpose (CSR, no copy, as on the CPU), scaled, summed, and
multiplied with dense matrices through its COO form. And 2-D block-sparse BSR and BSC matrices
(RemoteSparseBSR / BSC): the same over blocks, values (blocks, block rows, block columns); their
COO form has every element of every stored block.
"""
from __future__ import annotations

import torch
from torch._C import DispatchKey, DispatchKeySet

from genie.errors import UnsupportedOperationError

from .meta import only_strided
from .sparse_coo import (RemoteSparse, RemoteSparseCOO, coo_addmm, coo_mm, dense_to_sparse, scaling_handlers,
                         sparse_mask, to_copy)

_aten = torch.ops.aten
_CSR_KEYS = DispatchKeySet(DispatchKey.SparseCsrPrivateUse1)


def _name(layout) -> str:
    """torch.sparse_bsc -> "BSC", as the messages name a layout."""
    return str(layout).split("_")[-1].upper()


def _only_2d(layout_name: str) -> str:
    return (f"only 2-D sparse {layout_name} matrices live on remote_accelerator (no batch or dense dimensions): "
            "keep it dense (.to_dense()) or sparse COO (.to_sparse())")


_ONLY_2D = _only_2d("CSR")


class _RemoteCompressed(RemoteSparse):
    """What a 2-D CSR or CSC matrix (BSR, BSC: over blocks) on a remote device is made of:
    compressed indices (one per row, or column, and one more), plain indices (each entry's
    column, or row), and values."""

    _layout = torch.sparse_csr

    @staticmethod
    def __new__(cls, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, size):
        # dispatch_layout: with the sparse CSR key (all compressed layouts), PyTorch asks the
        # tensor's own class for its layout.
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(size), dtype=values.dtype, layout=cls._layout,
                                                device=values.device, dispatch_layout=True,
                                                _extra_dispatch_keys=_CSR_KEYS)
        t._compressed, t._plain, t._values_ = compressed, plain, values
        return t

    def parts(self) -> list:
        return [self._compressed, self._plain, self._values_]

    def with_parts(self, parts: list) -> "_RemoteCompressed":
        return type(self)(*parts, self.shape)

    def cpu_from(self, parts: list) -> torch.Tensor:
        return torch.sparse_compressed_tensor(*parts, self.shape, layout=self._layout)

    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_sparse_tensor, (self._layout, (*self.parts(), self.shape)))


class RemoteSparseCSR(_RemoteCompressed):
    """A 2-D sparse CSR matrix on a remote device: crow_indices, col_indices, values."""

    _layout_name = "CSR"
    _layout = torch.sparse_csr
    _crow = property(lambda self: self._compressed)
    _col = property(lambda self: self._plain)

    def transposed(self) -> "RemoteSparseCSC":
        """Its transpose: the CSC matrix over the same parts (no copy), as on the CPU."""
        return RemoteSparseCSC(*self.parts(), (self.shape[1], self.shape[0]))

    def to_coo(self) -> RemoteSparseCOO:
        """The same entries as a coalesced sparse COO tensor (CSR keeps them sorted by row, then column)."""
        rows_cols = _aten._convert_indices_from_csr_to_coo.default(self._crow, self._col)
        return RemoteSparseCOO(rows_cols.long(), self._values_, self.shape, coalesced=True)

    def at_entries(self, dense: torch.Tensor) -> torch.Tensor:
        return dense[_rows_and_cols(self)]


class RemoteSparseCSC(_RemoteCompressed):
    """A 2-D sparse CSC matrix on a remote device: ccol_indices, row_indices and values, which
    are the crow, col and values of its transpose, a CSR matrix."""

    _layout_name = "CSC"
    _layout = torch.sparse_csc

    def transposed(self) -> RemoteSparseCSR:
        return RemoteSparseCSR(*self.parts(), (self.shape[1], self.shape[0]))

    def to_coo(self) -> RemoteSparseCOO:
        """The same entries as sparse COO, in the CSC's order (by column): not coalesced, as the CPU's."""
        cols_rows = _aten._convert_indices_from_csr_to_coo.default(self._compressed, self._plain)
        return RemoteSparseCOO(cols_rows.flip(0).long(), self._values_, self.shape, coalesced=False)

    def at_entries(self, dense: torch.Tensor) -> torch.Tensor:
        return self.transposed().at_entries(dense.t())


class _RemoteBlocked(_RemoteCompressed):
    """A 2-D BSR or BSC matrix: as CSR or CSC over blocks, its values (blocks, block rows, block columns)."""

    def block_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each stored block's (block row, block column), in the order of the values."""
        compressed, plain = _aten._convert_indices_from_csr_to_coo.default(self._compressed, self._plain).long()
        return (compressed, plain) if self._layout == torch.sparse_bsr else (plain, compressed)

    def to_coo(self) -> RemoteSparseCOO:
        """Every element of every stored block as a COO entry (zeros in a block included, as the CPU's)."""
        block_rows, block_cols = self.block_positions()
        bh, bw = self._values_.shape[1:]
        rows = block_rows.view(-1, 1, 1) * bh + torch.arange(bh, device=self.device).view(1, -1, 1)
        cols = block_cols.view(-1, 1, 1) * bw + torch.arange(bw, device=self.device).view(1, 1, -1)
        shape = self._values_.shape
        indices = torch.stack([rows.expand(shape).reshape(-1), cols.expand(shape).reshape(-1)])
        return RemoteSparseCOO(indices, self._values_.reshape(-1), self.shape, coalesced=False)

    def at_entries(self, dense: torch.Tensor) -> torch.Tensor:
        bh, bw = self._values_.shape[1:]
        blocks = dense.reshape(self.shape[0] // bh, bh, self.shape[1] // bw, bw).transpose(1, 2)
        return blocks[self.block_positions()]

    def transposed(self) -> "_RemoteBlocked":
        """BSR <-> BSC of the transpose: the same indices, each block transposed (a copy of the values)."""
        other = RemoteSparseBSC if self._layout == torch.sparse_bsr else RemoteSparseBSR
        return other(self._compressed, self._plain, self._values_.transpose(-2, -1).contiguous(),
                     (self.shape[1], self.shape[0]))


class RemoteSparseBSR(_RemoteBlocked):
    """A 2-D sparse BSR matrix on a remote device: crow_indices, col_indices of its blocks, and values."""

    _layout_name = "BSR"
    _layout = torch.sparse_bsr


class RemoteSparseBSC(_RemoteBlocked):
    """A 2-D sparse BSC matrix on a remote device: ccol_indices, row_indices of its blocks, and values."""

    _layout_name = "BSC"
    _layout = torch.sparse_bsc


_CLASSES = {torch.sparse_csr: RemoteSparseCSR, torch.sparse_csc: RemoteSparseCSC,
            torch.sparse_bsr: RemoteSparseBSR, torch.sparse_bsc: RemoteSparseBSC}


def _layout_of(func, bound: dict):
    """The layout a constructor makes: its `layout` argument, else its name's (sparse_bsr_tensor, ...)."""
    if bound.get("layout") is not None:
        return bound["layout"]
    name = str(func._schema.name)
    return next((layout for layout in _CLASSES if _name(layout).lower() in name), torch.sparse_csr)


def from_parts(func, args, kwargs):
    """aten::_sparse_compressed_tensor_unsafe, sparse_csr_tensor, sparse_bsc_tensor, ... with
    remote parts (torch.sparse_*_tensor, `.to()` of a CPU CSR, CSC, BSR or BSC tensor)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    layout = _layout_of(func, bound)
    compressed = next(bound[n] for n in ("crow_indices", "ccol_indices", "compressed_indices") if n in bound)
    plain = next(bound[n] for n in ("col_indices", "row_indices", "plain_indices") if n in bound)
    values = bound["values"]
    if layout not in _CLASSES:
        raise UnsupportedOperationError(str(func.name()), only_strided(f"sparse {_name(layout)}"))
    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    name = _name(layout)
    if compressed.dim() != 1 or plain.dim() != 1 or values.dim() != (3 if blocked else 1):
        raise UnsupportedOperationError(str(func.name()), _only_2d(name))
    if bound.get("size") is not None:
        size = tuple(bound["size"])
    else:  # as torch infers it: the compressed dimension from its indices, the other from the largest index (a read)
        block = tuple(values.shape[1:]) if blocked else (1, 1)
        size = (compressed.shape[0] - 1, int(plain.max()) + 1 if plain.numel() else 0)
        by_columns = layout in (torch.sparse_csc, torch.sparse_bsc)
        size = (size[1] * block[0], size[0] * block[1]) if by_columns else (size[0] * block[0], size[1] * block[1])
    if len(size) != 2:
        raise UnsupportedOperationError(str(func.name()), _only_2d(name))
    return _CLASSES[layout](compressed, plain, values.to(bound.get("dtype") or values.dtype), size)


def blocked_from_strided_or_coo(x, blocksize, dense_dim=None, layout=torch.sparse_bsr):
    """.to_sparse_bsr(blocksize) / .to_sparse_bsc(blocksize) of a dense remote matrix (or a sparse
    COO or CSR one, made dense first): the blocks that are not all zero, row-major for BSR, as the
    CPU keeps them (a read of how many there are)."""
    name = _name(layout)
    if dense_dim or x.dim() != 2 or len(blocksize) != 2:
        raise UnsupportedOperationError(f"aten::_to_sparse_{name.lower()}", _only_2d(name))
    if x.layout != torch.strided:
        x = x.to_dense()
    if layout == torch.sparse_bsc:  # the BSR of the transpose, each block transposed back
        return blocked_from_strided_or_coo(x.t(), tuple(blocksize)[::-1]).transposed()
    bh, bw = blocksize
    if x.shape[0] % bh or x.shape[1] % bw:
        raise RuntimeError(f"dense_to_sparse_bsr: tensor sparse size ({x.shape[0]},{x.shape[1]}) must be divisible "
                           f"by given blocksize ({bh},{bw})")  # the CPU's words
    blocks = x.reshape(x.shape[0] // bh, bh, x.shape[1] // bw, bw).transpose(1, 2)
    block_rows, block_cols = (blocks != 0).flatten(2).any(-1).nonzero().t()
    crow = _aten._convert_indices_from_coo_to_csr.default(block_rows, blocks.shape[0])
    return RemoteSparseBSR(crow, block_cols, blocks[block_rows, block_cols].contiguous(), x.shape)


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


def csc_from_strided_or_coo(x, dense_dim=None):
    """.to_sparse_csc() of a dense remote matrix or a remote sparse COO one: the CSR parts of its transpose."""
    if dense_dim or x.dim() != 2:
        raise UnsupportedOperationError("aten::_to_sparse_csc", _only_2d("CSC"))
    return from_strided_or_coo(x.t()).transposed()


def convert(x, layout=None, blocksize=None, dense_dim=None):
    """A remote matrix (dense, or sparse of any layout held here) in `layout`: COO (None), CSR,
    CSC, or BSR / BSC of `blocksize`; itself where it is so already."""
    name = _name(layout)
    if dense_dim:
        raise UnsupportedOperationError("aten::_to_sparse", _only_2d(name))
    if layout in (torch.sparse_bsr, torch.sparse_bsc):
        if blocksize is None:
            raise RuntimeError(f"to_sparse: conversion to Sparse{name.capitalize()} without blocksize argument "
                               "given is not supported")
        if x.layout == layout and tuple(x.values().shape[1:]) == tuple(blocksize):
            return x
        return blocked_from_strided_or_coo(x, blocksize, layout=layout)
    if blocksize is not None:
        raise RuntimeError(f"to_sparse: blocksize is only for BSR and BSC, not {name}")
    if x.layout == (layout or torch.sparse_coo):
        return x
    coo = x.to_coo() if isinstance(x, _RemoteCompressed) else x
    if layout in (None, torch.sparse_coo):
        return coo
    if layout == torch.sparse_csr:
        return from_strided_or_coo(coo)
    if layout == torch.sparse_csc:
        return csc_from_strided_or_coo(coo)
    raise UnsupportedOperationError("aten::_to_sparse", only_strided(f"sparse {name}"))


def _as_coo(cls, what: str):
    """The sparse operand of addmm, in COO form (the products are COO's); only sparse @ dense."""
    def convert(s) -> RemoteSparseCOO:
        if not isinstance(s, cls):
            raise UnsupportedOperationError(f"aten::{what}", "on remote_accelerator only sparse @ dense: convert the "
                                            "sparse operand on the right with .to_dense()")
        return s.to_coo()
    return convert


def _product(a, b):
    """a @ b with one of them a CSR, CSC, BSR or BSC matrix (in COO form for the product), the other dense."""
    return coo_mm(a.to_coo() if isinstance(a, _RemoteCompressed) else a,
                  b.to_coo() if isinstance(b, _RemoteCompressed) else b)


def _transpose(s, dim0, dim1):
    """A 2-D matrix's transpose (CSR <-> CSC), or itself (a dimension with itself)."""
    return s.transposed() if {dim0 % 2, dim1 % 2} == {0, 1} else s


def _compressed_handlers(cls) -> dict:
    """What CSR and CSC matrices do alike, in terms of their parts and their COO form."""
    to_coo = _as_coo(cls, "addmm")
    return {
        _aten.values.default: lambda s: s._values_,
        _aten._nnz.default: lambda s: s._values_.shape[0],
        _aten.sparse_dim.default: lambda s: 2,
        _aten.dense_dim.default: lambda s: 0,
        _aten._to_copy.default: to_copy,
        _aten._to_dense.default: lambda s, dtype=None, masked_grad=None: s.to_coo().to_dense().to(dtype or s.dtype),
        _aten.clone.default: lambda s, memory_format=None: s.with_parts([p.clone() for p in s.parts()]),
        _aten.detach.default: lambda s: s.with_parts(s.parts()),
        _aten.mm.default: _product,
        _aten.matmul.default: _product,
        _aten.addmm.default: lambda input, s, dense, beta=1, alpha=1: coo_addmm(input, to_coo(s), dense, beta, alpha),
        _aten._sparse_addmm.default: lambda input, s, dense, beta=1, alpha=1: coo_addmm(input, to_coo(s), dense,
                                                                                        beta, alpha),
        _aten.sum.default: lambda s, dtype=None: s._values_.sum(dtype=dtype),
        _aten.t.default: lambda s: s.transposed(),
        _aten.transpose.int: _transpose,
        _aten._to_sparse.default: convert,
        _aten._to_sparse.sparse_dim: lambda s, sparse_dim: convert(s, dense_dim=2 - sparse_dim),
        _aten._to_sparse_csr.default: lambda s, dense_dim=None: convert(s, torch.sparse_csr, None, dense_dim),
        _aten._to_sparse_csc.default: lambda s, dense_dim=None: convert(s, torch.sparse_csc, None, dense_dim),
        _aten._to_sparse_bsr.default: lambda s, blocksize, dense_dim=None: convert(s, torch.sparse_bsr, blocksize,
                                                                                   dense_dim),
        _aten._to_sparse_bsc.default: lambda s, blocksize, dense_dim=None: convert(s, torch.sparse_bsc, blocksize,
                                                                                   dense_dim),
        **scaling_handlers(cls),
    }


def _rows_and_cols(s: "RemoteSparseCSR") -> tuple[torch.Tensor, torch.Tensor]:
    """Each stored entry's row and column (CSR keeps them sorted by row, then column)."""
    rows = _aten._convert_indices_from_csr_to_coo.default(s._crow, s._col)[0].long()
    return rows, s._col.long()


def _sampled_addmm(s, mat1, mat2, beta=1, alpha=1):
    """beta * s + alpha * (mat1 @ mat2), computed only where s has entries (a CSR matrix of s's
    pattern): each entry is one row of mat1 times one column of mat2."""
    if not isinstance(s, RemoteSparseCSR) or mat1.dim() != 2 or mat2.dim() != 2:
        raise UnsupportedOperationError("aten::sparse_sampled_addmm", _ONLY_2D)
    rows, cols = _rows_and_cols(s)
    sampled = (mat1[rows] * mat2.t()[cols]).sum(-1)
    return RemoteSparseCSR(s._crow, s._col, s._values_ * beta + sampled * alpha, s.shape)


_REDUCTIONS = ("sum", "mean", "amax", "amin")


def _mm_reduce(s, other, reduce):
    """torch.sparse.mm(s, other, reduce): row i of the result reduces values[j] * other[col j]
    over row i's entries; a row without entries is 0. The second result (the CPU's positions of
    amax/amin's winners, for their gradients) is left empty: the backward finds them again."""
    if reduce not in _REDUCTIONS:
        raise RuntimeError(f"reduce argument must be either sum, mean, amax or amin, got {reduce}")
    rows, cols = _rows_and_cols(s)
    products = s._values_.unsqueeze(1) * other[cols]
    return _reduced(s, rows, products, reduce), torch.empty(0, dtype=torch.long, device=s.device)


def _reduced(s, rows, products, reduce):
    out = products.new_zeros((s.shape[0], products.shape[1]))
    return out.scatter_reduce(0, rows.unsqueeze(1).expand_as(products), products, reduce, include_self=False)


def _mm_reduce_backward(s, grad_out, other, reduce, arg_out, output_mask):
    """Each entry's share of its row's result: 1 for sum, 1 / the row's entry count for mean; for
    amax / amin, 1 for the entry that won (the first of equals, as the CPU's kernel keeps), else 0."""
    rows, cols = _rows_and_cols(s)
    grad_rows = grad_out[rows]
    if reduce == "mean":
        counts = (s._crow[1:] - s._crow[:-1]).to(grad_out.dtype)
        grad_rows = grad_rows / counts[rows].unsqueeze(1)
    elif reduce in ("amax", "amin"):
        products = s._values_.unsqueeze(1) * other[cols]
        won = products == _reduced(s, rows, products, reduce)[rows]
        entry = torch.arange(products.shape[0], device=products.device).unsqueeze(1).expand_as(products)
        candidate = torch.where(won, entry, products.shape[0])
        first = _reduced(s, rows, candidate, "amin")[rows]
        grad_rows = grad_rows * (candidate == first)
    grad_self = grad_other = None
    if output_mask[0]:
        grad_self = RemoteSparseCSR(s._crow, s._col, (grad_rows * other[cols]).sum(-1), s.shape)
    if output_mask[1]:
        grad_other = other.new_zeros(other.shape).index_add_(0, cols, s._values_.unsqueeze(1) * grad_rows)
    return grad_self, grad_other


_HANDLERS = {
    **_compressed_handlers(RemoteSparseCSR),
    torch.ops.prim.layout.default: lambda s: torch.sparse_csr,
    _aten.crow_indices.default: lambda s: s._crow,
    _aten.col_indices.default: lambda s: s._col,
    _aten.sparse_mask.default: sparse_mask,
    _aten.sparse_sampled_addmm.default: _sampled_addmm,
    _aten._sparse_mm_reduce_impl.default: _mm_reduce,
    _aten._sparse_mm_reduce_impl_backward.default: _mm_reduce_backward,
}
RemoteSparseCSR._handlers = _HANDLERS


_CSC_HANDLERS = {
    **_compressed_handlers(RemoteSparseCSC),
    torch.ops.prim.layout.default: lambda s: torch.sparse_csc,
    _aten.ccol_indices.default: lambda s: s._compressed,
    _aten.row_indices.default: lambda s: s._plain,
}
RemoteSparseCSC._handlers = _CSC_HANDLERS


def _blocked_handlers(cls) -> dict:
    return {
        **_compressed_handlers(cls),
        torch.ops.prim.layout.default: lambda s: s._layout,
        (_aten.crow_indices if cls is RemoteSparseBSR else _aten.ccol_indices).default: lambda s: s._compressed,
        (_aten.col_indices if cls is RemoteSparseBSR else _aten.row_indices).default: lambda s: s._plain,
    }


RemoteSparseBSR._handlers = _blocked_handlers(RemoteSparseBSR)
RemoteSparseBSC._handlers = _blocked_handlers(RemoteSparseBSC)
