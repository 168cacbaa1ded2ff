"""safetensors and remote tensors: loading onto a remote device, and saving with one wait.

Loading: `safetensors.torch.load_file(f, device="remote_accelerator:0")` and
`safe_open(f, framework="pt", device="remote_accelerator:0")`, as with device="cuda".

safetensors checks a device name against its own list and refuses this one ("device
remote_accelerator:0 is invalid"). For a remote device the file is opened on the CPU
(memory-mapped, as safetensors does) and each tensor read from it is moved with `.to(device)`:
an upload queued without waiting, the same as `load_file(f)` followed by `.to(device)`.

Installed by replacing `safe_open` in `safetensors` and `safetensors.torch` (where `load_file`
looks it up at each call). A program that bound `from safetensors import safe_open` before
`import genie` keeps safetensors' own, which still refuses the name; `load_file` works either way.

Saving: `save_file` / `save` / `save_model` (and Hugging Face's `save_pretrained`, which calls
`save_file`) move each tensor to the CPU with its own `.to("cpu")`, one wait per tensor. The
function that does so for all of them (`_flatten_as_ptr`, or `_flatten` in older safetensors; a
module global, looked up at each call, so this holds however the program imported `save_file`)
runs with the dict's remote tensors read together (read_ahead: one round trip per daemon for up
to 64 MiB of values). Where a safetensors version has neither, saving works as before.
"""
from __future__ import annotations

import functools
import importlib.util
import sys

import torch

from genie.runtime.device_type import DEVICE_TYPE

from . import read_ahead

_TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")


def remote_device(device) -> torch.device | None:
    """`device` as a torch.device when it names a remote accelerator, else None (safetensors' own
    device names and its integer CUDA indices go to safetensors unchanged)."""
    if isinstance(device, torch.device):
        return device if device.type == DEVICE_TYPE else None
    if isinstance(device, str) and device.split(":", 1)[0] == DEVICE_TYPE:
        return torch.device(device)  # a malformed index raises torch's own error
    return None


class TensorsOnDevice:
    """A file opened by safetensors on the CPU whose tensors move to `device` as they are read.
    Everything else (keys, metadata, offset_keys, the context manager) is safetensors' own."""

    def __init__(self, opened, device: torch.device) -> None:
        self._opened = opened
        self.device = device

    def __enter__(self) -> "TensorsOnDevice":
        self._opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self._opened.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._opened.get_tensor(name).to(self.device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: t.to(self.device) for name, t in self._opened.get_tensors().items()}

    def get_slice(self, name: str) -> "SliceOnDevice":
        return SliceOnDevice(self._opened.get_slice(name), self.device)

    def __getattr__(self, name: str):
        return getattr(self._opened, name)


class SliceOnDevice:
    """safetensors' lazy slice of one tensor: indexing reads only that part, then moves it."""

    def __init__(self, lazy, device: torch.device) -> None:
        self._lazy = lazy
        self.device = device

    def __getitem__(self, index) -> torch.Tensor:
        return self._lazy[index].to(self.device)

    def __getattr__(self, name: str):
        return getattr(self._lazy, name)


def _opening_anywhere(safe_open):
    def opening(filename, framework, device="cpu", *args, **kwargs):
        remote = remote_device(device)
        if remote is None:
            return safe_open(filename, framework, device, *args, **kwargs)
        if framework not in _TORCH_FRAMEWORKS:
            raise ValueError(f"safe_open(framework={framework!r}) makes arrays of that framework, which cannot "
                             f"live on {remote}: use framework='pt' for remote_accelerator tensors")
        return TensorsOnDevice(safe_open(filename, framework, "cpu", *args, **kwargs), remote)

    opening.__doc__ = safe_open.__doc__
    opening.__name__ = opening.__qualname__ = "safe_open"
    opening._genie_wraps = safe_open
    return opening


def _reading_together(flatten):
    """safetensors' flatten step (tensors dict first) with the dict's remote tensors read together."""
    @functools.wraps(flatten)
    def flattening(tensors, *args, **kwargs):
        with read_ahead.reading_together(read_ahead.remote_values(tensors) if isinstance(tensors, dict) else []):
            return flatten(tensors, *args, **kwargs)

    flattening._genie_wraps = flatten
    return flattening


_FLATTENERS = ("_flatten_as_ptr", "_flatten")  # safetensors >= 0.6 / before: save_file's and save's step


def install() -> bool:
    """Let safetensors open files onto remote devices and save remote tensors in one wait, where it
    is installed. Idempotent."""
    if "safetensors" not in sys.modules and importlib.util.find_spec("safetensors") is None:
        return False
    try:
        import safetensors
        import safetensors.torch
    except Exception:  # noqa: BLE001 - a broken safetensors install must not stop `import genie`
        return False
    if hasattr(safetensors.safe_open, "_genie_wraps"):
        return True
    opening = _opening_anywhere(safetensors.safe_open)
    for module in (safetensors, safetensors.torch):
        if getattr(module, "safe_open", None) is opening._genie_wraps:
            module.safe_open = opening
    for name in _FLATTENERS:
        flatten = getattr(safetensors.torch, name, None)
        if callable(flatten):
            setattr(safetensors.torch, name, _reading_together(flatten))
    return True
