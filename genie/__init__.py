"""Genie: remote GPUs as a PyTorch device.

``import genie`` registers the ``remote_accelerator`` device. Tensors created on
it (or moved to it) are captured lazily, shipped to genie-daemon processes and
executed there; reading a value (``.cpu()``, ``.item()``, ``print``) or
``await genie.materialize(t)`` brings results back.

    import torch, genie
    x = torch.randn(1024, 1024, device="remote_accelerator:0")
    print(torch.relu(x @ x + 1).sum().item())

Daemons come from ``genie.init("tcp://gpu1:5555,tcp://gpu2:5555")`` or
``GENIE_SERVER_URL``; with neither, a local daemon is started on first use.
"""
from __future__ import annotations

import sys as _sys

__version__ = "0.1.0"

# A genie-daemon process imports genie.transport (the wire) and nothing of the client
# (daemon/entry.py marks it before Genie is imported): a registered remote_accelerator would become
# PyTorch's accelerator there in CUDA's place, which stops CUDA autograd (pytorch/pytorch#161129),
# and with the client loaded a GPU daemon crashed at its first cuDNN convolution.
if not getattr(_sys.modules.get("genie_daemon"), "SERVING", False):
    from . import frontend  # noqa: F401  (genie.frontend.analysis etc. reachable as attributes)
    from ._client import (analysis_cache_stats, analyze, capture, capture_stats, flush, init, materialize,
                          materialize_sync, remote_accelerator, shutdown, synchronize, transport_info,
                          transport_stats)
    from .errors import GenieConnectionError, GenieError, RemoteExecutionError, UnsupportedOperationError
    from .frontend.graphs import Graph, graph
    from .frontend.kv import KVSession
    from .frontend.lazy_tensor import LazyTensor
    from .runtime import get_runtime  # noqa: F401  (genie.get_runtime().links, ... in tests and tools)

__all__ = [
    "init", "shutdown", "flush", "capture", "analyze", "analysis_cache_stats", "materialize", "materialize_sync", "synchronize", "transport_stats", "transport_info", "capture_stats",
    "LazyTensor", "KVSession", "Graph", "graph", "GenieError", "GenieConnectionError", "RemoteExecutionError", "UnsupportedOperationError",
    "remote_accelerator",
]
