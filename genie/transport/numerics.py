"""The numerics settings a client's ops run under on the daemon, and their wire form.

PyTorch keeps these as process-wide flags that its kernels read when they launch:
TF32 and bf16 for float32 matmuls and convolutions (`torch.set_float32_matmul_precision`,
`torch.backends.cuda.matmul.allow_tf32` / `.fp32_precision`, `torch.backends.cudnn.allow_tf32`),
reduced-precision reductions, cuDNN's `enabled` / `benchmark` / `deterministic`,
`torch.use_deterministic_algorithms`, and which scaled_dot_product_attention backends may run
(`torch.nn.attention.sdpa_kernel`: flash, memory-efficient, math, cuDNN, ... and their priority).
A program sets them in its own process; its ops run in
the daemon's. So the client reads them when it sends a batch of ops (`current`, ~2 us) and, when
they differ from PyTorch's defaults, the batch carries them; the daemon checks them (`parse`)
and sets them before running a batch whose settings differ from those in force (`apply`). The
daemon runs one request at a time, so each client's ops see its own settings.

Wire form: a list in `FIELDS` order; absent means `DEFAULT` (PyTorch's defaults).
"""
from __future__ import annotations

import logging

import torch

from .errors import ProtocolError

log = logging.getLogger("genie.transport")

# (backend, op) of PyTorch's fp32_precision settings: "none" (inherit), "ieee", "tf32", "bf16".
PRECISION_SLOTS = (("generic", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
                   ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))
PRECISIONS = frozenset({"none", "ieee", "tf32", "bf16"})
# Then: cuBLAS fp16 and bf16 reduced-precision reductions ([allowed, split-k allowed] each),
# fp16 accumulation in cuBLAS, CPU fp16 reduced-precision reduction, cuDNN enabled / benchmark /
# deterministic, deterministic algorithms, their warn-only mode, filling uninitialized memory;
# the attention backends allowed (flash, memory-efficient, math, cuDNN, overrideable, FA3), the
# math backend's fp16/bf16 reduction, and the backends' priority order (SDPBackend values).
SDP_BACKENDS = ("flash", "mem_efficient", "math", "cudnn", "overrideable", "fa3")
FLAG_NAMES = ("cublas_fp16_reduction", "cublas_bf16_reduction", "cublas_fp16_accumulation", "cpu_fp16_reduction",
              "cudnn_enabled", "cudnn_benchmark", "cudnn_deterministic", "deterministic_algorithms",
              "deterministic_warn_only", "fill_uninitialized_memory") + tuple(
              f"sdp_{b}" for b in SDP_BACKENDS) + ("sdp_math_fp16_bf16_reduction", "sdp_priority_order")
FIELDS = tuple(f"fp32_precision_{b}_{o}" for b, o in PRECISION_SLOTS) + FLAG_NAMES
PAIRS = {"cublas_fp16_reduction", "cublas_bf16_reduction"}
SDP_ORDER_LENGTH = 5  # MATH, FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION, OVERRIDEABLE

DEFAULT = ["none", "none", "tf32", "tf32", "none", "none", "none",
           [True, True], [True, True], False, False, True, False, False, False, False, True,
           True, True, True, True, True, False, False, [1, 2, 0, 3, 4]]

_DEFAULTS = dict(zip(FIELDS, DEFAULT))
_C = torch._C
_GETTERS = ("_get_fp32_precision_getter", "_get_cublas_allow_fp16_reduced_precision_reduction",
            "_get_cublas_allow_bf16_reduced_precision_reduction", "_get_cublas_allow_fp16_accumulation",
            "_get_cpu_allow_fp16_reduced_precision_reduction", "_get_cudnn_enabled", "_get_cudnn_benchmark",
            "_get_cudnn_deterministic", "_get_deterministic_algorithms", "_get_deterministic_algorithms_warn_only",
            "_get_deterministic_fill_uninitialized_memory", "_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled",
            "_get_math_sdp_enabled", "_get_cudnn_sdp_enabled", "_get_overrideable_sdp_enabled", "_get_fa3_sdp_enabled",
            "_get_math_sdp_allow_fp16_bf16_reduction", "_get_sdp_priority_order")
AVAILABLE = all(hasattr(_C, name) for name in _GETTERS)


def read() -> list:
    """This process's settings, in wire form."""
    precision = _C._get_fp32_precision_getter
    values: list = [precision(b, o) for b, o in PRECISION_SLOTS]
    values += [list(_C._get_cublas_allow_fp16_reduced_precision_reduction()),
               list(_C._get_cublas_allow_bf16_reduced_precision_reduction()),
               _C._get_cublas_allow_fp16_accumulation(), _C._get_cpu_allow_fp16_reduced_precision_reduction(),
               _C._get_cudnn_enabled(), _C._get_cudnn_benchmark(), _C._get_cudnn_deterministic(),
               _C._get_deterministic_algorithms(), _C._get_deterministic_algorithms_warn_only(),
               _C._get_deterministic_fill_uninitialized_memory(),
               _C._get_flash_sdp_enabled(), _C._get_mem_efficient_sdp_enabled(), _C._get_math_sdp_enabled(),
               _C._get_cudnn_sdp_enabled(), _C._get_overrideable_sdp_enabled(), _C._get_fa3_sdp_enabled(),
               _C._get_math_sdp_allow_fp16_bf16_reduction(), list(_C._get_sdp_priority_order())]
    return values


def current() -> list | None:
    """What a batch sent now carries: this process's settings, or None when they are PyTorch's
    defaults (or this PyTorch cannot report them; logged once)."""
    if not AVAILABLE:
        _warn_unavailable()
        return None
    values = read()
    return None if values == DEFAULT else values


_warned = False


def _warn_unavailable() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("this PyTorch (%s) cannot report its numerics settings (TF32, deterministic algorithms, "
                    "cuDNN flags): remote ops run under the daemon's defaults", torch.__version__)


def parse(value) -> list:
    """A batch's settings as received: checked field by field."""
    if type(value) is not list or len(value) != len(FIELDS):
        raise ProtocolError(f"numerics must be a list of {len(FIELDS)} settings")
    for name, v in zip(FIELDS, value):
        if name.startswith("fp32_precision_"):
            ok = type(v) is str and v in PRECISIONS
        elif name in PAIRS:
            ok = type(v) is list and len(v) == 2 and all(type(b) is bool for b in v)
        elif name == "sdp_priority_order":  # a permutation of the backends
            ok = type(v) is list and all(type(b) is int for b in v) and sorted(v) == list(range(SDP_ORDER_LENGTH))
        else:
            ok = type(v) is bool
        if not ok:
            raise ProtocolError(f"numerics: bad {name} {v!r}")
    return value


def apply(values: list) -> None:
    """Set this process's flags to `values` (wire form, checked). Raises RuntimeError where this
    PyTorch refuses one (e.g. bf16 matmuls on a CPU without them)."""
    precision = dict(zip(PRECISION_SLOTS, values))
    # PyTorch also keeps the settings' older form, and refuses to read them when the two forms
    # disagree ("mix of the legacy and new APIs"): that form first (it sets both), then each
    # setting exactly.
    tf32_matmul, bf16_matmul = precision["cuda", "matmul"] == "tf32", precision["mkldnn", "matmul"] == "bf16"
    _C._set_float32_matmul_precision("medium" if bf16_matmul else "high" if tf32_matmul else "highest")
    _C._set_cudnn_allow_tf32(precision["cuda", "conv"] == "tf32")
    setter = _C._set_fp32_precision_setter
    for (backend, op), value in precision.items():
        setter(backend, op, value)
    flags = dict(zip(FLAG_NAMES, values[len(PRECISION_SLOTS):]))
    _C._set_cublas_allow_fp16_reduced_precision_reduction(*flags["cublas_fp16_reduction"])
    _C._set_cublas_allow_bf16_reduced_precision_reduction(*flags["cublas_bf16_reduction"])
    _C._set_cublas_allow_fp16_accumulation(flags["cublas_fp16_accumulation"])
    _C._set_cpu_allow_fp16_reduced_precision_reduction(flags["cpu_fp16_reduction"])
    _C._set_cudnn_enabled(flags["cudnn_enabled"])
    _C._set_cudnn_benchmark(flags["cudnn_benchmark"])
    _C._set_cudnn_deterministic(flags["cudnn_deterministic"])
    torch.use_deterministic_algorithms(flags["deterministic_algorithms"], warn_only=flags["deterministic_warn_only"])
    _C._set_deterministic_fill_uninitialized_memory(flags["fill_uninitialized_memory"])
    for backend in SDP_BACKENDS:
        _set_sdp(f"_set_sdp_use_{backend}", f"sdp_{backend}", flags)
    _set_sdp("_set_math_sdp_allow_fp16_bf16_reduction", "sdp_math_fp16_bf16_reduction", flags)
    _set_sdp("_set_sdp_priority_order", "sdp_priority_order", flags)


def _set_sdp(setter: str, field: str, flags: dict) -> None:
    """An attention-backend setting, on a daemon whose PyTorch may predate it: where it has no
    such setting, only PyTorch's default can be honoured, and anything else is refused."""
    set_it, value = getattr(_C, setter, None), flags[field]
    if set_it is not None:
        set_it(value)
    elif value != _DEFAULTS[field]:
        raise RuntimeError(f"this daemon's PyTorch ({torch.__version__}) has no {setter}: it cannot run "
                           f"scaled_dot_product_attention with that setting ({value!r})")
