"""A Ctrl-C that stops a batch before it goes out keeps the batch (DeviceStream.put_back): the next
post sends it first, so its ops still run, in order. The interrupt is raised here by the waits
themselves (monkeypatched), in this process: a real SIGINT would stop pytest."""
import gc

import pytest
import torch

from genie.runtime import get_runtime


class _Interrupting:
    """Stands in for a wait: the first `times` calls raise KeyboardInterrupt, later ones run `wait`."""

    def __init__(self, wait, times: int = 1) -> None:
        self.wait, self.times, self.fired = wait, times, 0

    def __call__(self, *args, **kwargs):
        if self.fired < self.times:
            self.fired += 1
            raise KeyboardInterrupt
        return self.wait(*args, **kwargs)


def test_a_batch_stopped_in_the_flow_control_wait_goes_with_the_next_post(dev, monkeypatch):
    x = torch.zeros(4, device=dev)
    torch.remote_accelerator.synchronize()
    stream = get_runtime().stream(0)
    link = stream.link
    monkeypatch.setattr(link, "post_direct", lambda *a: False)  # through the loop, to its wait
    stopper = _Interrupting(link._inflight.wait_for)
    monkeypatch.setattr(link._inflight, "wait_for", stopper)
    x.add_(1)
    with pytest.raises(KeyboardInterrupt):
        stream.flush()
    assert stopper.fired and len(stream.unsent) == 1 and not stream.ops
    x.mul_(3)  # queued behind it: runs after it
    assert x.tolist() == [3.0, 3.0, 3.0, 3.0]
    assert not stream.unsent


def test_a_direct_request_that_never_went_is_sent_before_the_next(dev, monkeypatch):
    x = torch.zeros(4, device=dev)
    torch.remote_accelerator.synchronize()
    stream = get_runtime().stream(0)
    channel = stream.link.channel
    stopper = _Interrupting(channel._send_direct)
    monkeypatch.setattr(channel, "_send_direct", stopper)
    x.add_(2)
    with pytest.raises(KeyboardInterrupt):
        x.sum().item()  # its batch (the add, then the read) never went
    assert stopper.fired and len(stream.unsent) == 1
    assert stream.unsent[0][0]["fetch"] == []  # nobody reads what it fetched now
    x.add_(1)
    assert x.tolist() == [3.0, 3.0, 3.0, 3.0]
    assert not stream.unsent


def test_batches_kept_back_twice_keep_their_order(dev, monkeypatch):
    x = torch.ones(4, device=dev)
    torch.remote_accelerator.synchronize()
    stream = get_runtime().stream(0)
    link = stream.link
    monkeypatch.setattr(link, "post_direct", lambda *a: False)
    monkeypatch.setattr(link._inflight, "wait_for", _Interrupting(link._inflight.wait_for, times=2))
    x.add_(1)
    with pytest.raises(KeyboardInterrupt):
        stream.flush()  # (x + 1) kept back
    x.mul_(10)
    with pytest.raises(KeyboardInterrupt):
        stream.flush()  # sending the kept batch is stopped again: both kept, in order
    assert len(stream.unsent) == 2
    x.sub_(5)
    assert x.tolist() == [15.0, 15.0, 15.0, 15.0]  # ((1 + 1) * 10) - 5


def test_handles_are_freed_when_their_tensors_die_also_in_a_cycle(dev, monkeypatch):
    """HandleRef queues its free from a weak reference's callback (no __del__, where a Ctrl-C was
    swallowed); the stream keeps that reference, so the callback runs also for a cycle."""
    from genie.runtime.stream import DeviceStream

    stream = get_runtime().stream(0)
    torch.remote_accelerator.synchronize()
    a = torch.ones(4, device=dev) * 2
    b = [a]
    b.append(b)  # a cycle: only the garbage collector frees it
    handle = a._genie.id
    assert handle in stream.deaths.watching
    del a, b
    gc.collect()
    assert handle in [ref.key for ref in stream.deaths.dead]
    freed = []
    take = DeviceStream._take

    def spy(self, *args, **kwargs):
        body, frames = take(self, *args, **kwargs)
        freed.extend(body["frees"])
        return body, frames

    monkeypatch.setattr(DeviceStream, "_take", spy)
    torch.remote_accelerator.synchronize()
    assert handle in freed
    assert not stream.deaths.dead and handle not in stream.deaths.watching
