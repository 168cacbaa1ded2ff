"""Streams and events, mirroring what PyTorch's own tests check for torch.cuda streams and events."""
import threading

import torch

import genie

ra = genie.remote_accelerator


def test_default_and_current_stream(dev):
    d = ra.default_stream()
    assert ra.current_stream() == d and d.stream_id == 0
    s = ra.Stream()
    assert s != d and s.device == torch.device("remote_accelerator:0")
    with ra.stream(s):
        assert ra.current_stream() == s
    assert ra.current_stream() == d
    with ra.stream(None):
        assert ra.current_stream() == d
    assert "Stream" in repr(s)


def test_current_stream_is_per_thread(dev):
    s = ra.Stream()
    seen = []
    with ra.stream(s):
        t = threading.Thread(target=lambda: seen.append(ra.current_stream()))
        t.start()
        t.join()
    assert seen == [ra.default_stream()]


def test_work_on_side_streams_orders_through_events(dev):
    s1, s2 = ra.Stream(), ra.Stream()
    with ra.stream(s1):
        a = torch.full((256, 256), 2.0, device=dev)
        b = a @ a
    e = s1.record_event()
    s2.wait_event(e)
    with ra.stream(s2):
        c = b + 1
    ra.current_stream().wait_stream(s2)
    assert c[0, 0].item() == 2.0 * 2.0 * 256 + 1


def test_event_query_synchronize_and_elapsed_time(dev):
    s = ra.current_stream()
    start, end = ra.Event(enable_timing=True), ra.Event(enable_timing=True)
    assert start.query()  # never recorded: complete, as for CUDA events
    start.record()
    x = torch.randn(512, 512, device=dev)
    for _ in range(4):
        x = x @ x
        x = x / x.norm()
    end.record(s)
    end.synchronize()
    assert end.query() and start.query()
    assert start.elapsed_time(end) > 0


def test_stream_query_and_synchronize(dev):
    s = ra.Stream()
    with ra.stream(s):
        y = torch.randn(128, 128, device=dev).sum()
    s.synchronize()
    assert s.query()
    assert isinstance(y.item(), float)


def test_elapsed_time_needs_timing(dev):
    import pytest

    a, b = ra.Event(), ra.Event()
    a.record()
    b.record()
    with pytest.raises(Exception, match="enable_timing"):
        a.elapsed_time(b)
