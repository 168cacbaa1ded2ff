"""The numerics settings' wire form: read, checked, applied (no sockets)."""
from __future__ import annotations

import pytest
import torch

from genie.transport import numerics
from genie.transport.errors import ProtocolError

pytestmark = pytest.mark.skipif(not numerics.AVAILABLE, reason="this PyTorch cannot report its numerics settings")


@pytest.fixture
def restore_defaults():
    yield
    numerics.apply(numerics.DEFAULT)
    assert numerics.current() is None


def test_defaults_travel_as_nothing(restore_defaults):
    assert numerics.read() == numerics.DEFAULT
    assert numerics.current() is None


def test_what_a_program_sets_is_read_and_applied_back(restore_defaults):
    torch.set_float32_matmul_precision("high")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    # The context manager, as PyTorch's test utilities (imported by other tests here) forbid
    # setting cuDNN flags directly (torch.backends.disable_global_flags).
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=True):
        settings = numerics.current()
    assert settings is not None and numerics.parse(settings) == settings
    named = dict(zip(numerics.FIELDS, settings))
    assert named["fp32_precision_cuda_matmul"] == "tf32" and named["cudnn_benchmark"]
    assert named["deterministic_algorithms"] and named["deterministic_warn_only"]
    assert named["cublas_bf16_reduction"][0] is False
    numerics.apply(numerics.DEFAULT)
    assert torch.get_float32_matmul_precision() == "highest" and not torch.are_deterministic_algorithms_enabled()
    numerics.apply(settings)
    assert numerics.read() == settings


def test_attention_backend_choices_are_read_and_applied_back(restore_defaults):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        settings = numerics.current()
    named = dict(zip(numerics.FIELDS, settings))
    assert named["sdp_math"] and named["sdp_flash"] and not named["sdp_overrideable"]
    assert named["sdp_priority_order"][:2] == [0, 1]
    numerics.apply(settings)
    assert numerics.read() == settings and not torch._C._get_mem_efficient_sdp_enabled()
    numerics.apply(numerics.DEFAULT)
    assert numerics.current() is None


@pytest.mark.parametrize("bad", [
    None, "tf32", [], numerics.DEFAULT[:-1], numerics.DEFAULT + [True],
    ["fast", *numerics.DEFAULT[1:]],
    [*numerics.DEFAULT[:7], [True], *numerics.DEFAULT[8:]],
    [*numerics.DEFAULT[:7], [True, 1], *numerics.DEFAULT[8:]],
    [*numerics.DEFAULT[:-1], 1],
    [*numerics.DEFAULT[:-1], [1, 1, 0, 3, 4]],  # attention backends' priority: not a permutation
    [*numerics.DEFAULT[:-1], [1, 2, 0, 3]],
    [*numerics.DEFAULT[:-1], [1, 2, 0, 3, 9]],
    [*numerics.DEFAULT[:-2], 1, numerics.DEFAULT[-1]],
])
def test_malformed_settings_are_refused(bad):
    with pytest.raises(ProtocolError, match="numerics"):
        numerics.parse(bad)
