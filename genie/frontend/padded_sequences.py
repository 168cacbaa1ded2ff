"""nn.TransformerEncoder's nested fast path on remote_accelerator, kept dense.

In eval mode, given a `src_key_padding_mask`, nn.TransformerEncoder packs its input into a
strided nested tensor (`torch._nested_tensor_from_mask`), runs each layer's fused kernel
(`torch._transformer_encoder_layer_fwd`) on the sequences at their own lengths, and pads the
result back (`to_padded_tensor(0.0, ...)`). Strided nested tensors are a C++ tensor type that
cannot live on the daemon. Here that nested tensor is a `PaddedSequences`: the padded batch and
each sequence's length, both remote. Each layer runs the same fused kernel on the padded batch
with the lengths as its key padding mask: real positions get the values the nested kernel gives
them (padded keys are never attended; the rest of the layer works position by position), and
`to_padded_tensor` writes the padding value over the other positions, as the nested path returns.
Anything else done to a PaddedSequences is refused by name.
"""
from __future__ import annotations

import torch

from genie.errors import UnsupportedOperationError

_aten = torch.ops.aten


class PaddedSequences(torch.Tensor):
    """A batch of sequences of several lengths, (B, S, E) padded, standing for a nested tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, padded: torch.Tensor, lengths: torch.Tensor) -> "PaddedSequences":
        t = torch.Tensor._make_wrapper_subclass(cls, padded.shape, strides=padded.stride(), dtype=padded.dtype,
                                                device=padded.device, requires_grad=False)
        t._padded, t._lengths = padded, lengths
        return t

    def padding_mask(self) -> torch.Tensor:
        """(B, S) bool, True at positions past a sequence's length (key padding mask convention)."""
        positions = torch.arange(self._padded.shape[1], device=self._padded.device)
        return positions >= self._lengths.unsqueeze(1)

    def longest(self) -> int:
        """The longest sequence's length (a read from the daemon)."""
        return int(self._lengths.max()) if self._lengths.numel() else 0

    def __repr__(self) -> str:
        b, s, e = self.shape
        return f"PaddedSequences(batch={b}, max_length={s}, features={e}, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is None:
            raise UnsupportedOperationError(
                str(func.name()), "nested tensors are not supported on remote_accelerator; Genie runs only "
                "nn.TransformerEncoder's nested fast path (eval mode with a src_key_padding_mask), padded")
        return handler(*args, **(kwargs or {}))


def from_mask(func, args, kwargs):
    """`torch._nested_tensor_from_mask(t, mask, mask_check=True)` of a remote `t`, with the CPU's checks.
    The nested tensor's i-th sequence is t[i, :mask[i].sum()] whatever the mask's layout (the kernel
    takes that many leading positions; only mask_check asks that they be the True ones)."""
    t, mask, *rest = args
    mask_check = kwargs.get("mask_check", rest[0] if rest else True)
    if mask.dtype != torch.bool:
        raise RuntimeError(f"Expected mask to be of ScalarType Bool, but got {_scalar_type(mask.dtype)} instead.")
    if mask.dim() != 2:
        raise RuntimeError("Padding mask should be 2D")
    if t.dim() != 3:
        raise RuntimeError("Input should be a 3D tensor, N * L * D")
    if tuple(mask.shape) != tuple(t.shape[:2]):
        raise RuntimeError("Mask size should match input size")
    mask = mask.to(t.device)
    if mask_check and not bool(_aten._nested_tensor_from_mask_left_aligned(t, mask)):
        raise RuntimeError("Mask must be left-aligned without gaps")
    return PaddedSequences(t, mask.sum(dim=1))


def _encoder_layer(src, embed_dim, num_heads, *rest):
    """The fused encoder layer on the padded batch, the lengths as its key padding mask. `rest`: the
    schema's 15 weights and flags (qkv_weight .. ffn_bias_2), then `mask` and `mask_type` if given."""
    weights_and_flags, mask = rest[:15], (rest[15] if len(rest) > 15 else None)
    if mask is not None or any(isinstance(a, PaddedSequences) for a in weights_and_flags):
        raise UnsupportedOperationError(
            "aten::_transformer_encoder_layer_fwd", "a nested input with an attention mask is not supported on "
            "remote_accelerator (nn.TransformerEncoder passes none on its nested fast path)")
    padded = src.padding_mask()
    # Zeros at padded positions: what sits there is never attended, but a NaN or inf there would
    # still reach real positions through the attention product (0 * inf), which the nested kernel never sees.
    values = src._padded.masked_fill(padded.unsqueeze(-1), 0)
    out = _aten._transformer_encoder_layer_fwd.default(values, embed_dim, num_heads, *weights_and_flags,
                                                       padded, 1)  # mask type 1: key padding
    return PaddedSequences(out, src._lengths)


def _to_padded(nested, padding, output_size=None):
    """The padded batch with `padding` past each length, in `output_size` (by default the longest
    sequence's: a read of the lengths, as the nested tensor's own size is)."""
    out = nested._padded.masked_fill(nested.padding_mask().unsqueeze(-1), padding)
    b, s, e = out.shape
    if output_size is None:
        return out[:, :nested.longest()]
    if len(output_size) != 3:
        raise RuntimeError("Length of output_size does not match NestedTensor dims. Broadcasting is not supported.")
    length_needed = s if output_size[1] >= s else nested.longest()  # the lengths read only where they decide
    if output_size[0] < b or output_size[1] < length_needed or output_size[2] < e:
        raise RuntimeError("Value in output_size is less than NestedTensor padded size. Truncation is not supported.")
    if tuple(output_size) == (b, s, e):
        return out
    out = out[:, :min(s, output_size[1])]
    full = out.new_full(tuple(output_size), padding)
    full[:b, :out.shape[1], :e] = out
    return full


def _scalar_type(dtype: torch.dtype) -> str:
    """PyTorch's C++ name of a dtype, as its messages print it (torch.float32 -> Float)."""
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
            torch.uint8: "Byte"}.get(dtype, str(dtype).removeprefix("torch."))


_HANDLERS = {
    _aten._transformer_encoder_layer_fwd.default: _encoder_layer,
    _aten.to_padded_tensor.default: _to_padded,
}
