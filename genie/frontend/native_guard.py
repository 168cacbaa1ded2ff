"""Builds and loads Genie's C++ parts for remote_accelerator: the device guard and backend hooks
(genie/csrc/device_guard.cpp, at import) and the autocast kernels (genie/csrc/autocast.cpp, on
the first `torch.autocast("remote_accelerator")`).

Each is compiled with the system C++ compiler against the torch that is actually
imported (its headers, its libc10, its C++ ABI flag), once, into a cache
directory keyed by the source, the torch build and the Python ABI; loaded with ctypes. Where no
compiler is available, Genie keeps PyTorch's Python guard, which knows a single
device: multi-device autograd and `set_device` inside guards then do not work,
and a warning says so; autocast then raises, saying why.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import warnings

import torch

log = logging.getLogger("genie.frontend")

CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
SOURCE = os.path.join(CSRC, "device_guard.cpp")
AUTOCAST_SOURCE = os.path.join(CSRC, "autocast.cpp")
_lib: ctypes.CDLL | None = None
_autocast_lib: ctypes.CDLL | None = None


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "genie")


def _build(source: str, target: str) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    torch_dir = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        out = os.path.join(tmp, "guard.so")
        major, minor = (int(part) for part in torch.__version__.split(".")[:2])
        cmd = [compiler, "-shared", "-fPIC", "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-DGENIE_TORCH_VERSION={major * 100 + minor}",
               "-I", os.path.join(torch_dir, "include"), "-I", sysconfig.get_paths()["include"], source, "-L", os.path.join(torch_dir, "lib"),
               "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{os.path.join(torch_dir, 'lib')}", "-o", out]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {os.path.basename(source)} failed:\n{result.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders never load half a file


def _built(source: str) -> ctypes.CDLL:
    """The library built from `source` for this torch (compiled on first use), loaded."""
    with open(source, "rb") as f:
        # SOABI: the sources include Python.h (the GIL is taken in C++), whose ABI is per Python version.
        build = f"{torch.__version__} {sysconfig.get_platform()} {sysconfig.get_config_var('SOABI')}"
        key = hashlib.sha256(f.read() + build.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    target = os.path.join(_cache_dir(), f"{stem}-{key}.so")
    if not os.path.exists(target):
        _build(source, target)
    # RTLD_LOCAL: its symbols (inline c10 and std:: ones among them) must not stand in for those of
    # libraries loaded later.
    return ctypes.CDLL(target, mode=ctypes.RTLD_LOCAL)


def load() -> bool:
    """Install the C++ guard (building it if needed). False, with a warning, where that is impossible."""
    global _lib
    if _lib is not None:
        return True
    try:
        lib = _built(SOURCE)
        lib.genie_install_guard()
        lib.genie_set_device_count.argtypes = [ctypes.c_int]
        lib.genie_install_hooks.restype = ctypes.c_int
        lib.genie_generator_info.argtypes = [ctypes.py_object, ctypes.POINTER(ctypes.c_int64)]
        lib.genie_generator_info.restype = ctypes.c_int
        lib.genie_generators_dropped.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        lib.genie_generators_dropped.restype = ctypes.c_int
        lib.genie_set_generator_state_hooks.argtypes = [ctypes.py_object, ctypes.py_object]
        lib.genie_set_memory_hook.argtypes = [ctypes.py_object]
        lib.genie_set_stream_hooks.argtypes = [ctypes.py_object, ctypes.py_object]
        lib.genie_set_current_stream.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.genie_new_stream_id.restype = ctypes.c_int64
        lib.genie_set_graph_hook.argtypes = [ctypes.py_object]
        lib.genie_start_autograd_device_threads.restype = ctypes.c_int
        # A backward that ran before `import genie` left the autograd engine without a queue for this
        # device; start them now (see the C++). ctypes releases the GIL, which the new threads take.
        queues = lib.genie_start_autograd_device_threads()
        if queues >= 0:
            log.debug("autograd engine had started before Genie; it has %d device queues", queues)
    except Exception as e:  # noqa: BLE001 - any failure: keep the Python guard and say so
        warnings.warn(f"genie: using PyTorch's single-device Python guard for remote_accelerator ({e}); "
                      "autograd and device guards on remote_accelerator:1 and above will not work", RuntimeWarning)
        return False
    _lib = lib
    return True


def load_autocast() -> None:
    """Register the autocast kernels (building them if needed, ~20 s once); raises where that is impossible."""
    global _autocast_lib
    if _autocast_lib is None:
        _autocast_lib = _built(AUTOCAST_SOURCE)


def loaded() -> bool:
    return _lib is not None


def install_hooks() -> bool:
    """Register the C++ backend hooks (pinned memory for the current accelerator); False where
    PyTorch already has hooks for PrivateUse1 (they can be registered once) or the library is not loaded."""
    if _lib is None:
        return False
    installed = _lib.genie_install_hooks() == 0
    if not installed:
        log.warning("PrivateUse1 hooks were registered before Genie's: t.pin_memory() will not work")
    return installed


def generator_info(generator: torch.Generator) -> tuple[int, int, int] | None:
    """(id, number of seedings, seed) of a remote_accelerator generator; None for any other."""
    fields = (ctypes.c_int64 * 3)()  # one per call: ctypes lets other threads run during it
    if _lib is None or _lib.genie_generator_info(generator, fields) != 0:
        return None
    uid, version, seed = fields
    return uid, version, seed & 0xFFFF_FFFF_FFFF_FFFF


def set_generator_state_hooks(get, set_) -> None:
    """Python functions behind a remote_accelerator generator's get_state/set_state. The C++ side
    borrows them: the caller keeps both alive for the life of the process."""
    if _lib is not None:
        _lib.genie_set_generator_state_hooks(get, set_)


def set_memory_hook(hook) -> None:
    """The Python function behind torch.accelerator's memory calls for remote_accelerator
    (hook(action, device index) -> tuple of ints). Borrowed, as the generator state hooks are."""
    if _lib is not None:
        _lib.genie_set_memory_hook(hook)


def set_stream_hooks(stream_hook, event_hook) -> None:
    """The Python functions behind the guard's streams and events (torch.Stream, torch.Event,
    torch.accelerator.synchronize, autograd's stream guards). Borrowed, as the other hooks are."""
    if _lib is not None:
        _lib.genie_set_stream_hooks(stream_hook, event_hook)


def set_graph_hook(hook) -> None:
    """The Python function behind torch.accelerator.Graph on remote_accelerator (PyTorch >= 2.13;
    older ones have no such API). Borrowed, as the other hooks are."""
    if _lib is not None:
        _lib.genie_set_graph_hook(hook)


def set_current_stream(device: int, stream_id: int) -> None:
    """Tell the guard that Genie made `stream_id` current on `device` for this thread (autograd
    records it with each op and runs the op's backward on it)."""
    if _lib is not None:
        _lib.genie_set_current_stream(device, stream_id)


def new_stream_id() -> int | None:
    """A stream id unique in this process, from the guard's count (which torch.Stream also draws
    from); None without the C++ guard."""
    return None if _lib is None else int(_lib.genie_new_stream_id())


def generators_dropped() -> list[int]:
    """Ids of remote_accelerator generators destroyed since the last call."""
    if _lib is None:
        return []
    dropped = []
    while True:
        fields = (ctypes.c_int64 * 64)()
        n = _lib.genie_generators_dropped(fields, 64)
        dropped.extend(fields[:n])
        if n < 64:
            return dropped


def set_device_count(n: int) -> None:
    if _lib is not None:
        _lib.genie_set_device_count(int(n))
