"""The genie-daemon process's entry point (`genie-daemon`, `python -m genie_daemon`).

It marks this process a daemon before anything of Genie is imported: `genie` then gives it the
wire (genie.transport) and leaves PyTorch's accelerator alone, so CUDA stays the accelerator of a
GPU daemon (see genie/__init__.py).
"""
from __future__ import annotations

import sys


def mark_daemon_process() -> None:
    """Before Genie is imported: this process serves; `import genie` registers no client device here."""
    sys.modules[__package__].SERVING = True


def main(argv: list[str] | None = None) -> None:
    mark_daemon_process()
    from .cli import main as serve

    serve(argv)
