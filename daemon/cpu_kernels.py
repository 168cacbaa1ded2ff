"""CPU kernels for aten ops torch has for CUDA only, registered once per daemon process.

Clients' programs take the code paths they take on a GPU (remote_accelerator is not "cpu"), and
some of those call ops torch implements for CUDA alone; a CPU daemon registers its own kernels
for them (daemon/rnn_cells.py, daemon/sync_batch_norm.py), and only where torch has none.
"""
from __future__ import annotations

import torch

_libraries: dict[str, torch.library.Library] = {}  # owner -> its registrations, kept alive


def register_where_missing(owner: str, kernels: dict) -> None:
    """Register `kernels` ({aten op name: function}) for the CPU where torch has no CPU kernel;
    a second call for the same owner does nothing."""
    if owner in _libraries:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in kernels.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            lib.impl(name, kernel, "CPU")
    _libraries[owner] = lib
