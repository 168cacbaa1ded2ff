"""Conjugate and negative views (`x.conj()`, `x.mH`, `x.adjoint()`, `torch._neg_view`) behave as on
the CPU: the wrapper carries the bits its tensor on the daemon has, so PyTorch's handling of
them on the client (`.real` / `.imag` of a conjugate view, `resolve_conj`, the conjugate
fallback) agrees with the daemon's. Before, the wrapper had no bits while the daemon's tensor
did: `.real`, `.imag` and `view_as_real(x.conj().resolve_conj())` failed on the daemon with
"view_as_real doesn't work on unresolved conjugated tensors", and `is_conj()` said False."""
import copy

import pytest
import torch

Z = torch.tensor([[1 + 2j, 3 - 1j], [0.5j, 2 + 0j]])


def _on_each(fn):
    return fn("cpu"), fn("remote_accelerator:0")


@pytest.mark.parametrize("name, fn", [
    ("conj().real", lambda z: z.conj().real),
    ("conj().imag", lambda z: z.conj().imag),
    ("mH.imag", lambda z: z.mH.imag),
    ("adjoint().real", lambda z: z.adjoint().real),
    ("view_as_real(resolve_conj)", lambda z: torch.view_as_real(z.conj().resolve_conj())),
    ("neg view imag", lambda z: torch._neg_view(z).imag),
    ("conj view of a slice", lambda z: z[:, 1].conj().unsqueeze(0).imag),
    ("mH @ z", lambda z: z.mH @ z),
    ("conj + 1", lambda z: z.conj() + 1),
    ("exp of conj", lambda z: torch.exp(z.conj())),
])
def test_conjugate_and_negative_views_read_as_on_cpu(dev, name, fn):
    want, got = _on_each(lambda d: fn(Z.to(d)))
    assert torch.equal(got.cpu(), want), name


def test_bits_are_reported_as_on_cpu(dev):
    for d in ("cpu", dev):
        z = Z.to(d)
        assert z.conj().is_conj() and z.mH.is_conj() and z.conj().t().is_conj(), d
        assert not z.conj().resolve_conj().is_conj() and not z.conj().clone().is_conj(), d
        assert torch._neg_view(z).is_neg() and z.conj().imag.is_neg() and not (z.conj() * 1).is_neg(), d
        assert not torch.arange(3.0, device=d).conj().is_conj(), d  # a real tensor's conj is itself


def test_writes_through_a_conjugate_view_reach_the_base_as_on_cpu(dev):
    def run(d):
        z = Z.to(d).clone()
        v = z.conj()
        v.add_(1j)  # the base gets the conjugate of what is written
        v[0, 0] = 5 + 5j
        v.imag.mul_(2)
        return z

    want, got = _on_each(run)
    assert torch.equal(got.cpu(), want)


def test_conjugate_views_through_autograd_and_save(dev, tmp_path):
    def run(d):
        w = Z.to(d).clone().requires_grad_()
        loss = (w.conj().imag * torch.arange(1.0, 5.0, device=d).reshape(2, 2)).sum()
        loss.backward()
        return w.grad

    want, got = _on_each(run)
    assert torch.equal(got.cpu(), want)
    zc = Z.to(dev).conj()
    torch.save({"zc": zc}, tmp_path / "z.pt")
    loaded = torch.load(tmp_path / "z.pt", map_location=dev)["zc"]
    assert loaded.is_conj() and torch.equal(loaded.imag.cpu(), -Z.imag)
    copied = copy.deepcopy(zc)  # as torch: a plain tensor of the view's values
    assert not copied.is_conj() and torch.equal(copied.cpu(), Z.conj().resolve_conj())
