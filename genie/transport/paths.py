"""Which data paths this process can use, for `genie.transport_info()` and the logs.

Looks for the libraries a GPUDirect RDMA path would need (UCX through `ucxx` or
`ucp`, NVIDIA's `nixl`) and for CUDA and CuPy, without importing any of them
(`find_spec` only locates a module). Genie has no RDMA transport of its own
yet: when such a library is present the report says it was found and not used,
so nobody mistakes the TCP path for GPUDirect.
"""
from __future__ import annotations

import importlib.util

RDMA_LIBRARIES = ("ucxx", "ucp", "nixl")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def local_capabilities() -> dict:
    import torch

    found = [name for name in RDMA_LIBRARIES if _importable(name)]
    if found:
        rdma = f"{', '.join(found)} found but not used: Genie has no RDMA transport yet; data goes over sockets"
    else:
        rdma = "none: no UCX (ucxx/ucp) or NIXL library is importable; data goes over sockets"
    return {
        "rdma_libraries": found,
        "gpudirect_rdma": rdma,
        "cuda": torch.cuda.is_available(),
        "cupy": _importable("cupy"),
    }
