"""Factory ops on the remote device are captured and produce the right values."""
import pytest
import torch

import genie


def test_randn_is_lazy_and_materializes(dev):
    x = torch.randn(10, 10, device=dev)
    assert isinstance(x, genie.LazyTensor)
    assert x.shape == (10, 10) and x.dtype == torch.float32
    y = x.cpu()
    assert type(y) is torch.Tensor and y.device.type == "cpu"
    assert y.std() > 0.5  # really random normal values, not zeros


@pytest.mark.parametrize("make, expected", [
    (lambda d: torch.zeros(2, 3, device=d), torch.zeros(2, 3)),
    (lambda d: torch.ones(2, 3, dtype=torch.int32, device=d), torch.ones(2, 3, dtype=torch.int32)),
    (lambda d: torch.full((2, 2), 7.5, device=d), torch.full((2, 2), 7.5)),
    (lambda d: torch.arange(10, device=d), torch.arange(10)),
    (lambda d: torch.arange(1.0, 4.0, 0.5, device=d), torch.arange(1.0, 4.0, 0.5)),
    (lambda d: torch.linspace(0, 1, 5, device=d), torch.linspace(0, 1, 5)),
    (lambda d: torch.eye(3, device=d), torch.eye(3)),
    (lambda d: torch.tensor([[1, 2], [3, 4]], device=d), torch.tensor([[1, 2], [3, 4]])),
    (lambda d: torch.as_tensor([1.5, 2.5], device=d), torch.tensor([1.5, 2.5])),
    (lambda d: torch.zeros_like(torch.ones(3, device=d)), torch.zeros(3)),
    (lambda d: torch.ones_like(torch.zeros(2, 2, device=d)), torch.ones(2, 2)),
    (lambda d: torch.full_like(torch.zeros(2, device=d), 3), torch.full((2,), 3.0)),
    (lambda d: torch.empty(3, 4, device=d).fill_(2), torch.full((3, 4), 2.0)),
    (lambda d: torch.tensor(3.5, device=d), torch.tensor(3.5)),
    (lambda d: torch.tensor([True, False], device=d), torch.tensor([True, False])),
])
def test_deterministic_factories(dev, make, expected):
    t = make(dev)
    assert isinstance(t, genie.LazyTensor)
    got = t.cpu()
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)


def test_random_factories_respect_ranges(dev):
    r = torch.rand(1000, device=dev).cpu()
    assert 0 <= r.min() and r.max() < 1
    i = torch.randint(3, 9, (1000,), device=dev).cpu()
    assert i.dtype == torch.int64 and i.min() >= 3 and i.max() < 9
    n = torch.normal(5.0, 0.1, (1000,), device=dev).cpu()
    assert abs(n.mean().item() - 5.0) < 0.05
    like = torch.randn_like(torch.zeros(4, 4, device=dev))
    assert like.shape == (4, 4) and like.cpu().abs().sum() > 0


def test_to_device_roundtrip_keeps_values_and_dtypes(dev):
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        src = (torch.arange(24).reshape(2, 3, 4) % 5).to(dtype)
        back = src.to(dev).cpu()
        assert back.dtype == dtype
        assert torch.equal(back, src)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "float8_e8m0fnu"])
def test_low_precision_floats_travel_and_convert(dev, dtype):
    """FP8 and MX-scale dtypes: bytes exact both ways, and conversions on the daemon equal the CPU's."""
    dtype = getattr(torch, dtype)
    values = torch.tensor([0.5, 1.0, 2.0, 4.0, 0.25, 8.0])
    src = values.to(dtype)
    back = src.to(dev).cpu()
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    assert torch.equal(values.to(dev).to(dtype).cpu().view(torch.uint8), src.view(torch.uint8))
    assert torch.equal(src.to(dev)[1:4].float().cpu(), src[1:4].float())


def test_packed_fp4_travels_as_bytes(dev):
    src = torch.tensor([0x12, 0x3F, 0xA7, 0x00], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    remote = src.to(dev)
    assert remote.dtype == torch.float4_e2m1fn_x2
    assert torch.equal(torch.cat([remote, remote[:2]]).cpu().view(torch.uint8),
                       torch.cat([src, src[:2]]).view(torch.uint8))


def test_noncontiguous_upload(dev):
    src = torch.arange(12.).reshape(3, 4).t()
    r = src.to(dev)
    assert r.shape == (4, 3)
    assert torch.equal(r.cpu(), src)


@pytest.mark.parametrize("make", [
    lambda d: torch.tril_indices(4, 3, -1, device=d),
    lambda d: torch.triu_indices(3, 5, 1, dtype=torch.int32, device=d),
    lambda d: torch.kaiser_window(8, device=d),
    lambda d: torch.kaiser_window(7, periodic=False, device=d),
    lambda d: torch.kaiser_window(8, False, 5.0, dtype=torch.float64, device=d),
], ids=["tril_indices", "triu_indices", "kaiser", "kaiser_periodic", "kaiser_beta"])
def test_factories_without_a_device_generic_kernel(dev, make):
    """torch has these only per backend (or ending in a CPU/CUDA-only kernel): made on the host, uploaded."""
    got = make(dev)
    assert got.device == torch.device(dev)
    want = make("cpu")
    assert got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("args, kwargs", [
    ((7,), {}), ((3, 10), {}), ((10, 3, -2), {}), ((5, 5), {}), ((0, 10, 3), {"dtype": torch.float32}),
    ((0, 4), {"dtype": torch.int32}), ((-5, 5), {"dtype": torch.float16}),
    ((0.5, 3), {}), ((7.0,), {}), ((0, 1, 0.25), {}),  # float bounds: torch's composite form
], ids=["end", "start_end", "negative_step", "empty", "float_dtype", "int32", "half", "float_start",
        "float_end", "float_step"])
def test_arange_on_the_device(dev, sent_ops, args, kwargs):
    torch.remote_accelerator.synchronize()
    sent_ops.clear()  # what earlier tests left queued
    got = torch.arange(*args, device=dev, **kwargs)
    want = torch.arange(*args, **kwargs)
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    assert torch.equal(got.cpu(), want)
    if all(type(a) is int for a in args):  # one op, its length worked out on the client
        assert [op for op in sent_ops if "arange" in op or "empty" in op] == ["aten::arange.start_step"]
    with pytest.raises(RuntimeError, match="inconsistent with step sign"):
        torch.arange(0, 5, -1, device=dev)


def test_tensor_from_data_is_one_upload(dev, sent_ops):
    """torch.tensor(data, device=) uploads the data; its lift_fresh (a marker for functionalization)
    is the tensor itself, as torch's kernel returns, not an op for the daemon."""
    t = torch.tensor([[1, 2], [3, 4]], device=dev)
    assert t.cpu().tolist() == [[1, 2], [3, 4]]
    assert not any("lift_fresh" in op for op in sent_ops)


@pytest.mark.parametrize("make", [
    lambda d: torch.zeros(3, 4, device=d), lambda d: torch.ones(2, dtype=torch.int32, device=d),
    lambda d: torch.full((2, 3), 7.5, device=d), lambda d: torch.full((2,), 3, device=d),
    lambda d: torch.full((2,), True, device=d), lambda d: torch.zeros((), device=d),
    lambda d: torch.zeros(0, 3, device=d), lambda d: torch.full((3,), float("-inf"), dtype=torch.float16, device=d),
    lambda d: torch.ones(2, 2, dtype=torch.bfloat16, device=d),
    lambda d: torch.full((2,), 1 + 2j, device=d),  # complex fill: torch's composite form
], ids=["zeros", "ones_int32", "full_float", "full_int", "full_bool", "zeros_0d", "zeros_empty", "full_neg_inf_half",
        "ones_bf16", "full_complex"])
def test_zeros_ones_full_are_one_op(dev, sent_ops, make):
    torch.remote_accelerator.synchronize()
    sent_ops.clear()
    got, want = make(dev), make("cpu")
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert torch.equal(got.cpu(), want)
    if not want.is_complex():
        assert len(sent_ops) == 1 and sent_ops[0] in ("aten::zeros", "aten::ones", "aten::full")


def test_forward_mode_autodiff_and_hessians(dev):
    """Forward-mode AD makes zero tangents with torch._efficientzerotensor, which had no kernel
    for the device (torch.func.hessian and jacfwd raised NotImplementedError)."""
    from torch.func import hessian, jacfwd, jvp

    def f(x):
        return (x.sin() * x.pow(2)).sum(-1)

    x, v = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(hessian(lambda z: f(z).sum())(x[0].to(dev)).cpu(), hessian(lambda z: f(z).sum())(x[0]),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(jacfwd(f)(x.to(dev)).cpu(), jacfwd(f)(x), atol=1e-5, rtol=1e-4)
    _, tangent = jvp(f, (x.to(dev),), (v.to(dev),))
    torch.testing.assert_close(tangent.cpu(), jvp(f, (x,), (v,))[1], atol=1e-5, rtol=1e-4)
    zeros = torch._efficientzerotensor((2, 3), dtype=torch.float64, device=dev)
    assert zeros.dtype == torch.float64 and torch.equal(zeros.cpu(), torch.zeros(2, 3, dtype=torch.float64))
