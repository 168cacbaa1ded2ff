"""Backend coverage measured as PyTorch measures one: OpInfo float32 samples equal to the CPU (>= 90%).

The same samples check layouts: the strides a client plans for a result (from the op's meta
kernel) must be the ones the daemon's kernel gives, or a view the client allows fails on the
daemon. Where torch's meta kernel and its CPU kernel disagree (these ops, in torch 2.13), the
values are right and only such views can fail; any other op doing so is a new bug.
"""
import pytest

# OpInfo names whose meta kernels lay some results out otherwise than the CPU kernels (torch 2.13):
# fft results, the factors of eig/svd, max_unpool2d's and nonzero_static's outputs.
KNOWN_LAYOUT_DIFFERENCES = {
    "fft.hfft2", "fft.hfftn", "fft.rfft2", "fft.rfftn", "linalg.eig", "linalg.svd", "svd", "pca_lowrank",
    "svd_lowrank", "nn.functional.max_unpool2d", "nonzero_static",
}

pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest")


def test_opinfo_float32_pass_rate(dev):
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench.opinfo_sweep import sweep

    result = sweep(dev=dev)
    print(f"OpInfo float32: {result['passed']} passed, {result['failed']} failed, "
          f"{result['pass_rate'] * 100:.1f}% over {result['ops']} ops")
    assert result["passed"] > 10_000  # the sweep really ran the database
    assert result["pass_rate"] >= 0.90, result["failures"]
    print("planned layouts that differ from the CPU's:", result["layout_differs"])
    assert set(result["layout_differs"]) <= KNOWN_LAYOUT_DIFFERENCES, result["layout_differs"]
