"""A GPU whose CUDA context is lost: telling it apart from an op's ordinary failure.

Most CUDA errors fail one call (a bad argument, out of memory) and the device goes on. Some
are sticky: a device-side assert (an index out of range in a kernel, the most common bug in
user code), an illegal memory access, a launch failure. After one, every CUDA call in the
process fails the same way, and only a new process gets a working context, as with local
PyTorch. The daemon then answers with what happened and starts again in place (see
cli.restart), rather than failing every request of every client from then on.

`GENIE_TEST_LOSE_DEVICE_ON=<op name>` in the daemon's own environment makes that op fail as
a lost context would, so the restart is tested on machines without a GPU.
"""
from __future__ import annotations

import json
import os

import torch

SIMULATED_OP = os.environ.get("GENIE_TEST_LOSE_DEVICE_ON") or None
_simulated_loss = False


class DeviceLost(BaseException):  # its name is protocol.DEVICE_LOST_ERROR, the answer's error type
    """The daemon's device cannot run anything more. A BaseException, so that the handlers
    which turn an op's failure into a poisoned result (and re-run ops one by one) let it
    through to the request, whose answer carries it before the daemon restarts."""

    def __init__(self, op: str | None, error: BaseException) -> None:
        self.op = op  # the op that met the error, None when a request did (e.g. a download)
        self.error = error
        first_line = (str(error).strip().splitlines() or [""])[0]
        super().__init__(
            f"{op or 'a request'} failed on the daemon's GPU with {type(error).__name__}: {first_line}. "
            "This kind of CUDA error (a device-side assert, e.g. an index out of range; an illegal memory "
            "access) leaves the GPU's context unusable for the whole process, so the genie-daemon restarts: "
            "every tensor on it is gone, and the next use of the device reconnects")


def simulated_failure(*args, **kwargs):
    """The kernel of GENIE_TEST_LOSE_DEVICE_ON's op: fails as a device-side assert would."""
    global _simulated_loss
    _simulated_loss = True
    raise RuntimeError("CUDA error: device-side assert triggered (simulated by GENIE_TEST_LOSE_DEVICE_ON)")


def context_lost(error: BaseException, devices) -> bool:
    """Whether `error` left a CUDA device of `devices` unusable: a CUDA error after which the
    device cannot even synchronize (sticky errors are returned by every later call; a one-off
    error is not returned twice)."""
    if _simulated_loss:
        return True
    # Only CUDA's own errors (torch.AcceleratorError; "CUDA error: ..." from older torch) are
    # probed: a probe waits for the GPU's queued work, and other messages may name CUDA too.
    accelerator_error = getattr(torch, "AcceleratorError", ())
    if not isinstance(error, RuntimeError) or not (isinstance(error, accelerator_error) or "CUDA error" in str(error)):
        return False
    for device in devices:
        if device.type != "cuda":
            continue
        for _ in range(2):
            try:
                torch.cuda.synchronize(device)
            except RuntimeError:
                continue
            break
        else:
            return True
    return False


# The restarted process learns, from its own environment (set before the exec, never from the
# network), which clients' tensors went with the lost context and why: a request of theirs that
# reaches it before they notice the loss (their connection reconnects by itself) is answered
# with the loss, not with "handle ... does not exist".
RESTART_NOTICE_ENV = "GENIE_DAEMON_RESTARTED_AFTER"
MAX_NOTICE_CLIENTS = 100_000


def restart_notice(lost: DeviceLost, clients) -> str:
    """What the restarted daemon is told (see take_restart_notice): the loss and its clients' keys."""
    return json.dumps({"reason": str(lost), "op": lost.op,
                       "clients": [bytes(k).hex() for k in list(clients)[:MAX_NOTICE_CLIENTS]]})


def take_restart_notice() -> tuple[dict[bytes, str], str | None]:
    """In a daemon that restarted after a loss: (client key -> the loss's message, the op that met
    it); ({}, None) otherwise. Removed from the environment, so that it is read once."""
    raw = os.environ.pop(RESTART_NOTICE_ENV, None)
    if not raw:
        return {}, None
    try:
        notice = json.loads(raw)
        reason, op = str(notice["reason"]), notice.get("op")
        keys = {bytes.fromhex(k) for k in notice["clients"] if type(k) is str}
    except (ValueError, KeyError, TypeError):
        return {}, None
    return {k: reason for k in keys}, op if type(op) is str else None
