"""torch.remote_accelerator: the torch.cuda-like module, with figures from the daemon."""
import warnings

import pytest
import torch

import genie


def test_device_parses_and_module_is_installed(dev):
    assert torch.device("remote_accelerator:1").type == "remote_accelerator"
    assert torch.device("remote_accelerator:1").index == 1
    assert torch.remote_accelerator is genie.remote_accelerator


def test_count_availability_and_name(dev):
    ra = torch.remote_accelerator
    assert ra.device_count() == 1
    assert ra.is_available()
    assert ra.is_initialized()
    assert ra.current_device() == 0
    on_gpu = torch.cuda.is_available()  # the session daemon serves this machine's GPU, if it has one
    assert (torch.cuda.get_device_name(0) if on_gpu else "cpu") in ra.get_device_name(0)
    props = ra.get_device_properties(0)
    assert props.type == ("cuda" if on_gpu else "cpu") and props.total_memory > 0


def test_set_device_rejects_missing_index(dev):
    with pytest.raises(genie.GenieError, match="does not exist"):
        torch.remote_accelerator.set_device(5)
    with torch.remote_accelerator.device(0):
        assert torch.remote_accelerator.current_device() == 0


def test_memory_stats_are_real(dev):
    ra = torch.remote_accelerator
    before = ra.memory_allocated()
    x = torch.ones(1024, 256, device=dev)  # 1 MiB
    ra.synchronize()
    assert ra.memory_allocated() - before == 1024 * 256 * 4
    stats = ra.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    del x
    assert ra.memory_allocated() == before


def test_device_count_is_zero_when_unreachable(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import os, torch, genie\n"
        "n = torch.remote_accelerator.device_count()\n"
        "print('COUNT', n)\n"
    )
    env = dict(os.environ, GENIE_SERVER_URL=f"ipc://{tmp_path}/nobody.sock", GENIE_CONNECT_TIMEOUT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "COUNT 0" in out.stdout, out.stderr


def test_autograd_works_when_a_backward_ran_before_import_genie(tmp_path):
    """PyTorch's autograd engine makes its per-device queues once, at the first backward of the
    process. A CPU backward before `import genie` (a notebook, a test session) left none for
    remote_accelerator, and every remote backward then failed an internal assert; Genie now starts
    them when it installs its guard."""
    import os
    import subprocess
    import sys

    script = tmp_path / "prog.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "x = torch.randn(2, 4, requires_grad=True)\n"
        "checkpoint(lin, x, use_reentrant=True).sum().backward()\n"  # CPU, reentrant, before genie
        "import genie\n"
        "remote = torch.nn.Linear(4, 4).to('remote_accelerator:0')\n"
        "remote.load_state_dict(lin.state_dict())\n"
        "checkpoint(remote, x.detach().to('remote_accelerator:0').requires_grad_(), use_reentrant=True).sum().backward()\n"
        "y = torch.ones(3, device='remote_accelerator:0', requires_grad=True)\n"
        "(y * 3).sum().backward()\n"
        "print(torch.equal(remote.weight.grad.cpu(), lin.weight.grad), y.grad.tolist())\n")
    env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER_URL"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "[3.0,", "3.0,", "3.0]"]


def test_manual_seed_makes_remote_random_reproducible(dev):
    torch.manual_seed(123)
    a = torch.randn(8, device=dev).cpu()
    torch.manual_seed(123)
    b = torch.randn(8, device=dev).cpu()
    c = torch.randn(8, device=dev).cpu()
    assert torch.equal(a, b)
    assert not torch.equal(b, c)


def _native_backend() -> bool:
    from genie.frontend import native_guard

    return native_guard.loaded()


@pytest.mark.skipif(not _native_backend(), reason="needs Genie's C++ backend library (no C++ compiler here)")
def test_pin_memory_and_a_pinning_data_loader_work_after_import(dev):
    # remote_accelerator is the current accelerator once registered: pinning asks its hooks.
    assert torch.accelerator.current_accelerator().type == "remote_accelerator"
    t = torch.arange(6.0)
    pinned = t.pin_memory()
    assert torch.equal(pinned, t) and pinned.data_ptr() != t.data_ptr()
    # Pinned (page-locked, CUDA's allocator, where this process has a GPU; else host memory Genie
    # keeps track of), views too, as PyTorch's code for a PrivateUse1 device expects (DDP's reducer
    # asserts it); ordinary tensors are not.
    assert pinned.is_pinned() and pinned[2:].is_pinned() and not t.is_pinned()
    assert torch.empty(3, pin_memory=True).is_pinned()
    # An empty one too, where Genie keeps the host memory; CUDA's host allocator (a client with a
    # GPU) gives 0 bytes no memory at all, and says not pinned, as without Genie.
    assert torch.empty(0, pin_memory=True).is_pinned() == (not torch.cuda.is_available())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4,
                                         pin_memory=True)
    batches = [b for (b,) in loader]
    assert [b.tolist() for b in batches] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert torch.equal(batches[1].to(dev).cpu(), batches[1])


def test_pinning_a_remote_tensor_is_refused_as_for_cuda_tensors(dev, sent_ops):
    """torch refuses to pin a CUDA tensor; a remote one is refused alike, in this process (the
    daemon answered 'Cannot access accelerator device', after a round trip)."""
    t = torch.ones(3, device=dev)
    genie.synchronize()
    sent_ops.clear()
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        t.pin_memory()
    assert not sent_ops
    assert torch.equal(t.cpu(), torch.ones(3))  # the tensor is as it was


def test_dlpack_export_of_a_remote_tensor_is_refused_with_the_way_out(dev):
    """DLPack shares memory in this process; a remote tensor's is on the daemon. torch's own export
    gave a capsule over a null pointer (torch.utils.dlpack.from_dlpack made a tensor over address 0)."""
    import numpy as np

    t = torch.arange(4.0, device=dev)
    for export in (t.__dlpack__, t.__dlpack_device__, lambda: torch.utils.dlpack.to_dlpack(t),
                   lambda: torch.from_dlpack(t), lambda: np.from_dlpack(t)):
        with pytest.raises(BufferError, match=r"cannot be shared by DLPack.*t\.cpu\(\)"):
            export()
    cpu = torch.arange(3.0)
    assert torch.equal(torch.from_dlpack(torch.utils.dlpack.to_dlpack(cpu)), cpu)  # CPU tensors as before
    assert np.asarray(t).tolist() == [0.0, 1.0, 2.0, 3.0]  # a copy, as .numpy() (documented)


@pytest.mark.skipif(not _native_backend(), reason="needs Genie's C++ backend library (no C++ compiler here)")
def test_the_backend_library_keeps_its_symbols_to_itself():
    """Loaded RTLD_LOCAL: its symbols (~120 weak c10 and std:: ones among them) do not stand in
    for those of libraries loaded later. While it was loaded RTLD_GLOBAL, a client on an H100 node
    crashed in ml_dtypes importing torch's OpInfo database after import genie (that this was the
    cause is not established; with RTLD_LOCAL the import ran)."""
    import ctypes

    with pytest.raises(AttributeError):
        ctypes.CDLL(None).genie_install_guard  # the process's global namespace does not hold it


def test_storage_on_the_device_is_refused_with_a_way_out(dev):
    """The process has no storage for remote tensors: asking for some raises and says what to do;
    it used to crash the process (a null allocator)."""
    from genie.frontend import native_guard

    if not native_guard.loaded():
        pytest.skip("needs Genie's C++ device guard, which needs a C++ compiler")
    with pytest.raises(RuntimeError, match="cannot allocate or copy storage"):
        torch.UntypedStorage(16, device=dev)


def test_data_ptr_is_a_pointer_sized_stand_in_shared_by_views_and_reused(dev):
    """data_ptr() of a remote tensor: a stand-in (nothing reads through it) equal for views of one
    storage, offset as a pointer is, and below 2**63: one made from id() overflowed int64 (a C
    consumer, struct.pack('q', ...), refused it). A freed storage's range goes to a later one,
    as freed memory is reused."""
    import gc
    import struct

    a = torch.randn(8, device=dev)
    view = a[2:]
    other = torch.randn(8, device=dev)
    assert view.data_ptr() == a.data_ptr() + 8 == a.untyped_storage().data_ptr() + 8
    assert other.data_ptr() != a.data_ptr()
    assert abs(other.data_ptr() - a.data_ptr()) >= 2**36  # ranges far apart: no overlap
    struct.pack("qqq", a.data_ptr(), view.data_ptr(), other.data_ptr())
    freed = other.data_ptr()
    del other
    gc.collect()
    assert torch.randn(8, device=dev).data_ptr() == freed
    assert torch.empty(0, device=dev).data_ptr() == 0  # as on the CPU


def test_torch_compile_runs_remote_code_eagerly(dev):
    """torch.compile traces subclass tensors by rebuilding them as fakes, which a handle on a
    daemon cannot be: such code is a graph break and runs eagerly, as untraceable code does
    (it raised before, so a training script with torch.compile(model) stopped); fullgraph=True
    raises."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(dev)
    x = torch.randn(3, 4, device=dev)
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="torch.compile runs code on remote_accelerator tensors eagerly") \
            if not _compile_warned() else _nothing():
        got = compiled(x)
    torch.testing.assert_close(got.cpu(), model(x).cpu())
    compiled(x).sum().backward()  # trains through the compiled wrapper
    assert model[0].weight.grad is not None
    with pytest.raises(Exception):  # dynamo's message depends on what it compiled before in the process
        torch.compile(torch.nn.Linear(4, 2).to(dev), fullgraph=True)(x)


def test_torch_compile_of_code_that_makes_remote_tensors(dev):
    """Tensors made inside compiled code (`torch.arange(n, device=x.device)` for positions, a
    scalar on the device) failed: dynamo compiled Genie's own factory kernel when PyTorch called
    it in the eagerly run part, broke its graph inside LazyTensor.__new__ and then read the
    half-made tensor ("'LazyTensor' object has no attribute '_genie'"). Genie's code is now
    outside what dynamo compiles."""
    def positions(x):
        return x * 2 + torch.arange(x.shape[-1], device=x.device)

    def clamp_below(x):
        return torch.where(x > 0, x, torch.tensor(-1.0, device=x.device)).sum()

    x = torch.randn(3, 4)
    for fn in (positions, clamp_below):
        torch.testing.assert_close(torch.compile(fn)(x.to(dev)).cpu(), fn(x))


def test_torch_compile_of_code_that_makes_remote_tensors_from_nothing(dev):
    """With no remote input there is no graph break: the graph reached inductor, which has no code
    generator for the device (KeyError 'remote_accelerator'; Hugging Face's compiled
    create_block_mask for a remote model). Such graphs run as traced, op by op."""
    def ramp(n):
        return torch.arange(n, device=dev).float().mul(2).cumsum(0)

    assert torch.compile(ramp)(5).cpu().tolist() == [0.0, 2.0, 6.0, 12.0, 20.0]


def test_torch_export_refuses_with_the_way_out(dev):
    """torch.export cannot trace a remote tensor (no graph break to fall back on): the error
    says to export on CPU and move the model afterwards."""
    model = torch.nn.Linear(3, 2).to(dev)
    with pytest.raises(Exception, match="export the model while it is on CPU"):
        torch.export.export(model, (torch.randn(2, 3, device=dev),))


def _compile_warned() -> bool:
    from genie.frontend import lazy_tensor

    return lazy_tensor._compile_warned


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_empty_cache_lets_go_of_idle_buffers(tcp_lanes):
    """torch.remote_accelerator.empty_cache(), as code written for torch.cuda calls it: the daemon
    drops buffers it keeps for reuse (here: the bulk lane's receive buffer of an 8 MiB upload)."""
    dev = tcp_lanes
    ra = torch.remote_accelerator
    x = torch.ones(2 << 20).to(dev)  # 8 MiB: over the bulk lane, into a recycled receive buffer
    assert x.sum().item() == 2 << 20
    del x
    ra.empty_cache()  # sends the free first; the buffer is idle by the time the daemon trims
    link = genie.get_runtime().links[0]
    y = torch.ones(2 << 20).to(dev)
    del y
    ra.synchronize()
    assert link.request("empty_cache", {}).body["released"] >= 8 << 20
    assert link.request("empty_cache", {}).body["released"] == 0


def test_more_of_the_torch_cuda_memory_api(dev):
    """Calls that training scripts make on torch.cuda, with figures from the daemon."""
    ra = torch.remote_accelerator
    ra.init()
    free, total = ra.mem_get_info()
    assert 0 < free <= total
    ra.reset_peak_memory_stats()
    base = ra.max_memory_allocated()
    x = torch.ones(1 << 20, device=dev)  # 4 MiB
    assert ra.max_memory_allocated() >= base + (4 << 20)
    assert ra.max_memory_reserved() >= ra.memory_reserved()
    del x
    ra.reset_peak_memory_stats()
    assert ra.max_memory_allocated() == ra.memory_allocated() < base + (4 << 20)
    assert ra.reset_max_memory_allocated is ra.reset_peak_memory_stats
    assert "allocated_bytes.all.current" in ra.memory_summary()


def test_torch_accelerator_memory_api(dev):
    """Device-agnostic code asks torch.accelerator (memory_allocated, max_memory_allocated,
    memory_reserved, memory_stats, reset_peak_memory_stats, empty_cache, get_memory_info): each
    stopped in PyTorch's internal assert "Allocator for remote_accelerator is not a
    DeviceAllocator". The figures are the daemon's, as torch.remote_accelerator's.
    get_device_capability() raised, and empty_host_cache() crashed the process."""
    from genie.frontend import native_guard
    from genie.transport.tensors import DTYPE_NAMES

    if not native_guard.loaded():
        pytest.skip("needs Genie's C++ device guard (no C++ compiler here)")
    acc, ra = torch.accelerator, torch.remote_accelerator
    assert acc.current_accelerator().type == "remote_accelerator"
    ra.init()
    acc.reset_peak_memory_stats()
    base = acc.memory_allocated()
    assert base == ra.memory_allocated()
    x = torch.ones(1 << 20, device=dev)  # 4 MiB
    assert acc.memory_allocated() == ra.memory_allocated() == base + (4 << 20)
    assert acc.max_memory_allocated() >= base + (4 << 20)
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.current"] == base + (4 << 20)
    assert stats["reserved_bytes.all.current"] == acc.memory_reserved() == ra.memory_reserved()
    assert acc.max_memory_reserved() >= acc.memory_reserved()
    del x
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated() == base
    acc.empty_cache()
    free, total = acc.get_memory_info()
    assert 0 < free <= total == ra.mem_get_info()[1]
    assert acc.memory_allocated(torch.device(dev)) == base
    assert acc.get_device_capability()["supported_dtypes"] == set(DTYPE_NAMES)  # it raised
    torch.accelerator.empty_host_cache()  # crashed the process (no host allocator for the device)


def test_capability_and_bf16_come_from_the_daemons_device(dev):
    ra = torch.remote_accelerator
    if torch.cuda.is_available():  # the session daemon serves this machine's GPU
        assert ra.get_device_capability() == torch.cuda.get_device_capability(0)
        assert ra.is_bf16_supported() == torch.cuda.is_bf16_supported()
        return
    assert ra.is_bf16_supported() is True  # a CPU daemon
    with pytest.raises(genie.GenieError, match="no CUDA compute capability"):
        ra.get_device_capability()


@pytest.fixture
def sync_debug_mode():
    yield torch.remote_accelerator.set_sync_debug_mode
    torch.remote_accelerator.set_sync_debug_mode("default")


def test_sync_debug_mode_warns_at_the_lines_that_wait_for_the_daemon(dev, sync_debug_mode):
    """As torch.cuda.set_sync_debug_mode: each warning names the user's line and what waits."""
    x = torch.arange(6.0, device=dev)
    sync_debug_mode("warn")
    assert torch.remote_accelerator.get_sync_debug_mode() == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = (x * 2 + 1).relu()  # queued: no wait
        torch.remote_accelerator.synchronize()  # explicit: not reported
        quiet = len(caught)
        assert y.sum().item() == 36.0
        assert y.cpu().tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
        assert torch.nonzero(y > 6).cpu().flatten().tolist() == [3, 4, 5]
    assert quiet == 0
    messages = [str(w.message) for w in caught]
    assert len(messages) == 4, messages  # .item(), .cpu(), nonzero, and nonzero's .cpu()
    assert all(w.filename == __file__ for w in caught)
    assert "reading a value (.item()" in messages[0] and "reading values on the CPU" in messages[1]
    assert "aten::nonzero" in messages[2]


async def test_sync_debug_mode_leaves_awaited_reads_alone(dev, sync_debug_mode):
    x = torch.ones(3, device=dev)
    sync_debug_mode(2)
    assert (await genie.materialize(x * 3)).tolist() == [3.0, 3.0, 3.0]


def test_sync_debug_mode_error_raises_before_anything_is_sent(dev, sync_debug_mode):
    x = torch.ones(4, device=dev)
    y = x * 5
    sync_debug_mode("error")
    with pytest.raises(RuntimeError, match="synchronizing remote_accelerator operation"):
        y.sum().item()
    with pytest.raises(RuntimeError, match="synchronizing remote_accelerator operation"):
        y.cpu()
    assert y.data_ptr() != 0  # a stand-in known here: no wait since storages are tracked locally
    sync_debug_mode(0)
    assert y.cpu().tolist() == [5.0] * 4 and (y + 1).sum().item() == 24.0
    with pytest.raises(RuntimeError, match="expected one of"):
        sync_debug_mode("loud")
    with pytest.raises(RuntimeError, match="expected 0, 1 or 2"):
        sync_debug_mode(3)


def test_transport_stats_count_the_waits_for_answers(dev):
    x = torch.zeros(8, device=dev)
    x.sum().item()
    endpoint, = genie.transport_stats()
    before = genie.transport_stats()[endpoint]["blocking_waits"]
    for _ in range(200):
        x = x + 1
    assert genie.transport_stats()[endpoint]["blocking_waits"] == before  # queued and sent, never waited for
    assert x.sum().item() == 1600.0
    assert genie.transport_stats()[endpoint]["blocking_waits"] == before + 1


def test_sync_debug_mode_from_the_environment(tmp_path):
    """GENIE_SYNC_DEBUG=warn: for a program run unchanged; a bad value is named, not fatal."""
    import os
    import subprocess
    import sys

    script = tmp_path / "prog.py"
    script.write_text("import torch, genie\n"
                      "x = torch.ones(3, device='remote_accelerator:0')\n"
                      "print(torch.remote_accelerator.get_sync_debug_mode(), (x * 2).sum().item())\n")
    env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER_URL"}
    for value, mode, warned in (("warn", "1", "prog.py:3: UserWarning: called a synchronizing"),
                                ("loud", "0", "GENIE_SYNC_DEBUG ignored")):
        out = subprocess.run([sys.executable, str(script)], env={**env, "GENIE_SYNC_DEBUG": value},
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [mode, "6.0"]
        assert warned in out.stderr
