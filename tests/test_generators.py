"""torch.Generator(device="remote_accelerator"): seeded draws that repeat, as on CUDA."""
import gc

import pytest
import torch

import genie
from genie.frontend import native_guard
from genie.runtime import get_runtime

pytestmark = pytest.mark.skipif(not native_guard.loaded(), reason="device generators need Genie's C++ guard "
                                "(no C++ compiler here)")

# Each draws from `g` on the device `d`; the same call on the reference device (the CPU, or the
# local GPU where the daemon computes on CUDA: conftest's `reference`) with a generator of its own
# seeded alike gives the same numbers, because the daemon's twin of `g` is such a generator.
DRAWS = {
    "randn": lambda d, g: torch.randn(4, 3, device=d, generator=g),
    "rand": lambda d, g: torch.rand(7, device=d, generator=g),
    "randint": lambda d, g: torch.randint(0, 100, (9,), device=d, generator=g),
    "randperm": lambda d, g: torch.randperm(10, device=d, generator=g),
    "normal_": lambda d, g: torch.zeros(5, device=d).normal_(2.0, 0.5, generator=g),
    "uniform_": lambda d, g: torch.zeros(5, device=d).uniform_(-1, 1, generator=g),
    "bernoulli": lambda d, g: torch.bernoulli(torch.full((16,), 0.3, device=d), generator=g),
    "multinomial": lambda d, g: torch.multinomial(torch.arange(1.0, 6.0, device=d), 3, generator=g),
    "exponential_": lambda d, g: torch.empty(4, device=d).exponential_(generator=g),
}


def _twin(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_seeded_draws_repeat_and_match_a_cpu_generator(dev, reference, name):
    draw = DRAWS[name]
    g = torch.Generator(device=dev)
    assert g.device == torch.device(dev)
    g.manual_seed(1234)
    first, second = draw(dev, g).cpu(), draw(dev, g).cpu()
    g.manual_seed(1234)
    again = draw(dev, g).cpu()
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    twin = _twin(1234, reference)
    torch.testing.assert_close(first, draw(reference, twin).cpu(), rtol=0, atol=0)
    torch.testing.assert_close(second, draw(reference, twin).cpu(), rtol=0, atol=0)


def test_generators_are_independent_of_each_other_and_of_the_default_stream(dev, reference):
    torch.manual_seed(7)
    expected_default = [torch.randn(3, device=dev).cpu() for _ in range(2)]
    torch.manual_seed(7)
    a, b = torch.Generator(device=dev).manual_seed(1), torch.Generator(device=dev).manual_seed(1)
    from_default = [torch.randn(3, device=dev).cpu()]
    a1 = torch.randn(3, device=dev, generator=a).cpu()  # drawing from a moves neither b nor the default
    from_default.append(torch.randn(3, device=dev).cpu())
    b1 = torch.randn(3, device=dev, generator=b).cpu()
    torch.testing.assert_close(a1, b1, rtol=0, atol=0)
    for got, want in zip(from_default, expected_default):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # A fresh generator starts from torch's usual default seed, as on the CPU and CUDA.
    fresh = torch.Generator(device=dev)
    local = torch.Generator(device=reference)
    assert fresh.initial_seed() == local.initial_seed()
    torch.testing.assert_close(torch.rand(4, device=dev, generator=fresh).cpu(),
                               torch.rand(4, device=reference, generator=local).cpu(), rtol=0, atol=0)


def test_seed_picks_a_new_random_seed(dev, reference):
    g = torch.Generator(device=dev)
    s = g.seed()
    assert g.initial_seed() == s
    got = torch.rand(5, device=dev, generator=g).cpu()
    torch.testing.assert_close(got, torch.rand(5, device=reference, generator=_twin(s, reference)).cpu(), rtol=0, atol=0)


def test_diffusers_style_noise_from_a_seeded_device_generator(dev):
    """generator=torch.Generator(device).manual_seed(s), then randn of latents, twice: the same noise."""
    def latents():
        g = torch.Generator(device=dev).manual_seed(0)
        noise = torch.randn((1, 4, 8, 8), generator=g, device=dev, dtype=torch.float32)
        return (noise * 0.5 + torch.randn((1, 4, 8, 8), generator=g, device=dev)).cpu()

    torch.testing.assert_close(latents(), latents(), rtol=0, atol=0)


def test_wrong_generators_are_refused(dev):
    with pytest.raises(RuntimeError, match="Expected a 'remote_accelerator' device type for generator but found 'cpu'"):
        torch.randn(3, device=dev, generator=torch.Generator())
    g = torch.Generator(device=dev)
    for call in (g.get_offset, lambda: g.set_offset(1)):
        with pytest.raises(RuntimeError, match="position lives on the genie-daemon.*get_state"):
            call()


def test_get_state_and_set_state_replay_draws_in_program_order(dev, reference):
    """g.get_state() is the twin's state after the ops queued before it; g.set_state(s) applies
    before the ops queued after it, as on CUDA (both raised before)."""
    g = torch.Generator(device=dev).manual_seed(3)
    fresh = g.get_state()
    assert fresh.dtype == torch.uint8 and fresh.device.type == "cpu"
    assert torch.equal(fresh, _twin(3, reference).get_state())  # the daemon's twin: a generator like this one
    first = torch.randn(4, device=dev, generator=g)  # queued, not read: get_state must follow it
    after_first = g.get_state()
    second = torch.randn(4, device=dev, generator=g)
    g.set_state(fresh)
    again = torch.randn(4, device=dev, generator=g)
    g.set_state(after_first)
    second_again = torch.randn(4, device=dev, generator=g)
    assert torch.equal(again.cpu(), first.cpu())
    assert torch.equal(second_again.cpu(), second.cpu())
    assert not torch.equal(first.cpu(), second.cpu())
    other = torch.Generator(device=dev).manual_seed(3)  # setting g's state moved no other stream
    assert torch.equal(torch.randn(4, device=dev, generator=other).cpu(), first.cpu())
    g.manual_seed(3)  # a seed after set_state starts over from the seed
    assert torch.equal(torch.randn(4, device=dev, generator=g).cpu(), first.cpu())


def test_a_state_of_the_wrong_size_fails_and_the_generator_carries_on(dev):
    g = torch.Generator(device=dev).manual_seed(5)
    expected = torch.randn(3, device=dev, generator=torch.Generator(device=dev).manual_seed(5)).cpu()
    g.set_state(torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="size"):
        torch.randn(2, device=dev, generator=g).cpu()
    g.manual_seed(5)
    assert torch.equal(torch.randn(3, device=dev, generator=g).cpu(), expected)


def test_a_generator_in_a_recorded_graph_is_refused(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.zeros(4, device=dev)
    with pytest.raises(genie.GenieError, match="genie.graph cannot use a torch.Generator"):
        with genie.graph(genie.Graph()):
            x.add_(torch.rand(4, device=dev, generator=g))
    state = g.get_state()
    for call in (g.get_state, lambda: g.set_state(state)):
        with pytest.raises(RuntimeError, match="genie.graph cannot use a torch.Generator"):
            with genie.graph(genie.Graph()):
                x.add_(1)
                call()


def test_dropped_generators_are_dropped_on_the_daemon(dev):
    link = get_runtime().stream(0).link

    def twins():
        get_runtime().stream(0).synchronize()
        return link.request("stats", {"dev": 0}).body["generators"]

    keep = torch.Generator(device=dev)
    torch.rand(1, device=dev, generator=keep)
    before = twins()
    for seed in range(20):
        g = torch.Generator(device=dev).manual_seed(seed)
        torch.rand(2, device=dev, generator=g)
        del g
    gc.collect()
    torch.rand(1, device=dev, generator=keep).cpu()  # the next draw takes the drops along
    assert twins() <= before
    del keep
    gc.collect()
    torch.rand(1, device=dev, generator=torch.Generator(device=dev)).cpu()
    assert twins() <= before


def test_malformed_generator_state_requests_get_an_error(dev):
    from genie.frontend.device import RNG_STATE_OP, SET_RNG_STATE_OP
    from genie.transport import protocol

    stream = get_runtime().stream(0)
    ref = protocol.encode_generator(999, 1, 1)
    with stream.lock:
        stream.append([SET_RNG_STATE_OP, [ref], {}, None])  # a generator but no state
    with pytest.raises(RuntimeError, match="takes one state tensor"):
        stream.synchronize()
    with stream.lock:
        stream.append([RNG_STATE_OP, [ref, ref], {}, None])
    with pytest.raises(RuntimeError, match="takes \\[generator\\] and one output handle"):
        stream.synchronize()
    assert torch.rand(2, device=dev).cpu().shape == (2,)  # the daemon carried on


def test_deepcopy_and_pickle_of_a_generator_continue_its_stream(dev):
    """copy.deepcopy / pickle / torch.save of a remote_accelerator generator (a sampler's, a
    training state's) failed: PyTorch's reduction asks non-CPU generators for a Philox offset,
    which a remote one has not ("returned a result with an exception set"). Now the copy has the
    seed and the state: it draws what the original draws next, as a CUDA generator's copy does."""
    import copy
    import io
    import pickle

    g = torch.Generator(device=dev).manual_seed(3)
    torch.randn(5, generator=g, device=dev)  # move it along first
    copies = [copy.deepcopy(g), pickle.loads(pickle.dumps(g))]
    buf = io.BytesIO()
    torch.save({"generator": g}, buf)
    buf.seek(0)
    copies.append(torch.load(buf, weights_only=False)["generator"])
    want = torch.randn(4, generator=g, device=dev).cpu()
    for c in copies:
        assert c.device == g.device and c.initial_seed() == 3
        assert torch.equal(torch.randn(4, generator=c, device=dev).cpu(), want)
    cpu = torch.Generator().manual_seed(5)  # other devices keep PyTorch's own reduction
    assert torch.equal(torch.randn(3, generator=copy.deepcopy(cpu)), torch.randn(3, generator=cpu))
