"""The `remote_accelerator` device: PrivateUse1 renamed, and `torch.remote_accelerator`.

`torch.remote_accelerator` mirrors `torch.cuda`'s module API. Every figure
comes from the connected daemons (device count, names, memory); nothing is
hard-coded. `device_count()` never raises: it is 0 when no daemon is reachable.
"""
from __future__ import annotations

import contextlib
import random
import sys
import types

import torch

from genie.runtime import get_runtime
from genie.runtime.device_type import DEVICE_TYPE
from genie.transport.protocol import PERSIST_OP, RNG_STATE_OP, SEED_OP, SET_RNG_STATE_OP

from . import capture, generators
from .sync_debug import get_sync_debug_mode, set_sync_debug_mode
from .streams import (Event, Stream, StreamContext, current_stream, default_stream, is_current_stream_capturing,
                      set_stream, stream)

# `except torch.remote_accelerator.OutOfMemoryError` as `except torch.cuda.OutOfMemoryError`: the
# same class, which Genie's error for a daemon out of memory is (genie.errors.RemoteOutOfMemoryError).
OutOfMemoryError = torch.OutOfMemoryError


_state = {"seed": None, "initial_seed": None}


def _index(device) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != DEVICE_TYPE:
        raise ValueError(f"expected a {DEVICE_TYPE} device, got {d}")
    return d.index


def _stream(device=None):
    return get_runtime().stream(_index(device))


# ------------------------------------------------------------------ availability


def device_count() -> int:
    return get_runtime().device_count()


def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return get_runtime().started


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    get_runtime().ensure_started()


def current_device() -> int:
    return get_runtime().current_device


def set_device(device) -> None:
    index = _index(device)
    if index is None:
        return
    rt = get_runtime()
    rt.stream(index)  # validates the index
    rt.current_device = index


@contextlib.contextmanager
def device(device):
    """Like torch.cuda.device: make `device` current inside the block, restore it after."""
    rt = get_runtime()
    previous = rt.current_device
    set_device(device)
    try:
        yield
    finally:
        rt.current_device = previous


def get_device_name(device=None) -> str:
    s = _stream(device)
    info = s.link.devices[s.local_index]
    return f"{info.get('name', 'unknown')} @ {s.link.endpoint}"


def get_device_properties(device=None) -> types.SimpleNamespace:
    s = _stream(device)
    info = dict(s.link.devices[s.local_index])
    return types.SimpleNamespace(endpoint=s.link.endpoint, **info)


def get_device_capability(device=None) -> tuple[int, int]:
    """The CUDA compute capability of the daemon's GPU; a CPU daemon has none, and says so."""
    s = _stream(device)
    info = s.link.devices[s.local_index]
    if not info.get("capability"):
        from genie.errors import GenieError

        raise GenieError(f"remote_accelerator:{s.global_index} is a {info.get('type', 'non-CUDA')} device "
                         f"({info.get('name')}): it has no CUDA compute capability")
    major, minor = info["capability"]
    return major, minor


def is_bf16_supported(device=None) -> bool:
    """Whether the daemon's device runs bfloat16 natively (CPUs: yes; GPUs: as torch.cuda says there)."""
    s = _stream(device)
    return bool(s.link.devices[s.local_index].get("bf16", True))


def init() -> None:
    """Connect now rather than on first use (like torch.cuda.init)."""
    get_runtime().ensure_started()


def synchronize(device=None) -> None:
    """Wait for all work queued on the device (all devices when None... like CUDA, the current one)."""
    _stream(device).synchronize()


# ------------------------------------------------------------------ memory


def _daemon_stats(device) -> dict:
    s = _stream(device)
    s.synchronize()  # send queued frees first, so the figures reflect this program's state
    return s.link.request("stats", {"dev": s.local_index}).body


def memory_stats(device=None) -> dict:
    body = _daemon_stats(device)
    return {
        "allocated_bytes.all.current": body["allocated"],
        "allocated_bytes.all.peak": body["peak"],
        "reserved_bytes.all.current": body["reserved"],
        "reserved_bytes.all.peak": body.get("reserved_peak"),  # None from daemons before it was reported
        "fragmentation": body["fragmentation"],
        "resident_bytes.all.current": body["resident"],
        "resident_bytes.all.peak": body["resident_peak"],
        "num_handles": body["handles"],
        "num_persistent_handles": body["persistent_handles"],
        "num_clients": body["clients"],
        "limit_bytes": body["limit"],
        "kv_sessions": body["kv_sessions"],
        "kv_bytes": body["kv_bytes"],
    }


def memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the daemon's device: a GPU's, or on a CPU daemon its memory limit
    (--memory-limit) when set, else the host's RAM."""
    body = _daemon_stats(device)
    if "free" not in body:
        from genie.errors import GenieError

        raise GenieError("this genie-daemon is older than mem_get_info: it does not report free memory")
    return body["free"], body["total"]


def reset_peak_memory_stats(device=None) -> None:
    """Peaks (max_memory_allocated / max_memory_reserved) start again from now; daemon-wide, as
    CUDA's are process-wide."""
    s = _stream(device)
    s.synchronize()
    s.link.request("reset_peak", {})


reset_max_memory_allocated = reset_peak_memory_stats


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """The daemon's memory figures as text (torch.cuda.memory_summary's role, not its layout; its
    `abbreviated` is accepted for code that passes it: the figures are few already)."""
    stats = memory_stats(device)
    s = _stream(device)
    width = max(len(k) for k in stats)
    lines = [f"remote_accelerator:{s.global_index} @ {s.link.endpoint}"]
    lines += [f"  {k.ljust(width)}  {v:,}" if isinstance(v, int) else f"  {k.ljust(width)}  {v}"
              for k, v in stats.items()]
    return "\n".join(lines)


def _accelerator_memory(action: str, index: int) -> tuple:
    """torch.accelerator's memory calls for remote_accelerator (memory_allocated, memory_stats,
    max_memory_*, memory_reserved, reset_peak_memory_stats, empty_cache, get_memory_info), asked
    by the device's C++ allocator (genie/csrc/device_guard.cpp), answered from the daemon."""
    if action == "stats":
        stats = memory_stats(index)
        reserved_peak = stats["reserved_bytes.all.peak"]
        if reserved_peak is None:
            from genie.errors import GenieError

            raise GenieError("this genie-daemon is older than reserved-memory peaks: use "
                             "torch.remote_accelerator.memory_stats()")
        return (stats["allocated_bytes.all.current"], stats["allocated_bytes.all.peak"],
                stats["reserved_bytes.all.current"], reserved_peak)
    if action == "info":
        return mem_get_info(index)
    if action == "reset_peak":
        reset_peak_memory_stats(index)
    elif action == "empty_cache":
        empty_cache()
    return ()


def empty_cache() -> None:
    """Like torch.cuda.empty_cache: every connected daemon lets go of memory it keeps for reuse
    (its CUDA caching allocator's unused blocks, idle pinned and receive buffers). Tensors in use
    are untouched. Queued frees go first, so what this program dropped is released too."""
    rt = get_runtime()
    rt.ensure_started()
    for s in rt.streams:
        s.synchronize()
    for link in rt.links:
        link.request("empty_cache", {})


# ------------------------------------------------------------------ random numbers


def _send_seed(seed: int) -> None:
    for s in get_runtime().streams:
        with s.lock:
            s.append([SEED_OP, [seed], {}, None])


def manual_seed_all(seed: int) -> None:
    """Seed this client's generator on every remote device (each client has its own on a daemon)."""
    seed = int(seed) & ((1 << 64) - 1)
    _state["seed"] = _state["initial_seed"] = seed
    if get_runtime().started:
        _send_seed(seed)


def manual_seed(seed: int) -> None:
    manual_seed_all(seed)


def seed_all() -> None:
    manual_seed_all(random.getrandbits(63))


def seed() -> None:
    seed_all()


def initial_seed() -> int:
    if _state["initial_seed"] is None:
        seed_all()
    return _state["initial_seed"]


def _read_rng_state(s, generator_fields=None) -> torch.Tensor:
    """The state of this client's generator on stream `s`'s device, or of the twin of the
    torch.Generator with these (id, seedings, seed), after the ops queued so far."""
    with s.lock:
        handle = s.new_handle()
        args = [] if generator_fields is None else [generators.encode_fields(*generator_fields, s)]
    report = s.run_reported([RNG_STATE_OP, args, {}, handle])
    return capture._from_report(report, s).cpu()


def _queue_rng_state(s, state: torch.Tensor, generator_fields=None) -> None:
    """Queue `state` (a CPU uint8 tensor) for the generator _read_rng_state names, in program order."""
    with s.lock:
        args = [] if generator_fields is None else [generators.encode_fields(*generator_fields, s)]
        s.append([SET_RNG_STATE_OP, capture.encode_call([state], {}, s)[0] + args, {}, None])


def get_rng_state(device=None) -> torch.Tensor:
    """This client's generator state on the device (a CPU uint8 tensor), after the ops queued so far."""
    return _read_rng_state(_stream(device))


def set_rng_state(new_state: torch.Tensor, device=None) -> None:
    """Give this client's generator on the device a state from get_rng_state (queued in order)."""
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        raise TypeError("an RNG state is a uint8 tensor, as get_rng_state returns")
    _queue_rng_state(_stream(device), new_state.detach().cpu().contiguous())


def _generator_state(uid: int, version: int, seed: int, index: int) -> bytes:
    """torch.Generator(device="remote_accelerator").get_state(), called by the C++ generator."""
    return _read_rng_state(_stream(index), (uid, version, seed)).numpy().tobytes()


def _set_generator_state(uid: int, version: int, seed: int, index: int, state: bytes) -> None:
    """generator.set_state(state), called by the C++ generator."""
    _queue_rng_state(_stream(index), torch.frombuffer(bytearray(state), dtype=torch.uint8), (uid, version, seed))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# torch.utils.checkpoint saves and restores device RNG states only for device modules whose
# `_initialized` is true: without it, dropout in a checkpointed block was replayed with another
# mask and the gradients were silently wrong. True once connected (see register).
_initialized = False


def _mark_initialized() -> None:
    global _initialized
    _initialized = True


def _apply_pending_seed() -> None:
    if _state["seed"] is not None:
        _send_seed(_state["seed"])


def mark_persistent(tensor) -> None:
    """Tell the daemon this remote tensor is long-lived state (a KV cache), not a temporary."""
    ref = tensor._genie
    with ref.stream.lock:
        ref.stream.append([PERSIST_OP, capture.encode_call([tensor], {}, ref.stream)[0], {}, None])


# ------------------------------------------------------------------ autocast


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What `torch.autocast("remote_accelerator", dtype=...)` may cast to. torch.autocast asks this
    on entry, which is when Genie's autocast kernels are registered (compiled the first time,
    then cached): PyTorch has none for a PrivateUse1 device, so without them every op in the
    region failed. Daemons run both dtypes, on GPUs and (slower, for float16) on CPUs."""
    from genie.errors import GenieError

    from . import native_guard

    try:
        native_guard.load_autocast()
    except Exception as e:  # noqa: BLE001 - no compiler, or the build failed: say why autocast cannot run
        raise GenieError(f"torch.autocast on remote_accelerator needs Genie's C++ autocast kernels, which "
                         f"could not be built here: {e}") from None
    return [torch.bfloat16, torch.float16]


# ------------------------------------------------------------------ registration

_registered = False


def register() -> types.ModuleType:
    """Rename PrivateUse1, install `torch.remote_accelerator`, register the factory kernels. Idempotent."""
    global _registered
    module = sys.modules[__name__]
    if _registered:
        return module
    from . import (data_parallel, device_mesh, factories, flex_attention, foreach_defaults, graphs, lazy_tensor,
                   module_conversion, native_guard, process_sharing, read_ahead, safetensors_support, serialization,
                   settings_barrier, streams, torch_compile, torchscript)

    if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
        _setup_backend(module)
    factories.register()
    serialization.register()
    safetensors_support.install()
    process_sharing.register()
    generators.register_copying()
    torchscript.install()
    module_conversion.install()
    read_ahead.install()
    data_parallel.install()
    foreach_defaults.install()
    device_mesh.install()
    flex_attention.install()
    torch_compile.install()
    lazy_tensor.refuse_dlpack_export()
    settings_barrier.install()
    if native_guard.load():
        get_runtime().on_start.append(lambda: native_guard.set_device_count(len(get_runtime().streams)))
        native_guard.set_generator_state_hooks(_generator_state, _set_generator_state)  # module functions: alive for good
        native_guard.set_memory_hook(_accelerator_memory)
        streams.install_guard_hooks()
        graphs.install_accelerator_graph()
    get_runtime().on_start.append(_apply_pending_seed)
    get_runtime().on_start.append(data_parallel.forget_copy_streams)
    get_runtime().on_start.append(_mark_initialized)
    get_runtime().on_start.append(torch_compile.keep_dynamo_out)
    from .meta import import_lazy_dependencies

    get_runtime().warm_ups.append(import_lazy_dependencies)
    _registered = True
    return module


def _setup_backend(module: types.ModuleType) -> None:
    """torch.utils.backend_registration._setup_privateuseone_for_python_backend, in its order,
    except that the backend hooks are Genie's C++ ones where they build (PyTorch takes hooks
    once): with PyTorch's Python stand-in, `t.pin_memory()` and DataLoader(pin_memory=True)
    raised NotImplementedError after `import genie`, since the registered backend becomes the
    current accelerator. The C++ device guard, loaded with them, replaces the Python one."""
    from torch.utils import backend_registration

    from . import native_guard

    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module(DEVICE_TYPE, module)
    torch._C._acc.register_python_privateuseone_device_guard(backend_registration._DummyDeviceGuard())
    if not (native_guard.load() and native_guard.install_hooks()):  # load() puts the C++ guard over it
        torch._C._acc.register_python_privateuseone_hook(backend_registration._DummyPrivateUse1Hook())


__all__ = [
    "device_count", "is_available", "is_initialized", "current_device", "set_device", "device",
    "get_device_name", "get_device_properties", "synchronize", "memory_stats", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "empty_cache", "max_memory_reserved", "mem_get_info",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "memory_summary", "get_device_capability",
    "is_bf16_supported", "init", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "manual_seed", "manual_seed_all", "seed", "seed_all",
    "initial_seed", "register", "capture", "Stream", "Event", "current_stream", "default_stream",
    "set_stream", "stream", "get_amp_supported_dtype", "StreamContext", "is_current_stream_capturing",
    "OutOfMemoryError", "set_sync_debug_mode", "get_sync_debug_mode",
]
