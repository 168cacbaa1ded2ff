"""Pipelining across two daemons: the next stage's transfer starts before the previous stage is done."""

import pytest
import torch

import genie




def test_stage_two_starts_while_stage_one_still_runs(two_daemons):
    import sys, os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench.pipeline import back_to_back, make_inputs, pipelined

    inputs = make_inputs(8, 1024)  # ~5 ms of stage 1 each: a window B must start within
    genie.synchronize()
    a, b = genie.get_runtime().streams
    a.exec_log.clear()
    b.exec_log.clear()
    results = pipelined(inputs, depth=3)
    genie.synchronize()  # A's answers are read (and its exec timings logged) by a sync on it
    a_log, b_log = sorted(a.exec_log), sorted(b.exec_log)
    # B received microbatch 0 (daemon to daemon) and began on it before A finished its last microbatch
    # (the daemon starts a request only once its transfer is in, so this is real overlap, not waiting).
    assert b_log[0][0] < a_log[-1][1], (a_log, b_log)
    # Every result is right: the same as running the stages back to back.
    expected = back_to_back(inputs, depth=3)
    assert results == pytest.approx(expected, rel=1e-5)


def test_backpressure_bounds_bytes_in_flight(two_daemons, monkeypatch):
    import dataclasses

    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, max_inflight_bytes=1 << 20))
    link = rt.links[0]
    peak = []  # payload bytes sent and not yet answered, after each post: through the loop or the direct lane
    chunks = [torch.full((256, 256), float(i)) for i in range(16)]  # 256 KiB each
    remote = []
    for c in chunks:
        remote.append(c.to("remote_accelerator:0"))
        genie.flush()  # one 256 KiB batch per chunk, posted without waiting for the previous
        peak.append(link.inflight_bytes + link._direct_unread_bytes)
    assert [r[0, 0].item() for r in remote] == [float(i) for i in range(16)]
    assert 3 << 18 <= max(peak) <= 1 << 20  # several in flight, never more than the bound
