"""bench.opinfo_sweep.samples_of makes an OpInfo's samples without PyTorch's `sample_inputs`
iterator (whose seeding and unittest look-ups cost most of the sweep's time outside the daemon),
relying on torch internals: the `sample_inputs_func(op, device, dtype, requires_grad)` signature
and the iterator seeding every generator with the tests' SEED before each sample. This checks the
samples are still PyTorch's, tensor by tensor, so a torch upgrade that changes either shows here
rather than as a quietly different sweep. No daemon: the samples are made on the CPU.
"""
import os
import sys

import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest")

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.opinfo_sweep import samples_of  # noqa: E402

# Every op's samples are random tensors (make_tensor draws from the CPU generator); these also make
# random index, mask or target tensors, or many samples (max_unpool2d: 288). Making them takes well
# under a second; importing the OpInfo database takes most of this file's time.
OPS = ["add", "matmul", "nn.functional.conv2d", "nn.functional.embedding", "index_put", "scatter_add",
       "masked_select", "nn.functional.max_unpool2d", "nn.functional.interpolate", "sort", "cumsum",
       "linalg.solve", "nn.functional.cross_entropy", "nn.functional.dropout", "take_along_dim"]


def _same(a, b) -> bool:
    left, left_spec = pytree.tree_flatten([a.input, a.args, a.kwargs])
    right, right_spec = pytree.tree_flatten([b.input, b.args, b.kwargs])
    if left_spec != right_spec:
        return False
    for x, y in zip(left, right):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if (x.dtype, x.shape, x.requires_grad, x.layout) != (y.dtype, y.shape, y.requires_grad, y.layout):
                return False
            x, y = x.detach(), y.detach()
            if x.layout == torch.strided and not torch.equal(x, y):
                inexact = x.is_floating_point() or x.is_complex()  # where NaNs may be, counted equal
                if not (inexact and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)):
                    return False
        elif x != y and not (x != x and y != y):  # NaN scalars equal
            return False
    return True


@pytest.mark.parametrize("dtype, requires_grad", [(torch.float32, False), (torch.float32, True),
                                                  (torch.complex64, False)])
def test_samples_are_pytorchs(dtype, requires_grad):
    from torch.testing._internal.common_methods_invocations import op_db

    checked = 0
    for opinfo in (op for op in op_db if op.name in OPS):
        if not opinfo.supports_dtype(dtype, "cpu") or (requires_grad and not opinfo.supports_autograd):
            continue
        ours = samples_of(opinfo, dtype, requires_grad)
        theirs = list(opinfo.sample_inputs("cpu", dtype, requires_grad=requires_grad))
        assert len(ours) == len(theirs), opinfo.name
        differing = [i for i, (a, b) in enumerate(zip(ours, theirs)) if not _same(a, b)]
        assert not differing, f"{opinfo.name} ({opinfo.variant_test_name}): samples {differing} differ"
        checked += len(ours)
    assert checked > (100 if dtype == torch.float32 else 40)  # the ops were found and made samples
