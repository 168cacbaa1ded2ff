"""daemon/layouts.py: results of backend-layout ops follow the agreed rule whatever the kernel returns."""
import torch

from daemon import layouts
from genie.transport.layout_contract import convolution_format

CL = torch.channels_last


def test_a_kernel_that_returns_another_layout_is_made_to_follow_the_rule():
    contiguous_conv = layouts._convolution(lambda *a, **k: torch.ops.aten.convolution(*a, **k).contiguous())
    x, w = torch.randn(1, 3, 6, 6).to(memory_format=CL), torch.randn(4, 3, 3, 3)
    out = contiguous_conv(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert out.is_contiguous(memory_format=CL)
    torch.testing.assert_close(out, torch.nn.functional.conv2d(x, w))
    to_cl_pad = layouts._padding(lambda t, p: torch.ops.aten.reflection_pad2d(t, p).contiguous(memory_format=CL))
    assert to_cl_pad(torch.randn(1, 3, 4, 4), [1, 1, 1, 1]).is_contiguous()  # contiguous input: contiguous


def test_the_rule_is_channels_last_when_input_or_weight_suggests_it():
    x, w = torch.randn(1, 3, 6, 6), torch.randn(4, 3, 3, 3)
    assert convolution_format(x, w) == torch.contiguous_format
    assert convolution_format(x.to(memory_format=CL), w) == CL
    assert convolution_format(x, w.to(memory_format=CL)) == CL
    assert convolution_format(torch.randn(1, 3, 6), torch.randn(4, 3, 3)) == torch.contiguous_format
    for name in ("aten::convolution", "aten::convolution_backward", "aten::reflection_pad2d", "aten::replication_pad3d"):
        assert layouts.replacement(name) is not None
    assert layouts.replacement("aten::add.Tensor") is None


def test_results_take_the_planned_strides_of_size_one_dimensions_only():
    x = torch.randn(8, 8, 32).permute(2, 0, 1).unsqueeze(0)  # (1, 32, 8, 8), strides (32, 1, 256, 32)
    y = layouts.with_planned_strides(x, [2048, 1, 256, 32])
    assert y.stride() == (2048, 1, 256, 32) and y.data_ptr() == x.data_ptr() and torch.equal(y, x)
    assert layouts.with_planned_strides(x, [32, 256, 1, 32]) is x  # a real difference: left as the kernel made it
    assert layouts.with_planned_strides(x, [2048, 1, 256]) is x and layouts.with_planned_strides(x, None) is x
    pair = layouts.with_planned_strides((x, torch.ones(2)), [[2048, 1, 256, 32], None])
    assert pair[0].stride() == (2048, 1, 256, 32) and pair[1].stride() == (1,)


def test_group_norm_on_a_gpu_gets_a_contiguous_input_and_gives_the_planned_layout():
    # CUDA's native_group_norm refuses a channels-last input, which torch's composite group_norm
    # hands remote_accelerator as it does the CPU. Meta tensors stand in for a GPU's here.
    aten = torch.ops.aten
    seen = []

    def kernel(*args):
        seen.append([a.is_contiguous() for a in args[:2] if isinstance(a, torch.Tensor)])
        return (aten.native_group_norm_backward.default if len(args) == 10 else aten.native_group_norm.default)(*args)

    forward, backward = layouts._group_norm_on_gpu(kernel, 1), layouts._group_norm_on_gpu(kernel, 2)
    x = torch.empty(2, 32, 4, 4, device="meta").to(memory_format=CL)
    y, mean, rstd = forward(x, None, None, 2, 32, 16, 8, 1e-5)
    assert seen == [[True], [False]]  # the kernel ran on a contiguous input; the plan on the client's
    assert y.stride() == x.stride() and mean.shape == (2, 8)  # as the client planned
    seen.clear()
    grads = backward(y, x, mean, rstd, torch.empty(32, device="meta"), 2, 32, 16, 8, [True, True, True])
    assert seen == [[True, True], [False, False]] and grads[0].stride() == x.stride()
    seen.clear()
    cpu_x = torch.randn(2, 32, 4, 4).to(memory_format=CL)  # the CPU's kernel takes it as it is
    torch.testing.assert_close(forward(cpu_x, None, None, 2, 32, 16, 8, 1e-5)[0],
                               torch.nn.functional.group_norm(cpu_x, 8))
    assert seen == [[False]]
    assert layouts.replacement("aten::native_group_norm") is not None
