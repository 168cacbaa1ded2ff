"""The daemon's twins of a client's torch.Generators (daemon/handles.ClientState), without sockets."""
import pytest
import torch

from daemon import handles
from daemon.handles import ClientState, MemoryAccount
from genie.transport.errors import ProtocolError
from genie.transport.protocol import GeneratorRef

CPU = torch.device("cpu")


def _client():
    return ClientState(b"c", MemoryAccount())


def test_a_twin_keeps_drawing_until_the_client_seeds_again():
    client = _client()
    twin = client.drawing_generator(GeneratorRef(1, 2, 99), CPU)
    first = torch.rand(3, generator=twin)
    same = client.drawing_generator(GeneratorRef(1, 2, 99), CPU)
    assert same is twin
    second = torch.rand(3, generator=same)
    reseeded = client.drawing_generator(GeneratorRef(1, 3, 99), CPU)  # seeded again, with the same seed
    torch.testing.assert_close(torch.rand(3, generator=reseeded), first, rtol=0, atol=0)
    expected = torch.Generator().manual_seed(99)
    torch.testing.assert_close(first, torch.rand(3, generator=expected), rtol=0, atol=0)
    torch.testing.assert_close(second, torch.rand(3, generator=expected), rtol=0, atol=0)


def test_a_twin_stays_on_its_device_and_twins_are_bounded(monkeypatch):
    client = _client()
    client.drawing_generator(GeneratorRef(1, 1, 5), CPU)
    with pytest.raises(ProtocolError, match="belongs to cpu"):
        client.drawing_generator(GeneratorRef(1, 1, 5), torch.device("meta"))
    monkeypatch.setattr(handles, "MAX_OWN_GENERATORS", 2)
    client.drawing_generator(GeneratorRef(2, 1, 5), CPU)
    with pytest.raises(ProtocolError, match="at most 2 torch.Generators"):
        client.drawing_generator(GeneratorRef(3, 1, 5), CPU)
    client.own_generators.pop(1)  # what genie::free_generators does
    client.drawing_generator(GeneratorRef(3, 1, 5), CPU)
