"""A genie-daemon process takes the wire from Genie and nothing of the client: no remote_accelerator
registered there, so CUDA stays PyTorch's accelerator on a GPU daemon (with Genie's device
registered in it, cuDNN convolutions crashed a GPU daemon and its CUDA autograd stopped at an
internal assert)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from daemons import DaemonProcess


def test_the_daemon_entry_keeps_the_client_out_of_the_process():
    code = ("import sys, torch; from genie_daemon import entry; entry.mark_daemon_process(); "
            "from genie_daemon import cli, server; "
            "print(torch._C._get_privateuse1_backend_name(), any(m.startswith(('genie.frontend', 'genie.runtime')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["privateuseone", "False"]


def test_a_process_that_imports_the_daemons_modules_still_gets_the_device():
    """Only the daemon's entry marks a process: tools and tests may use both sides in one process."""
    code = ("import torch; import genie_daemon.kv_store; import genie; "
            "print(torch._C._get_privateuse1_backend_name(), torch.accelerator.current_accelerator().type)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["remote_accelerator", "remote_accelerator"]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/PID/maps (Linux)")
@pytest.mark.parametrize("use_console_script", [True, False])
def test_a_running_daemon_has_not_loaded_the_client_device_library(use_console_script):
    with DaemonProcess(use_console_script=use_console_script) as d:
        with open(f"/proc/{d.proc.pid}/maps") as f:
            maps = f.read()
    assert "libtorch" in maps  # the maps are the daemon's, torch loaded
    assert "device_guard-" not in maps  # Genie's C++ device guard and backend hooks (the client's)
