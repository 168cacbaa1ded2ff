"""Which data paths this process can use, for `genie.transport_info()` and the logs.

Looks for the libraries an RDMA path would need (UCX through `ucxx` or `ucp`, NVIDIA's
`nixl`) and for CUDA and CuPy, and says whether Genie's UCX lane (ucx_lane, through
`ucxx`) is used here and why not when it is not, so nobody mistakes the TCP path for RDMA.
This process's side of the UCX lane moves host memory; a daemon with GPUs moves GPU memory
over it itself where its UCX can (see ucx_lane; transport_info's links say so per daemon).
NIXL is not used.
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
        "gpudirect_rdma": ("not on this side: this process's lanes move host memory; a daemon's UCX lane moves its "
                           "GPU memory directly where it can (each link's gpu_memory_over_ucx says)"),
        "cuda": torch.cuda.is_available(),
        "cupy": importable("cupy"),
    }
