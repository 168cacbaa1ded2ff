"""Test helper: the plan meta execution gives for a call on CPU tensors (what capture's walk
would hand genie.frontend.meta.plan_op)."""
import torch

from genie.frontend import meta


def meta_plan(func, args: tuple, kwargs: dict):
    tensors, seen = [], set()
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                tensors.append(t)
    return meta.plan_op(func, args, kwargs, tensors, [t.untyped_storage().nbytes() for t in tensors])
