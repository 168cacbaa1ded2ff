"""The daemon's CPU kernels for nn.SyncBatchNorm's ops (daemon/sync_batch_norm.py) against torch's
batch norm: a batch split over "processes" as SyncBatchNorm splits it (statistics per part,
combined; gradient sums per part, added, as its all-reduce adds them) gives the values, running
statistics and gradients of F.batch_norm over the whole batch."""
import pytest
import torch
import torch.nn.functional as F

from daemon import sync_batch_norm as sbn

EPS, MOMENTUM = 1e-5, 0.1


def _split_forward(parts, weight, bias, running_mean, running_var):
    stats = [sbn.stats(p, EPS) for p in parts]
    counts = torch.tensor([p.numel() // p.shape[1] for p in parts], dtype=torch.float32)
    mean, invstd = sbn.gather_stats_with_counts(parts[0], torch.stack([s[0] for s in stats]),
                                                torch.stack([s[1] for s in stats]), running_mean, running_var,
                                                MOMENTUM, EPS, counts)
    return [sbn.elemt(p, weight, bias, mean, invstd, EPS) for p in parts], mean, invstd, counts


@pytest.mark.parametrize("shape,channels_last", [((7, 3), False), ((6, 3, 4, 5), False), ((6, 3, 4, 5), True),
                                                 ((4, 2, 3, 3, 3), False)])
def test_split_batch_matches_batch_norm_forward_and_backward(shape, channels_last):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    weight = torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(shape, generator=g, dtype=torch.float64)
    want_rm, want_rv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    want = F.batch_norm(xr, want_rm, want_rv, weight, bias, training=True, momentum=MOMENTUM, eps=EPS)
    want.backward(grad_out)

    parts = [x[:2], x[2:]]  # unequal counts
    running_mean, running_var = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    outs, mean, invstd, counts = _split_forward(parts, weight.detach(), bias.detach(), running_mean, running_var)
    torch.testing.assert_close(torch.cat(outs), want.detach())
    torch.testing.assert_close(running_mean, want_rm)
    torch.testing.assert_close(running_var, want_rv)
    if channels_last:
        assert all(o.is_contiguous(memory_format=torch.channels_last) for o in outs)

    grad_parts = [grad_out[:2], grad_out[2:]]
    reduced = [sbn.backward_reduce(gp, p, mean, invstd, weight.detach(), True, True, True)
               for gp, p in zip(grad_parts, parts)]
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = (sum(r[i] for r in reduced) for i in range(4))
    torch.testing.assert_close(grad_weight, weight.grad)
    torch.testing.assert_close(grad_bias, bias.grad)
    grads = [sbn.backward_elemt(gp, p, mean, invstd, weight.detach(), sum_dy, sum_dy_xmu, counts.to(torch.int32))
             for gp, p in zip(grad_parts, parts)]
    torch.testing.assert_close(torch.cat(grads), xr.grad)


def test_half_inputs_keep_float_statistics_and_flags_leave_outputs_undefined():
    x = torch.randn(4, 3, 5).half()
    mean, invstd = sbn.stats(x, EPS)
    assert mean.dtype == invstd.dtype == torch.float32
    torch.testing.assert_close(mean, x.float().mean((0, 2)))
    out = sbn.elemt(x, None, None, mean, invstd, EPS)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, F.batch_norm(x.float(), None, None, training=True, eps=EPS).half())
    assert sbn.backward_reduce(x, x, mean, invstd, None, False, False, False) == (None, None, None, None)
    same = sbn.gather_stats(x, mean.repeat(2, 1), invstd.repeat(2, 1), None, None, MOMENTUM, EPS, 20)
    torch.testing.assert_close(same[0], mean)
    torch.testing.assert_close(same[1], invstd)
    # CUDA's convention for a constant channel with eps 0: an inverse std of 0, not inf.
    assert sbn.stats(torch.ones(2, 1, 3), 0.0)[1].item() == 0.0
