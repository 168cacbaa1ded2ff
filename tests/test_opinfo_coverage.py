"""Backend coverage measured as PyTorch measures one: OpInfo float32 samples equal to the CPU (>= 90%),
complex64 samples passed as conjugate views (x.conj_physical().conj(), as PyTorch's tests of
math views do), the float32 samples' gradients (inputs that require grad, a weighted sum of
the outputs) and their forward-mode derivatives (every floating input a dual tensor) equal the CPU's.

The same samples check layouts: a result's memory on the daemon, read in storage order, must be
laid out by the strides the client planned for it, or views the client takes of it fail or read
the wrong elements. Where torch's kernels lay results out otherwise than its meta kernels, the
daemon follows the plan (daemon/layouts.py); no op may differ. The samples run as OpInfo gives
them, again channels-last (4-D and 5-D tensors: convolutions, padding and shuffles differ) and
again with every tensor's memory order reversed (some binary ops, batch norm, nll_loss differ).
"""
import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest")


@pytest.mark.parametrize("dtype, layout", [("float32", "as_given"), ("float32", "channels_last"),
                                           ("float32", "permuted"), ("complex64", "conj_view"),
                                           ("float32", "backward"), ("float32", "forward_ad")])
def test_opinfo_pass_rate(dev, dtype, layout):
    import sys
    import os

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench.opinfo_sweep import sweep

    backward = layout == "backward"  # gradients of the samples instead of their outputs
    forward_ad = layout == "forward_ad"  # forward-mode derivatives (dual tensors' tangents) instead
    result = sweep(dev=dev, layout="as_given" if backward or forward_ad else layout, dtype=getattr(torch, dtype),
                   backward=backward, forward_ad=forward_ad)
    print(f"OpInfo {dtype} ({layout}): {result['passed']} passed, {result['failed']} failed, "
          f"{result['pass_rate'] * 100:.1f}% over {result['ops']} ops")
    assert result["passed"] > (10_000 if dtype == "float32" else 5_000)  # the sweep really ran the database
    # Conjugate views: 98.1% while the wrappers lacked the daemon's bits (.real, .imag, convolutions
    # failed), 99.6% since (the rest: sparse results and, before they ran checked, unsafe ops, as for float32).
    # Gradients: 13,751 of 13,835 (99.4%) when added, the failures of the same kinds. Forward AD:
    # 12,606 of 12,679 (99.4%) when added (before its fixes the whole sweep broke after one
    # failure, and linear / matmul / layer_norm / softmax gave no tangent).
    assert result["pass_rate"] >= (0.99 if layout in ("conj_view", "backward", "forward_ad") else 0.90), \
        result["failures"]
    assert not result["layout_differs"], result["layout_differs"]


def test_a_reference_other_than_the_cpu(dev, sent_ops):
    """`--reference DEVICE` (against a CUDA daemon, this process's own GPU) takes the compared values
    from that device: arguments copied there, the op run there, results brought back. Here the
    device is the daemon itself: every sample's op then runs twice on it (once as the reference),
    and the two agree (outputs and forward AD)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench.opinfo_sweep import sweep

    def cumsums():
        return sum(1 for name in sent_ops if "cumsum" in name)

    alone = sweep(only={"cumsum"}, dev=dev)
    once = cumsums()
    outputs = sweep(only={"cumsum", "add", "mm", "nn.functional.conv2d", "conj_physical"}, dev=dev, reference=dev)
    assert once >= alone["passed"] > 0 and cumsums() - once == 2 * once
    assert outputs["failed"] == 0 and outputs["passed"] > 40, outputs["failures"]
    tangents = sweep(only={"mul", "sin", "mm"}, dev=dev, reference=dev, forward_ad=True)
    assert tangents["failed"] == 0 and tangents["passed"] > 10, tangents["failures"]
