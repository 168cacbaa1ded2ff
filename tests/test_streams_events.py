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


# ---------------------------------------------------------------- PyTorch's device-generic API
# torch.Stream, torch.Event and torch.accelerator act on the remote work (through Genie's C++
# device guard), as they do on CUDA.


def _busy(dev, n: int = 1200, steps: int = 6):
    """Queue work that keeps the daemon busy for a while (hundreds of ms on the 2-core test host)."""
    x = torch.randn(n, n, device=dev)
    for _ in range(steps):
        x = (x @ x) / n
    return x


def test_genie_streams_are_torch_streams(dev):
    s = ra.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device(dev)
    plain = torch.Stream(device="remote_accelerator")  # no index: the current device's, as on CUDA
    assert plain.device_index == 0 and plain.stream_id not in (0, s.stream_id)
    assert ra.Stream(_stream_id=plain.stream_id) == plain
    with ra.stream(s):
        assert torch.accelerator.current_stream() == s
    with s:
        assert torch.accelerator.current_stream() == s and ra.current_stream() == s
    assert ra.current_stream() == ra.default_stream()
    torch.accelerator.set_stream(plain)
    try:
        assert ra.current_stream() == plain
    finally:
        torch.accelerator.set_stream(ra.default_stream())
    with plain:
        assert ra.current_stream() == plain
        y = torch.ones(4, device=dev) * 3
    plain.synchronize()
    assert plain.query() and y.sum().item() == 12


def test_stream_after_its_last_event_completed_is_complete_at_once(dev, monkeypatch):
    # CUDA: once an event recorded last on a stream has completed, the stream's query is True.
    # Asking the daemon again would record a new event whose answer may not be in yet (a flaky
    # False), so it must not ask at all.
    for s in (ra.Stream(), torch.Stream(device="remote_accelerator")):
        with s:
            torch.randn(256, 256, device=dev).sum()
        e = torch.Event(device="remote_accelerator")
        e.record(s)
        e.synchronize()
        link = genie.frontend.streams._as_stream(s)._queue.link
        asked = []
        real = link.request
        monkeypatch.setattr(link, "request", lambda *a, **k: asked.append(a[0]) or real(*a, **k))
        assert s.query() and asked == []
        monkeypatch.undo()


def test_torch_accelerator_synchronize_waits_for_remote_work(dev):
    _busy(dev)
    done = ra.Event()
    done.record()
    torch.accelerator.synchronize()
    assert done.query()  # answered at once: the work before it has run


def test_event_query_does_not_wait(dev):
    _busy(dev)
    e = ra.Event()
    e.record()
    assert not e.query()  # the daemon is still busy: CUDA's query says so at once too
    e.synchronize()
    assert e.query()


def test_idle_stream_query_is_true_at_once(dev):
    assert ra.Stream().query() and torch.Stream(device="remote_accelerator").query()


def test_torch_events_time_remote_work(dev):
    start, end = torch.Event(device="remote_accelerator", enable_timing=True), \
        torch.Event(device="remote_accelerator", enable_timing=True)
    genie_start, genie_end = ra.Event(enable_timing=True), ra.Event(enable_timing=True)
    start.record()
    genie_start.record()
    _busy(dev)
    genie_end.record()
    end.record()
    assert not end.query()
    end.synchronize()
    assert end.query()
    measured, reference = start.elapsed_time(end), genie_start.elapsed_time(genie_end)
    # Both pairs time the work on the daemon (before this change torch.Event timed the capture here).
    assert reference > 0 and measured >= 0.9 * reference


def test_torch_stream_orders_through_torch_events(dev):
    side = torch.Stream(device="remote_accelerator")
    with side:
        b = _busy(dev, 256, 2) + 1
    e = side.record_event()
    assert isinstance(e, torch.Event)
    torch.accelerator.current_stream().wait_event(e)
    ra.current_stream().wait_stream(side)
    assert torch.isfinite(b).all().item()


def test_backward_runs_on_the_forward_stream(dev):
    """As on CUDA: each op's backward runs on the stream its forward ran on, and the engine
    orders the streams with events (seen here from a hook, which runs on the node's stream)."""
    s = ra.Stream()
    w = torch.randn(8, 8, device=dev, requires_grad=True)
    seen = []
    with ra.stream(s):
        y = (w @ w).tanh()
        y.register_hook(lambda g: seen.append(ra.current_stream()))
        loss = y.sum()
    loss.backward()
    assert seen == [s]
    cpu_w = w.detach().cpu().requires_grad_()
    (cpu_w @ cpu_w).tanh().sum().backward()
    assert torch.allclose(w.grad.cpu(), cpu_w.grad, atol=1e-5)


def test_record_stream_accepts_both_kinds_of_stream(dev):
    x = torch.ones(16, device=dev)
    x.record_stream(ra.Stream())
    x.record_stream(torch.Stream(device="remote_accelerator"))
    x.record_stream(torch.accelerator.current_stream())
    assert x.sum().item() == 16
    import pytest

    with pytest.raises(TypeError, match="remote_accelerator stream"):
        genie.frontend.streams.record_stream(x, torch.Stream(device="cpu"))


def test_stream_context_and_capturing_flag(dev):
    s = ra.Stream()
    assert not ra.is_current_stream_capturing()
    with ra.StreamContext(s):
        assert ra.current_stream() == s
    assert ra.current_stream() == ra.default_stream()
    g = genie.Graph()
    with genie.graph(g):
        assert ra.is_current_stream_capturing()
        torch.ones(2, device=dev).add_(1)
    assert not ra.is_current_stream_capturing()


def test_inline_payloads_of_ops_on_another_stream_reach_their_own_ops(dev):
    """Small CPU tensors given to ops travel inline in the ops' batch. An op on another stream
    than the queued ones starts a new batch, and its payload must go with it: attached before the
    switch, it left with the batch before, and the op read another payload (2.5 became 7, silently)."""
    x = torch.ones(3, device=dev)
    y = x + 1  # queued on the default stream
    s = ra.Stream()
    with ra.stream(s):
        w = x * torch.tensor(2.5)
        u = x * torch.tensor(7.0)
        v = torch.ops.aten.add.Tensor(x, torch.tensor([1.0, 2.0, 3.0]))
    z = x * torch.tensor(-1.0)  # and back on the default stream
    s.synchronize()
    assert y.cpu().tolist() == [2.0] * 3
    assert w.cpu().tolist() == [2.5] * 3 and u.cpu().tolist() == [7.0] * 3
    assert v.cpu().tolist() == [2.0, 3.0, 4.0] and z.cpu().tolist() == [-1.0] * 3


def test_other_threads_see_no_capture(dev):
    """Capturing is the recording thread's state, as CUDA's is_current_stream_capturing is per
    stream (and a thread's current stream its own)."""
    seen, inside, checked = [], threading.Event(), threading.Event()

    def other():
        inside.wait(10)
        seen.append(ra.is_current_stream_capturing())
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with genie.graph(genie.Graph()):
        torch.ones(2, device=dev).add_(1)
        inside.set()
        assert checked.wait(10)
        assert ra.is_current_stream_capturing()
    t.join(10)
    assert seen == [False]
