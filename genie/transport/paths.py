"""Which data paths this process can use, for `genie.transport_info()` and the logs.

Looks for the libraries an RDMA path would need (UCX through `ucxx` or `ucp`, NVIDIA's
`nixl`) and for CUDA and CuPy, and says whether Genie's UCX lane (ucx_lane, through
`ucxx`) is used here and why not when it is not, so nobody mistakes the TCP path for RDMA.
The UCX lane moves host memory: GPU tensors are staged through pinned host buffers on the
way (GPUDirect, the NIC reading GPU memory itself, is not used), and NIXL is not used.
"""
from __future__ import annotations

import importlib.util

RDMA_LIBRARIES = ("ucxx", "ucp", "nixl")


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def local_capabilities(ucx_mode: str = "auto") -> dict:
    import torch

    from .ucx_lane import rdma_devices, wanted

    found = [name for name in RDMA_LIBRARIES if importable(name)]
    use, why = wanted(ucx_mode)
    return {
        "rdma_libraries": found,
        "rdma_devices": rdma_devices(),
        "ucx_lane": why if use else f"not used: {why}; bulk data goes over sockets",
        "gpudirect_rdma": "no: the UCX lane moves host memory (GPU tensors are staged through pinned host buffers)",
        "cuda": torch.cuda.is_available(),
        "cupy": importable("cupy"),
    }
