"""What a daemon says about its devices at hello: name, type, memory, capability, bf16, and the
matmul throughput measured once per device (the client's scheduler weighs real speed)."""
from __future__ import annotations

import os

import torch

from genie.transport import calibration


def describe_device(device: torch.device) -> dict:
    info = _describe_hardware(device)
    info["flops"] = _measured_flops(device)
    return info


_FLOPS: dict[str, float] = {}


def _measured_flops(device: torch.device) -> float:
    # Measured once per device, so the client's scheduler weighs real throughput.
    if str(device) not in _FLOPS:
        _FLOPS[str(device)] = calibration.matmul_flops(device)
    return _FLOPS[str(device)]


def _describe_hardware(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        with torch.cuda.device(device):
            bf16 = torch.cuda.is_bf16_supported()
        return {"name": props.name, "type": "cuda", "total_memory": props.total_memory,
                "capability": [props.major, props.minor], "bf16": bf16}
    import platform

    return {"name": f"cpu ({platform.machine() or 'unknown'})", "type": "cpu", "total_memory": host_ram()[0],
            "capability": None, "bf16": True}


def host_ram() -> tuple[int, int]:
    """(total, available) bytes of this host's RAM; zeros where the platform does not say."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0, 0
