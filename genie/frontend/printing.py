"""What print(t) / repr(t) of a remote tensor fetches: the values PyTorch shows, not the tensor.

PyTorch prints a tensor of more than PRINT_OPTS.threshold elements (1,000) summarized: along
each dimension longer than twice PRINT_OPTS.edgeitems (3) only the first and last edgeitems,
and it reads only those (torch._tensor_str: get_summarized_data and the recursive formatter);
a CUDA tensor's print copies just them. Fetching the whole tensor to print it instead moved
every byte: a model's logits (8 x 1024 x 50,257 floats) are 1.6 GB to show 27 numbers.
"""
from __future__ import annotations

import itertools

import torch

from .materialize import to_cpu, to_cpu_many
from .subclasses import program_class

# torch's printing converts these to float16 first (_tensor_str), which would touch every element.
_SHOWN_AS_HALF = frozenset(getattr(torch, name) for name in (
    "float8_e5m2", "float8_e5m2fnuz", "float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, name))


def printable(t) -> torch.Tensor:
    """A CPU tensor that prints as `t` does. When torch prints t whole, t's values; else a tensor
    of t's shape holding t's values at every position torch's print shows, fetched in one round
    trip as the blocks of first and last edge items. The rest of it is memory never written,
    which the operating system does not back until it is touched, and printing never touches it."""
    options = torch._tensor_str.PRINT_OPTS
    if t.numel() <= options.threshold or t.dim() == 0:
        return to_cpu(t)
    edge = options.edgeitems
    ranges = [((slice(0, edge), slice(n - edge, n)) if n > 2 * edge else (slice(0, n),)) for n in t.shape]
    blocks = list(itertools.product(*ranges))
    with torch.no_grad():
        values = to_cpu_many([t[block] for block in blocks])
    dtype = torch.float16 if t.dtype in _SHOWN_AS_HALF else t.dtype
    shown = torch.empty(t.shape, dtype=dtype)
    for block, value in zip(blocks, values):
        shown[block] = value
    return shown


def remote_repr(t) -> str:
    """repr(t) of a remote tensor: torch's text for its values, with its device (and grad_fn)."""
    shown = printable(t)
    cls = program_class(t)
    if cls is not None and cls.__repr__ is torch.Tensor.__repr__:
        shown = shown.as_subclass(cls)  # torch names it in the text: Boxes([...])
    text = repr(shown)
    if shown.dtype != t.dtype:  # an FP8 tensor shown through float16: name its own dtype
        text = text.replace(f"dtype={shown.dtype}", f"dtype={t.dtype}")
    suffix = f", device='{t.device}'"
    grad_fn = t.grad_fn
    if grad_fn is not None:  # as torch prints it: the node that made the tensor, else the flag
        name = type(grad_fn).__name__
        if name == "CppFunction":
            name = grad_fn.name().rsplit("::", 1)[-1]
        suffix += f", grad_fn=<{name}>"
    elif t.requires_grad:
        suffix += ", requires_grad=True"
    return text[:-1] + suffix + ")"
