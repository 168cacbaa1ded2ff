"""flex_attention's device check, letting remote tensors through (see flex_attention.py).

The one Genie module torch.compile traces: dynamo reads this check when it compiles
flex_attention for CPU or CUDA tensors, so while dynamo traces it is PyTorch's check alone
(every other Genie module is on dynamo's skip list, and a skipped call in the middle of
flex_attention would break its graph, an error under fullgraph=True).
"""
from __future__ import annotations

import threading

import torch

from .lazy_tensor import LazyTensor

call = threading.local()  # .remote: the flex_attention call last checked on this thread has remote inputs


def validating_remote_calls(validate):
    def _validate_device(query, key, value) -> None:
        if torch.compiler.is_compiling():
            return validate(query, key, value)
        call.remote = any(isinstance(t, LazyTensor) for t in (query, key, value))
        if not call.remote:
            validate(query, key, value)

    _validate_device._genie_wraps = validate
    return _validate_device
