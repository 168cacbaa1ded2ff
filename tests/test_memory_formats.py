"""Channels-last tensors: planned strides equal the daemon's, so views and reshapes of results
are right. Convolution and reflection/replication padding leave their result's layout to the
backend (see daemon/layouts.py); every other op here must agree by PyTorch's own rules."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import genie

CL, CL3 = torch.channels_last, torch.channels_last_3d


def _x4():
    return torch.randn(2, 4, 8, 8).to(memory_format=CL)


def _x5():
    return torch.randn(2, 4, 4, 4, 4).to(memory_format=CL3)


W4, W4_DEPTHWISE, W4_T, W5 = (torch.randn(6, 4, 3, 3), torch.randn(4, 1, 3, 3), torch.randn(4, 6, 3, 3),
                              torch.randn(3, 4, 2, 2, 2))
CASES = {
    "conv2d, both channels-last": (_x4, lambda t, d: F.conv2d(t, W4.to(d, memory_format=CL), padding=1)),
    "conv2d, input channels-last": (_x4, lambda t, d: F.conv2d(t, W4.to(d), padding=1)),
    "conv2d, weight channels-last": (lambda: _x4().contiguous(), lambda t, d: F.conv2d(t, W4.to(d, memory_format=CL))),
    "conv2d, neither": (lambda: _x4().contiguous(), lambda t, d: F.conv2d(t, W4.to(d))),
    "depthwise conv2d": (_x4, lambda t, d: F.conv2d(t, W4_DEPTHWISE.to(d, memory_format=CL), padding=1, groups=4)),
    "conv_transpose2d": (_x4, lambda t, d: F.conv_transpose2d(t, W4_T.to(d, memory_format=CL), padding=1)),
    "conv3d": (_x5, lambda t, d: F.conv3d(t, W5.to(d, memory_format=CL3))),
    "reflection pad 2d": (_x4, lambda t, d: F.pad(t, (1, 1, 1, 1), mode="reflect")),
    "replication pad 2d": (_x4, lambda t, d: F.pad(t, (1, 2, 1, 2), mode="replicate")),
    "reflection pad 3d": (_x5, lambda t, d: F.pad(t, (1, 1, 1, 1, 1, 1), mode="reflect")),
    "replication pad 3d": (_x5, lambda t, d: F.pad(t, (1, 1, 1, 1, 1, 1), mode="replicate")),
    "max pool": (_x4, lambda t, d: F.max_pool2d(t, 2)),
    "bilinear upsample": (_x4, lambda t, d: F.interpolate(t, scale_factor=2, mode="bilinear")),
    "batch norm": (_x4, lambda t, d: F.batch_norm(t, None, None, training=True)),
    "adaptive average pool": (_x4, lambda t, d: F.adaptive_avg_pool2d(t, 3)),
}


def _flat_storage_order(t):
    """The values in the order the result's memory holds them (needs the right strides to be right)."""
    return t.as_strided((t.numel(),), (1,))


@pytest.mark.parametrize("name", sorted(CASES))
def test_results_have_the_strides_the_client_planned(dev, name):
    make, op = CASES[name]
    torch.manual_seed(0)
    x = make()
    expected = op(x, "cpu")
    got = op(x.to(dev), dev)
    assert got.stride() == expected.stride()  # the CPU kernels' own layout, planned on the client
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_flat_storage_order(got).cpu(), _flat_storage_order(expected), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.reshape(-1).cpu(), expected.reshape(-1), atol=1e-4, rtol=1e-4)


def test_a_channels_last_cnn_trains_like_the_cpu(dev):
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(32, 5)).to(memory_format=CL)
    remote = copy.deepcopy(model).to(dev, memory_format=CL)
    x = torch.randn(4, 3, 8, 8).to(memory_format=CL)
    target = torch.tensor([0, 1, 2, 3])
    F.cross_entropy(model(x), target).backward()
    F.cross_entropy(remote(x.to(dev)), target.to(dev)).backward()
    for (name, p), q in zip(model.named_parameters(), remote.parameters()):
        assert q.grad.stride() == p.grad.stride(), name
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_a_replayed_channels_last_conv_keeps_the_planned_layout(dev):
    w = W4.to(dev, memory_format=CL)
    x = _x4()
    rx, out = x.to(dev), torch.zeros(2 * 6 * 8 * 8, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        out.copy_(F.conv2d(rx, w, padding=1).reshape(-1))  # reshape: a view only if the layout is as planned
    g.replay()
    torch.testing.assert_close(out.cpu(), F.conv2d(x, W4.to(memory_format=CL), padding=1).reshape(-1),
                               atol=1e-4, rtol=1e-4)


def _batch_of_one_with_stride_c():
    """(1, 32, 8, 8), channels-last, batch stride 32: as the reshape after a UNet's attention block
    leaves it (diffusers' UNet2DModel sampling one image). Its size-1 dimension's stride is one
    that PyTorch's meta kernels and its CPU kernels set differently for results computed from it."""
    return torch.randn(8, 8, 32).permute(2, 0, 1).unsqueeze(0)


def test_size_one_dimensions_have_the_planned_strides_on_the_daemon(dev):
    from genie.frontend.transfers import storage_of

    x = _batch_of_one_with_stride_c()
    assert x.stride() == (32, 1, 256, 32)
    for y in (x.to(dev) / 1.0, x.to(dev) + 1, torch.relu(x.to(dev)), x.to(dev).sigmoid()):
        assert tuple(storage_of(y)[3]) == y.stride()  # the daemon's tensor, as the client planned it


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_group_norm_of_a_result_with_a_size_one_dimension(dev, grad):
    # group_norm decomposes on the client, choosing channels-last or not from the strides it
    # planned; the daemon's kernel checks its input against its own: they failed to agree
    # ("Expected X.is_contiguous(memory_format)") when the two strides differed.
    torch.manual_seed(0)
    x = _batch_of_one_with_stride_c()
    weight, bias = torch.randn(32), torch.randn(32)

    def run(device):
        w = weight.to(device, copy=True).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = F.group_norm(x.to(device) / 1.0, 8, w, bias.to(device))
            if grad:
                (out * out).sum().backward()
        return out.detach().cpu(), (w.grad.cpu() if grad else None)

    (expected, expected_grad), (got, got_grad) = run("cpu"), run(dev)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if grad:
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-4, rtol=1e-4)


def test_group_norm_of_a_result_with_a_size_one_dimension_replays(dev):
    # A replayed program runs the daemon's kernels without the client: the planned strides are
    # part of what it recorded.
    x = _batch_of_one_with_stride_c()
    rx, out = x.to(dev), torch.empty(1, 32, 8, 8, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        out.copy_(F.group_norm(rx * 2.0, 8))
    rx.copy_(x + 1)
    g.replay()
    torch.testing.assert_close(out.cpu(), F.group_norm((x + 1) * 2.0, 8), atol=1e-5, rtol=1e-5)


_LAYOUTS = {  # each made on a device from the same CPU values
    "channels-last": lambda v, d: v.to(d).view(2, 4, 4, 8).contiguous(memory_format=CL),
    "transposed": lambda v, d: v.to(d).view(16, 16).t(),
    "expanded": lambda v, d: v.to(d)[:4].view(4, 1).expand(4, 3),
    "strided": lambda v, d: v.to(d).view(16, 16)[:, ::2],
    "permuted view": lambda v, d: v.to(d).view(4, 8, 8).permute(2, 0, 1)[1:],
}
_MOVES = {
    "cpu": lambda t, d: t.cpu() if d == "cpu" else t.to(d),
    "to": lambda t, d: t.to(d),
    "to-dtype": lambda t, d: t.to(d, torch.float64),
    "preserve": lambda t, d: t.to(d, memory_format=torch.preserve_format),
    "contiguous": lambda t, d: t.to(d, memory_format=torch.contiguous_format),
}


@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("move", _MOVES)
def test_moving_to_the_cpu_lays_out_the_copy_as_pytorch_does(dev, layout, move):
    """`.cpu()` / `.to("cpu")` of a remote tensor came back row-major whatever its layout; PyTorch
    copies across devices with preserve_format (a channels-last tensor stays channels-last on the
    CPU, as from CUDA). PyTorch's own layout for such a copy: the same move to the meta device."""
    values = torch.randn(2, 4, 4, 8).flatten()
    make, to = _LAYOUTS[layout], _MOVES[move]
    got = to(make(values, dev), "cpu")
    want = to(make(values, "cpu"), "meta")
    assert got.device.type == "cpu" and got.dtype == want.dtype
    assert (got.shape, got.stride()) == (want.shape, want.stride())
    assert torch.equal(got, to(make(values, "cpu").clone(), "cpu").to(want.dtype))


@pytest.mark.parametrize("nbytes", [4 << 10, 2 << 20, 24 << 20], ids=["in the reply", "named segment or lane", "bulk lane"])
def test_a_channels_last_tensor_comes_back_as_it_lies_on_a_cpu_daemon(two_daemons, nbytes):
    """A CPU daemon sent a channels-last (or transposed) tensor permuted into row-major order, and
    .cpu() then permuted it back (a 64 MiB batch took ~105 ms against ~7 for a contiguous one).
    Now its bytes go as they lie, with its strides, over every path a fetch takes (tcp and ipc)."""
    channels = nbytes // (4 * 8 * 8 * 2)
    x = torch.randn(2, channels, 8, 8).contiguous(memory_format=CL)
    for device in ("remote_accelerator:0", "remote_accelerator:1"):
        r = x.to(device)
        assert r.is_contiguous(memory_format=CL)
        got, t = genie.materialize_sync([r, r.transpose(2, 3)])
        assert got.stride() == x.stride() and torch.equal(got, x)
        assert t.stride() == x.transpose(2, 3).stride() and torch.equal(t, x.transpose(2, 3))


@pytest.mark.parametrize("nbytes", [4 << 10, 2 << 20, 24 << 20], ids=["in the message", "segment or lane", "bulk lane"])
def test_a_channels_last_upload_is_adopted_as_it_lies(two_daemons, sent_ops, nbytes):
    """`.to(dev)` of a channels-last (or transposed) CPU tensor (a model made channels-last before
    it moves) was permuted to row-major here, copied in and permuted back on the daemon: ~115 ms
    for 64 MiB against ~8 contiguous. Its memory now goes as it lies and the daemon keeps it with
    its strides, as it keeps a contiguous upload (genie::adopt, no copy there)."""
    from genie.frontend.transfers import storage_of

    channels = nbytes // (4 * 8 * 8 * 2)
    x = torch.randn(2, channels, 8, 8).contiguous(memory_format=CL)
    for device in ("remote_accelerator:0", "remote_accelerator:1"):
        for src in (x, x.transpose(2, 3)):
            sent_ops.clear()
            r = src.to(device)
            torch.remote_accelerator.synchronize(device)
            assert "genie::adopt" in sent_ops and "aten::copy_" not in sent_ops, sent_ops
            assert r.stride() == src.stride() and tuple(storage_of(r)[3]) == src.stride()  # on the daemon too
            assert torch.equal(r.cpu(), src) and torch.equal((r * 1).cpu(), src)
    conv = nn.Conv2d(channels, 4, 3).to(memory_format=CL)
    expected = conv(x)
    conv.to("remote_accelerator:1")
    assert conv.weight.is_contiguous(memory_format=CL)
    torch.testing.assert_close(conv(x.to("remote_accelerator:1")).cpu(), expected, rtol=1e-4, atol=1e-4)
