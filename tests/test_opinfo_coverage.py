"""Backend coverage measured as PyTorch measures one: OpInfo float32 samples equal to the CPU (>= 90%)."""
import pytest

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
