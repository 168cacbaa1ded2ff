"""The ATen ops named "unsafe", run as their bounds-checked equivalents.

`_unsafe_index`, `_unsafe_index_put`, `_unsafe_masked_index` and
`_unsafe_masked_index_put_accumulate` promise no bounds checks (they exist for compilers), and an
`unsafe=True` argument (`segment_reduce`, `_index_put_impl_`) switches an op's checks off. A daemon
must not read or write outside a client's tensors, so it refused them all. Each has an equivalent
that checks: the same results for inputs within bounds, and an error otherwise. That is what runs
here: `index` / `index_put`, the masked ones as ATen composes them (indices clamped, then the
checked op), and ops with `unsafe` given False (ops.check_call). Their own kernels never run.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _clamped(self: torch.Tensor, indices: list) -> list:
    # As ATen's masked ops do: positions the mask drops may hold any index.
    return [None if index is None else index.clamp(-self.size(dim), self.size(dim) - 1)
            for dim, index in enumerate(indices)]


def _index(self, indices):
    return aten.index.Tensor(self, indices)


def _index_put(self, indices, values, accumulate=False):
    return aten.index_put.default(self, indices, values, accumulate)


def _masked_index(self, mask, indices, fill):
    if self.numel() == 0:  # nothing to index: every position is the fill
        shape = torch.empty_like(self, device="meta")[[None if i is None else i.to("meta") for i in indices]].shape
        return self.new_full(shape, fill)
    return aten.index.Tensor(self, _clamped(self, indices)).masked_fill(mask.logical_not(), fill)


def _masked_index_put_accumulate(self, mask, indices, values):
    if self.numel() == 0:
        return self.clone()
    return aten.index_put.default(self, _clamped(self, indices), values.masked_fill(mask.logical_not(), 0), True)


# Keyed by the resolved overload, not by the name a client sent ("aten::x" and "aten::x.default"
# are one op). Every overload of these ops is here: ops.resolve refuses any it does not find.
REPLACED = {
    aten._unsafe_index.Tensor: _index,
    aten._unsafe_index.Tensor_hacked_twin: _index,
    aten._unsafe_index_put.default: _index_put,
    aten._unsafe_index_put.hacked_twin: _index_put,
    aten._unsafe_masked_index.default: _masked_index,
    aten._unsafe_masked_index_put_accumulate.default: _masked_index_put_accumulate,
}
UNSAFE_OPS = frozenset({"aten::_unsafe_index", "aten::_unsafe_index_put", "aten::_unsafe_masked_index",
                        "aten::_unsafe_masked_index_put_accumulate"})


def replacement(op: torch._ops.OpOverload):
    return REPLACED.get(op)
