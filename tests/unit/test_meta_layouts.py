"""daemon/layouts.py's meta-following kernels: a result the CPU lays out otherwise than the meta
kernel takes the meta kernel's strides (the ones the client planned), values unchanged."""
import torch

from daemon import layouts


def test_svd_factors_take_the_planned_layout():
    a = torch.randn(3, 5, 4)
    run = layouts.replacement("aten::_linalg_svd")
    u, s, vh = run(a)
    planned = torch.ops.aten._linalg_svd(a.to("meta"))
    assert torch.ops.aten._linalg_svd(a)[2].stride() != planned[2].stride()  # the CPU kernel differs
    assert (u.stride(), s.stride(), vh.stride()) == tuple(p.stride() for p in planned)
    torch.testing.assert_close(u @ torch.diag_embed(s) @ vh, a, atol=1e-5, rtol=1e-5)


def test_unusual_inputs_only_pay_for_the_meta_kernel():
    a = torch.randn(4, 6).t().contiguous().t()  # column-major
    b = torch.randn(4, 6)
    run = layouts.replacement("aten::logical_and")
    out = run(a > 0, b > 0)
    assert out.stride() == torch.logical_and((a > 0).to("meta"), (b > 0).to("meta")).stride()
    torch.testing.assert_close(out, torch.logical_and(a > 0, b > 0))
    contiguous = run(b > 0, b > 0)
    assert contiguous.is_contiguous()
