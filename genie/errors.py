"""Genie's exception types, in one place. Each carries what a user needs to act."""
from __future__ import annotations

import torch


class GenieError(RuntimeError):
    """Base class of everything Genie raises."""


class GenieConnectionError(GenieError):
    """A daemon could not be reached, or stopped answering; says which one."""


class RemoteExecutionError(GenieError):
    """An op failed on the daemon. `op` is the ATen overload that failed."""

    def __init__(self, op: str | None, message: str, error_type: str = "RuntimeError", daemon: str = "") -> None:
        self.op = op
        self.remote_message = message
        self.error_type = error_type
        self.daemon = daemon
        where = f" on {daemon}" if daemon else ""
        super().__init__(f"{op or 'request'} failed{where}: {error_type}: {message}")


class RemoteOutOfMemoryError(RemoteExecutionError, torch.OutOfMemoryError):
    """The daemon ran out of memory for an op. `except torch.OutOfMemoryError` (torch.cuda's is
    the same class) catches it, as it catches CUDA's: code that retries with a smaller batch works."""


def remote_execution_error(op: str | None, message: str, error_type: str = "RuntimeError",
                           daemon: str = "") -> RemoteExecutionError:
    """The error for a failure the daemon reported, of the class its type calls for."""
    cls = RemoteOutOfMemoryError if error_type == "OutOfMemoryError" else RemoteExecutionError
    return cls(op, message, error_type, daemon=daemon)


class UnsupportedOperationError(GenieError):
    """An op that Genie cannot run on a remote device (named in the message)."""

    def __init__(self, op: str, reason: str) -> None:
        self.op = op
        super().__init__(f"{op} is not supported on remote_accelerator: {reason}")
