"""torch.distributed's init_device_mesh("remote_accelerator", ...), as for "cuda".

init_device_mesh refuses device types that are not all letters (to catch "cuda:0"), and
remote_accelerator has an underscore: FSDP2 and tensor-parallel scripts had to build
`DeviceMesh("remote_accelerator", torch.arange(world))` by hand. Here the name reaches that
check as a string whose isalpha() is true, and the mesh then holds the plain name. Installed
when Genie loads: a program that took init_device_mesh from its module before `import genie`
holds torch's own function (DeviceMesh(...) works either way).
"""
from __future__ import annotations

import functools

from genie.runtime.device_type import DEVICE_TYPE



class _LettersOnly(str):
    """The device type as init_device_mesh's check wants it; equal to, and hashing as, the name."""

    def isalpha(self) -> bool:
        return True


def _wrap(original):
    @functools.wraps(original)
    def init_device_mesh(device_type, mesh_shape, *args, **kwargs):
        if device_type != DEVICE_TYPE:
            return original(device_type, mesh_shape, *args, **kwargs)
        mesh = original(_LettersOnly(DEVICE_TYPE), mesh_shape, *args, **kwargs)
        if isinstance(getattr(mesh, "_device_type", None), _LettersOnly):  # torch's attribute behind .device_type
            mesh._device_type = DEVICE_TYPE  # a plain str from here on (sub-meshes, pickling, printing)
        return mesh

    init_device_mesh._genie_wraps = original
    return init_device_mesh


def install() -> None:
    try:
        import torch.distributed as dist
        from torch.distributed import device_mesh
    except ImportError:  # a torch built without distributed
        return
    original = getattr(device_mesh, "init_device_mesh", None)
    if original is None or hasattr(original, "_genie_wraps"):
        return
    wrapped = _wrap(original)
    device_mesh.init_device_mesh = wrapped
    if getattr(dist, "init_device_mesh", None) is original:
        dist.init_device_mesh = wrapped
