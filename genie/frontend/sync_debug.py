"""torch.remote_accelerator.set_sync_debug_mode: find the lines where your program waits for a daemon.

Genie queues ops and sends them in batches without waiting; a program waits for a daemon only
where it needs an answer: a value read on the CPU (`.item()`, `.cpu()`, `.tolist()`, `print(t)`,
`if t > 0:`) or an op whose result's shape depends on values (`nonzero`, `unique`, boolean-mask
indexing). On a real network each such wait costs a round trip, so a stray one in a training
loop (a loss logged with `.item()` every step, a `bool()` in a clipping helper) can cost more
than the step. As `torch.cuda.set_sync_debug_mode` does for CUDA, mode "warn" (1) warns at each
such line (Python shows a warning once per line), "error" (2) raises before anything is sent, and
"default" (0) says nothing. Explicit waits (`synchronize()`, `Event.synchronize()`, memory
queries) and `await genie.materialize(t)`, which does not block the caller, are not reported, as
CUDA reports neither `torch.cuda.synchronize()` nor non-blocking copies.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

_MODES = {"default": 0, "warn": 1, "error": 2}
_mode = 0  # set below from GENIE_SYNC_DEBUG, for programs run unchanged
# Frames inside these packages are not the user's line: the warning points past them.
_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """0 / "default": say nothing; 1 / "warn": warn where a daemon is waited for; 2 / "error": raise there."""
    global _mode
    if isinstance(debug_mode, str):
        if debug_mode not in _MODES:
            raise RuntimeError('invalid value of debug_mode, expected one of "default", "warn", "error"; '
                               f"got {debug_mode!r}")
        debug_mode = _MODES[debug_mode]
    if type(debug_mode) is not int or debug_mode not in (0, 1, 2):
        raise RuntimeError(f"invalid value of debug_mode, expected 0, 1 or 2; got {debug_mode!r}")
    _mode = debug_mode


def get_sync_debug_mode() -> int:
    return _mode


def note(what: str) -> None:
    """Called where the calling thread is about to wait for a daemon's answer to `what`."""
    if _mode == 0:
        return
    message = (f"called a synchronizing remote_accelerator operation: {what} waits for the daemon's answer "
               "(a network round trip)")
    if _mode == 2:
        raise RuntimeError(message)
    warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel of the first frame outside Genie and PyTorch (note's caller is 2)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _from_environment() -> None:
    value = os.environ.get("GENIE_SYNC_DEBUG", "").strip().lower()
    if value:
        try:
            set_sync_debug_mode(int(value) if value.isdigit() else value)
        except RuntimeError as e:
            warnings.warn(f"GENIE_SYNC_DEBUG ignored: {e}", RuntimeWarning, stacklevel=2)


_from_environment()
