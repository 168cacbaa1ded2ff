"""Ops a CPU daemon runs as CUDA runs them: dtypes CUDA's kernels take and the CPU's refuse, and
results whose sizes differ on the CPU.

Programs choose their code path by device type, and remote_accelerator is not "cpu": they take
the path they take on a GPU. Hugging Face's mixture-of-experts layers (Mixtral, Qwen-MoE, ...)
count tokens per expert with torch.histc of int32 expert ids on any device but the CPU and MPS,
whose histc has no integer kernel; a CPU daemon then failed ('"histogram_cpu" not implemented
for 'Int''). Here such an op runs on a CPU daemon in a floating dtype the CPU kernel takes,
exact for the values involved, and returns what CUDA's kernel returns (its dtype, its values).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def histc(input, bins=100, min=0, max=0):  # noqa: A002 - the op's own argument names
    if input.device.type != "cpu" or input.is_floating_point():
        return aten.histc.default(input, bins, min, max)
    # CUDA's integer histc: the bin of x is (x - min) * bins // (max - min), counts in the input's
    # dtype; float64 holds every int32 exactly, and its bins are the same.
    return aten.histc.default(input.double(), bins, min, max).to(input.dtype)


_MODE_MAX = 2


def _embedding_bag_like_cuda(op):
    """aten::_embedding_bag(_forward_only) with CUDA's auxiliary results, which the client plans (torch's
    meta kernel gives them for every device but the CPU): offset2bag one per index (the CPU's fast
    path for sums leaves it empty), bag_size one per offset (the CPU's one per bag: one fewer with
    include_last_offset; the last left 0), max_indices empty unless mode is max, all of the
    indices' dtype. Without this the client's idea of their sizes was wrong, and
    nn.EmbeddingBag(sparse=True)'s backward, which the client computes from them, read an empty
    offset2bag."""
    def run(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False, per_sample_weights=None,
            include_last_offset=False, padding_idx=-1):
        output, offset2bag, bag_size, max_indices = op(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
                                                       per_sample_weights, include_last_offset, padding_idx)
        if weight.device.type != "cpu":
            return output, offset2bag, bag_size, max_indices
        if offset2bag.numel() != indices.numel():
            # The kernel's own make_offset2bag: a 1 at each bag's first index, cumulated.
            offset2bag = torch.zeros(indices.numel() + 1, dtype=torch.int64).index_add_(
                0, offsets.long(), torch.ones_like(offsets, dtype=torch.int64))
            offset2bag[0] -= 1
            offset2bag = offset2bag.cumsum(0)[:indices.numel()]
        if bag_size.shape[0] != offsets.shape[0]:
            bag_size = torch.cat([bag_size, bag_size.new_zeros(offsets.shape[0] - bag_size.shape[0])])
        if mode != _MODE_MAX:
            max_indices = indices.new_empty(0)
        return output, offset2bag.to(indices.dtype), bag_size.to(indices.dtype), max_indices.to(indices.dtype)

    return run


REPLACED = {"aten::histc": histc,
            "aten::_embedding_bag": _embedding_bag_like_cuda(aten._embedding_bag.default),
            "aten::_embedding_bag_forward_only": _embedding_bag_like_cuda(aten._embedding_bag_forward_only.default)}


def replacement(name: str):
    return REPLACED.get(name)
