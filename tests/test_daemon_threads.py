"""A daemon with several torch threads runs every op on its worker thread (see DaemonServer.inline_ok)."""
from __future__ import annotations

import copy

import torch

import genie
from daemons import DaemonProcess


def test_a_multithreaded_daemon_serves_models_and_blocking_reads():
    from genie.examples.zoo import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN().eval()
    images = torch.randn(4, 3, 32, 32)
    with DaemonProcess(extra=["--threads", "2"]) as d:  # the later --threads wins
        genie.init(d.endpoint)
        try:
            remote = copy.deepcopy(model).to("remote_accelerator:0")
            with torch.no_grad():
                got = remote(images.to("remote_accelerator:0")).cpu()
                x = torch.ones(3, device="remote_accelerator:0")
                assert (x + 1).sum().item() == 6.0  # a small blocking read, not run inline here
            torch.testing.assert_close(got, model(images), rtol=1e-4, atol=1e-5)
        finally:
            genie.shutdown()
