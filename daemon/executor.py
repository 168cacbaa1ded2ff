"""Runs one client's `exec` request on a device: ops in order, on real tensors.

Because ops are replayed in program order on real tensors, views alias and
in-place writes land exactly as they would have in the client's program.
A failing op poisons its outputs and the tensors it writes (see `handles`).
"""
from __future__ import annotations

import logging
import math
import secrets
import time
from typing import Callable

import msgpack
import torch

from genie.transport import cuda_ipc, numerics, protocol
from genie.transport.cuda_ipc import SharedCudaTensor
from genie.transport.errors import ProtocolError
from genie.transport.protocol import (ADOPT_OP, ALIAS_STORAGE_OP, COPY_STORAGE_OP, DEFINE_PROGRAM_OP, DROP_PROGRAM_OP,
                                      EVENT_RECORD_OP, EVENT_WAIT_OP, FREE_GENERATORS_OP, KV_APPEND_OP, KV_CLOSE_OP,
                                      KV_GET_OP, PERSIST_OP, RECORD_STREAM_OP, RECV_OP, REPLAY_OP, RESIZE_STORAGE_OP,
                                      RNG_STATE_OP, SEED_OP, SEND_OP, SET_RNG_STATE_OP, SHARE_CUDA_OP, STORAGE_OF_OP,
                                      BulkTensor, DeviceRef, Exec, GeneratorRef, HandleRef, InlineTensor, OpCall,
                                      found_in, handles_in)
from genie.transport.hostmem import snapshot
from genie.transport.tensors import (aligned_for_compute, bytes_as_tensor, check_shape, check_strides, dense,
                                     dense_bytes, dense_span, dtype_name, elements_spanned, frames_to_tensor, is_dense,
                                     tensor_to_buffer, tensor_to_frames)

from . import attention
from . import ops as op_table
from . import device_faults, layouts, programs, rnn_cells, sync_batch_norm
from .handles import ClientState, Poison, Poisoned, held
from .memory_guard import is_allocation_failure
from .ops import int_arg
from .program_ops import ProgramOps
from .random_ops import RandomOps, drawing_from
from .storage_ops import StorageOps

log = logging.getLogger("genie.daemon")



# torch.inference_mode() builds a Python context object around this guard each time; entered
# directly it costs 0.8 instead of 2.0 us, on every request that runs an op.
_InferenceMode = torch._C._InferenceMode


def _callable_of(op):
    """What an OpOverload's __call__ calls (its C++ operator): one Python frame less per op run."""
    inner = getattr(op, "_op", None) if type(op) is torch._ops.OpOverload else None
    return inner if callable(inner) else op


_NOT_RESIZABLE = "Trying to resize storage that is not resizable"


def _make_resizable(client: ClientState, call: OpCall) -> bool:
    """An op had to grow a tensor whose memory is a received message (uploads are kept where
    they landed, and such memory cannot grow): move the storages of the call's tensors that are
    like that into memory of the daemon's own, for every handle that shares them, so the op can
    be run again. Whether any moved (False, changing nothing more, if moving failed)."""
    moved = False
    try:
        for ref in _handle_refs([*call.args, *call.kwargs.values()]):
            tensor = client.tensors.get(ref.id)
            if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().resizable():
                continue
            old = tensor.untyped_storage()
            sharing = [(h, t) for h, t in client.tensors.items()
                       if isinstance(t, torch.Tensor) and t.device == tensor.device
                       and t.untyped_storage().data_ptr() == old.data_ptr()]
            # The failed resize already gave the tensor its new sizes: the new memory must hold them.
            nbytes = max([old.nbytes(), *(_extent(t) for _, t in sharing)])
            new = torch.UntypedStorage(nbytes, device=tensor.device)  # the daemon's own: resizable
            new[:old.nbytes()].copy_(old)
            with torch.no_grad():
                for handle, t in sharing:
                    t.set_(new, t.storage_offset(), t.shape, t.stride())
                    client.put(handle, t)  # accounted under its new storage
            moved = True
    except Exception as e:  # noqa: BLE001 - the op's own error is the one to report
        log.debug("could not move %s's tensors to resizable memory: %s", call.name, e)
    return moved


def _extent(t: torch.Tensor) -> int:
    """Bytes of storage `t` reaches, from the storage's start."""
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    return elements_spanned(t.storage_offset(), t.shape, t.stride()) * t.element_size()


def _handle_refs(values, depth: int = 0):
    for v in values:
        if isinstance(v, HandleRef):
            yield v
        elif isinstance(v, list) and depth < protocol.MAX_NESTING:
            yield from _handle_refs(v, depth + 1)


def _refuse_unstrided(result: torch.Tensor) -> None:
    """A result the client learns of from this daemon (no meta kernel planned it) must be a dense
    tensor: a nested or sparse one has no strides to report, and would fail there obscurely."""
    if result.is_nested:
        raise TypeError("the op made a strided nested tensor (torch.nested's default layout, a C++ tensor "
                        "type), which has no remote counterpart: use layout=torch.jagged, whose values and "
                        "offsets are ordinary tensors")
    if result.layout != torch.strided:
        raise TypeError(f"the op made a {result.layout} tensor; only strided (dense) tensors live on "
                        "remote_accelerator: convert with .to_dense() first")


class OutOfMemoryError(RuntimeError):
    """An op would take the daemon past its memory limit."""


class Executor(StorageOps, ProgramOps, RandomOps):
    """Executes requests for all clients on this daemon's devices (one thread calls it)."""

    def __init__(self, devices: list[torch.device], account=None, memory_limit: int = 0, kv_store=None,
                 mailbox=None, send_to_peer=None, transfer_timeout: float = 120.0, bulk=None) -> None:
        self.devices = devices
        attention.register()  # kernels for the fused-attention ops clients send under autograd
        rnn_cells.register()  # CPU kernels for the fused LSTM/GRU cell ops torch picks for clients' devices
        sync_batch_norm.register()  # CPU kernels for nn.SyncBatchNorm's CUDA-only ops
        self.has_cuda = any(d.type == "cuda" for d in devices)
        # Set by the server: whether a client (by identity) may take GPU tensors by CUDA IPC handle.
        self.cuda_ipc_with: Callable[[bytes], bool] = lambda identity: False
        # (op name, numerics settings) run on a GPU before (see quick_to_start): other settings pick
        # other kernels (a first TF32 matmul took 3.8-4.6 s on an H100 where FP32 ones had run).
        self._warm_ops: set[tuple[str, str]] = set()
        self._last_settings: tuple = (None, repr(numerics.DEFAULT))  # (a request's numerics, their key)
        self.bulk = bulk  # BulkListener, or None when the daemon offers no bulk lanes
        # Storages are named to clients by a keyed hash of their address: equal for tensors sharing
        # one, and no daemon memory address leaves the process.
        self._storage_name_key = secrets.token_bytes(16)
        # The numerics settings in force in this process (set per request: see numerics).
        self._numerics = numerics.read() if numerics.AVAILABLE else None
        self.mailbox = mailbox
        # Set when an op lost the device's context: requests already queued behind it on the
        # worker get the loss too (their inputs may be the lost op's outputs: "handle ... does
        # not exist"), not a run in a context that cannot run anything.
        self.device_lost: device_faults.DeviceLost | None = None
        self.send_to_peer = send_to_peer
        self.transfer_timeout = transfer_timeout
        self.account = account
        self.memory_limit = memory_limit  # bytes held through handles; 0 = unlimited
        self.kv_store = kv_store
        self._uploaders: dict = {}  # CUDA device -> pinned staging + copy stream
        # Transfers that UCX moved straight into and out of GPU memory (see ucx_lane), no staging.
        self.gpu_memory_uploads = self.gpu_memory_upload_bytes = 0
        self.gpu_memory_downloads = self.gpu_memory_download_bytes = 0
        self._importer = None  # cuda_ipc.Importer, made at the first CUDA IPC tensor
        self._imported: dict = {}  # id(SharedCudaTensor) -> its copy here, or the error opening it, per request
        self._replayed: list = []  # programs the running request replays (timed with it: see quick_to_start)
        # The first failure of the running request that poisoned nothing (an op with no outputs and
        # no written arguments, e.g. genie::replay of an unknown program): sent with its answer.
        self._unlanded: Poison | None = None
        # Genie's own ops, by name: (client, call, frames, device) -> result.
        self._genie_ops = {
            SEED_OP: lambda c, call, f, d: self._seed(c, call, d),
            FREE_GENERATORS_OP: lambda c, call, f, d: self._free_generators(c, call),
            RNG_STATE_OP: self._rng_state,
            SET_RNG_STATE_OP: self._rng_state,
            PERSIST_OP: lambda c, call, f, d: self._persist(c, call),
            EVENT_RECORD_OP: lambda c, call, f, d: c.streams.record(
                int_arg(call, 0), bool(call.args[1:2] and call.args[1]), d),
            EVENT_WAIT_OP: lambda c, call, f, d: c.streams.wait(int_arg(call, 0), d),
            RECORD_STREAM_OP: lambda c, call, f, d: self._record_stream(c, call),
            RESIZE_STORAGE_OP: lambda c, call, f, d: self._resize_storage(c, call),
            ADOPT_OP: self._adopt,
            SHARE_CUDA_OP: lambda c, call, f, d: self._share_cuda(c, call),
            ALIAS_STORAGE_OP: lambda c, call, f, d: self._alias_storage(c, call),
            STORAGE_OF_OP: lambda c, call, f, d: self._storage_of(c, call),
            COPY_STORAGE_OP: self._copy_storage,
            KV_APPEND_OP: self._kv, KV_GET_OP: self._kv, KV_CLOSE_OP: self._kv,
            REPLAY_OP: lambda c, call, f, d: self._replay(c, call, d),
            DEFINE_PROGRAM_OP: lambda c, call, f, d: self._define(c, call),
            DROP_PROGRAM_OP: lambda c, call, f, d: self._drop_program(c, call),
            SEND_OP: lambda c, call, f, d: self._send(c, call),
            RECV_OP: lambda c, call, f, d: self._recv(c, call, d),
        }
        # name -> (op, what runs it (programs.replaced_kernel or op), its unsafe flags, takes a
        # generator, seeded without one)
        self._aten_ops: dict[str, tuple] = {}

    # ------------------------------------------------------------ exec

    def run(self, client: ClientState, request: Exec, frames: list, later: list | None = None) -> tuple[dict, list]:
        """Run a request; its answer and frames. With `later` (a list), bulk-lane downloads of CPU
        tensors are not sent here but appended to it as calls, for the caller to make once the
        answer is out: the client then has the answer while the bytes stream in, instead of
        waiting for the bytes and then for the answer. The caller must run them before any
        later request of this daemon runs (they read the tensors' memory as it is now)."""
        if self.device_lost is not None:
            raise self.device_lost
        if request.device >= len(self.devices):
            raise ProtocolError(f"device index {request.device} out of range ({len(self.devices)} devices)")
        device = self.devices[request.device]
        if self.kv_store is not None:
            self.kv_store.begin_request()
        started, clock = time.time(), time.perf_counter()
        reported = None
        self._unlanded = None
        if self._importer is not None:
            self._importer.release_finished()  # clients' memory whose copy here is done
        if request.ops and self._numerics is not None:
            self._use_numerics(request.numerics or numerics.DEFAULT)
        try:
            # No autograd on a daemon (clients record it): inference mode skips its dispatch and
            # version-counter work on every op (traced step of the demo GPT: min 423 -> 367 us).
            if request.ops or request.shared or device.type != "cpu":
                settings = self._settings_key(request) if self.has_cuda else ""
                with _InferenceMode(True), client.streams.context(device, request.stream):
                    if request.shared:
                        self._import_shared(request.shared, device)
                    for i, call in enumerate(request.ops):
                        last = request.report and i == len(request.ops) - 1
                        result = self._run_op(client, call, frames, device, raise_errors=last)
                        if last:
                            reported = self._describe(call.outs, result)
                        if self.has_cuda:
                            self._warm_ops.add((call.name, settings))
            # else a read or free of CPU tensors (most blocking reads): no op to run in either
            # context, and entering them was a tenth of such a request's time here.
            for handle in request.frees:
                client.release(handle)
            out_frames: list = []
            fetched = [self._fetch(client, h, out_frames, request.bulk_min, later) for h in request.fetch]
        finally:
            self._imported.clear()
            # A replay is timed with its request, reads included: on a GPU its kernels run
            # asynchronously, and the request's read is where the daemon waits for them.
            for program in self._replayed:
                program.seconds = time.perf_counter() - clock
            self._replayed.clear()
        answer = {"fetched": fetched, "report": reported, "time": [started, time.time()]}
        if self._unlanded is not None:
            answer["failed"] = self._unlanded.describe()
        return answer, out_frames

    def _run_op(self, client: ClientState, call: OpCall, frames: list, device: torch.device, raise_errors: bool):
        try:
            genie_op = self._genie_ops.get(call.name)
            if genie_op is not None:
                return genie_op(client, call, frames, device)
            # An aten op, worked out once per name: a dict lookup per call, not four lru_caches
            # hashing the OpOverload (with the rest below, the executor's own cost per op here:
            # ~2.3 -> ~1.1 us over the op itself).
            aten = self._aten_ops.get(call.name)
            if aten is None:
                op = op_table.resolve(call.name)
                aten = self._aten_ops[call.name] = (op, programs.replaced_kernel(op, call.name) or _callable_of(op),
                                                    op_table.unsafe_flags(op), op_table.takes_generator(op),
                                                    op_table.seeded_without_generator(op),
                                                    op_table.resized_arguments(op))
                if call.name == device_faults.SIMULATED_OP:
                    aten = self._aten_ops[call.name] = (op, device_faults.simulated_failure, *aten[2:])
            op, kernel, unsafe, takes_generator, seeded_without_generator, resized = aten
            if unsafe:
                op_table.check_call(op, call.args, call.kwargs)
            # Handles and plain values inline (most arguments of most ops), the rest in _resolve.
            tensors, resolve, args = client.tensors, self._resolve, []
            for a in call.args:
                kind = type(a)
                if kind is HandleRef:
                    found = tensors.get(a.id)
                    if type(found) is not torch.Tensor and not isinstance(found, torch.Tensor):
                        found = resolve(client, a, frames, device, 0)  # missing or poisoned: raised there
                    args.append(found)
                elif kind in _PLAIN:
                    args.append(a)
                else:
                    args.append(resolve(client, a, frames, device, 0))
            kwargs = {k: resolve(client, v, frames, device, 0) for k, v in call.kwargs.items()} if call.kwargs else {}
            if takes_generator and kwargs.get("generator") is None:
                kwargs["generator"] = client.generator(device)
            if seeded_without_generator:
                with drawing_from(client.generator(device), device):
                    result = kernel(*args, **kwargs)
            else:
                result = kernel(*args, **kwargs)
            if raise_errors and isinstance(result, torch.Tensor):  # the client plans no other result
                _refuse_unstrided(result)
            if call.strides is not None:
                result = layouts.with_planned_strides(result, call.strides)
            outs = call.outs
            if type(outs) is int and type(result) is torch.Tensor:  # _store's common case
                client.put(outs, result)
            else:
                self._store(client, outs, result, call.name)
            for position, name in resized:  # the memory account follows storages the op resized
                target = call.args[position] if position < len(call.args) else call.kwargs.get(name)
                for ref in found_in(target, HandleRef):
                    client.recount(ref.id)
            if self.memory_limit and self.account.allocated > self.memory_limit:
                self._enforce_limit(client, call)
            return result
        except Poisoned as p:
            # An input already failed: carry the original error forward.
            self._poison(client, call, p.poison)
            if raise_errors:
                raise _RemoteOpError(p.poison) from None
            return None
        except Exception as e:  # the op failed (or was refused): record it where the client will look
            if _NOT_RESIZABLE in str(e) and _make_resizable(client, call):
                return self._run_op(client, call, frames, device, raise_errors)  # once: now they can grow
            return self._fail(client, call, e, raise_errors)

    def _fail(self, client: ClientState, call: OpCall, e: Exception, raise_errors: bool):
        if device_faults.context_lost(e, self.devices):
            self.device_lost = device_faults.DeviceLost(call.name, e)
            raise self.device_lost from e  # the request's answer says so; the daemon restarts
        if is_allocation_failure(e):
            e = OutOfMemoryError(f"genie-daemon could not allocate memory for {call.name}: {str(e).strip()}")
        poison = Poison(call.name, type(e).__name__, str(e).strip())
        log.debug("op %s failed: %s", call.name, e)
        self._poison(client, call, poison)
        if raise_errors:
            raise _RemoteOpError(poison) from None
        return None

    def _import_shared(self, shared: tuple, device: torch.device) -> None:
        """Copy every CUDA IPC tensor of the request in before any op runs, so each opened handle is
        let go again (the client's memory freed) even when an op before its use fails."""
        if device.type != "cuda":
            err = ProtocolError(f"CUDA IPC tensors go to a GPU; this request runs on {device}")
            self._imported.update((id(m), err) for m in shared)
            return
        if self._importer is None:
            self._importer = cuda_ipc.Importer()
        for marker in shared:
            try:
                self._imported[id(marker)] = self._importer.copy_in(marker, device)
            except Exception as e:  # noqa: BLE001 - a bad or foreign handle fails the ops that use it
                self._imported[id(marker)] = e if isinstance(e, ProtocolError) else \
                    RuntimeError(f"CUDA IPC: could not open the client's GPU memory: {e}")

    def release_cached(self) -> int:
        """Let go of memory kept for reuse (torch.remote_accelerator.empty_cache): the CUDA caching
        allocator's unused blocks and idle pinned staging buffers. Bytes of staging released (the
        CUDA allocator's share shows in its reserved figure)."""
        released = sum(u.pool.release_idle() for u in self._uploaders.values())
        if self.has_cuda:
            torch.cuda.empty_cache()
        return released

    def gpu_path_stats(self) -> dict:
        """How tensors reached and left the GPUs: through pinned staging, by CUDA IPC, or by UCX
        straight from and into GPU memory."""
        imp = self._importer
        staged = [u.stats() for u in self._uploaders.values()]
        return {
            "cuda_ipc_imports": {"tensors": imp.imported if imp else 0, "bytes": imp.imported_bytes if imp else 0},
            "pinned_staging": {k: sum(s[k] for s in staged)
                               for k in ("uploads", "bytes", "downloads", "download_bytes", "pinned_bytes")},
            "ucx_gpu_memory": {"uploads": self.gpu_memory_uploads, "bytes": self.gpu_memory_upload_bytes,
                               "downloads": self.gpu_memory_downloads, "download_bytes": self.gpu_memory_download_bytes},
        }

    def moves_memory_only(self, client: ClientState, request: Exec) -> bool:
        """Whether the request runs no kernel at all on a CPU device: adopts of bulk uploads (kept
        as received), frees, and reads of tensors whose bytes go out as they are. Such a request
        starts no OpenMP team, so it may run on the event loop even where torch uses several
        threads (see DaemonServer.inline_ok), and its time does not grow with its bytes."""
        if request.device >= len(self.devices) or self.devices[request.device].type != "cpu" or request.shared:
            return False
        for call in request.ops:
            if call.name != ADOPT_OP or len(call.args) not in (1, 3) or not isinstance(call.args[0], BulkTensor):
                return False
        for handle in request.fetch:
            found = client.tensors.get(handle)
            if isinstance(found, torch.Tensor) and (found.device.type != "cpu"
                                                    or not is_dense(found) and dense_span(found) is None):
                return False  # made dense (a copy kernel) or read back from a GPU first
        return True

    def _settings_key(self, request) -> str:
        """The numerics settings a request runs under, as a key (they choose among kernels). A GPU
        daemon asks twice per request (quick_to_start, then run): the key is made once per
        settings object (the one kept here cannot be freed and its id reused; read as one tuple,
        as the loop and the worker thread both ask)."""
        last = self._last_settings
        if request.numerics is not last[0]:
            last = self._last_settings = (request.numerics, repr(request.numerics or numerics.DEFAULT))
        return last[1]

    def quick_to_start(self, client: ClientState, request) -> bool:
        """Whether the request can run on the daemon's event loop without stalling it: no GPU work
        of this client still running (a read-back would wait for it), no op this daemon has not run
        before (the first conv loads cuDNN, the first use of a kernel loads its module: on an H100,
        a test of nn functionals run inline stalled the event loop past the 3 s heartbeat timeout),
        no replay that traces first or whose last run took over INLINE_REPLAY_S, and no more than
        INLINE_TENSOR_BYTES of tensors among the ops' arguments, counting sizes named in them (a
        CPU daemon ran `(a @ a @ a @ a).item()` of 4096x4096 inline for seconds: clients' heartbeats
        went unanswered and they declared it lost, their tensors with it)."""
        if self.has_cuda:
            if not client.streams.idle(self.devices):
                return False
            settings = self._settings_key(request)
            if not all((call.name, settings) in self._warm_ops for call in request.ops):
                return False
        budget = INLINE_TENSOR_BYTES
        for call in request.ops:
            if call.name == REPLAY_OP and len(call.args) == 1 and type(call.args[0]) is int:
                program = client.programs.get(call.args[0])
                if program is not None and (not programs.traced(program) or program.seconds is None
                                            or program.seconds > INLINE_REPLAY_S):
                    return False
            budget -= _argument_bytes(client, call.args) + _argument_bytes(client, call.kwargs.values())
            if budget < 0:
                return False
        return True

    def _uploader(self, device: torch.device):
        uploader = self._uploaders.get(device)
        if uploader is None:
            from .cuda_staging import PinnedStaging

            uploader = self._uploaders[device] = PinnedStaging(device)
        return uploader

    def _enforce_limit(self, client: ClientState, call: OpCall) -> None:
        if not self.memory_limit or self.account.allocated <= self.memory_limit:
            return
        if self.kv_store is not None:
            self.kv_store.evict_for(self.account.allocated - self.memory_limit)
        if self.account.allocated <= self.memory_limit:
            return
        over = self.account.allocated
        for handle in handles_in(call.outs):
            client.free(handle)
        raise OutOfMemoryError(
            f"genie-daemon memory limit of {self.memory_limit / 2**30:.3g} GiB ({self.memory_limit} bytes) exceeded: "
            f"{call.name} would hold {over} bytes in total; free tensors or raise --memory-limit"
        )

    def _kv(self, client: ClientState, call: OpCall, frames: list, device: torch.device):
        store = self.kv_store
        if call.name == KV_CLOSE_OP:
            store.close(call.args[0] if call.args else None)
            return None
        if call.name == KV_GET_OP:
            if len(call.args) != 2:
                raise ProtocolError(f"{KV_GET_OP} takes [session, layer]")
            result = store.get(*call.args)
        else:
            if len(call.args) != 5:
                raise ProtocolError(f"{KV_APPEND_OP} takes [session, layer, key, value, dim]")
            sid, layer, k, v, dim = call.args
            k, v = (self._resolve(client, x, frames, device, 0) for x in (k, v))
            if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
                raise ProtocolError(f"{KV_APPEND_OP} takes tensors for key and value")
            result = store.append(sid, layer, k, v, dim)
        self._store(client, call.outs, result, call.name)
        self._enforce_limit(client, call)
        return result

    def _adopt(self, client: ClientState, call: OpCall, frames: list, device: torch.device):
        """Keep an uploaded tensor as received (on the CPU: the frame itself, no copy). With a shape
        and strides after it, the upload is the dense run of a channels-last or transposed tensor
        (transport.tensors.dense_span), kept with those strides."""
        args = call.args
        if (len(args) not in (1, 3) or not isinstance(args[0], (InlineTensor, BulkTensor, SharedCudaTensor))
                or type(call.outs) is not int):
            raise ProtocolError(f"{ADOPT_OP} takes one inline tensor, [shape, strides], and one output handle")
        if isinstance(args[0], BulkTensor) and device.type == "cpu":
            # Kept as received, read only by later requests: the client may still be copying
            # the bytes into their shared segment (see bulk.Lane.send's write_behind).
            tensor = self._bulk_upload(client, args[0], being_written_ok=True)
        else:
            tensor = self._resolve(client, args[0], frames, device, 0)
        if len(args) == 3:
            shape = check_shape(args[1])
            if tensor.dim() != 1 or tensor.numel() != math.prod(shape):
                raise ProtocolError(f"{ADOPT_OP}: a run of {tensor.numel()} elements for shape {list(shape)}")
            tensor = tensor.as_strided(shape, check_strides(args[2], shape))
        client.put(call.outs, tensor)
        self._enforce_limit(client, call)
        return tensor

    @staticmethod
    def _record_stream(client: ClientState, call: OpCall) -> None:
        """The client's `t.record_stream(s)`, run on s: on a GPU the caching allocator keeps the
        tensor's block from reuse until the work queued on s so far is done. A CPU device runs
        every stream's work in order, so its memory can never be reused early: nothing to do."""
        if len(call.args) != 1 or not isinstance(call.args[0], HandleRef) or call.outs is not None:
            raise ProtocolError(f"{RECORD_STREAM_OP} takes [handle] and no output")
        tensor = held(client, call.args[0])
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))

    def _share_cuda(self, client: ClientState, call: OpCall):
        """A snapshot of a resident GPU tensor as a CUDA IPC descriptor (reported), or None when
        it cannot go that way (the client then fetches its bytes)."""
        if len(call.args) != 1 or not isinstance(call.args[0], HandleRef):
            raise ProtocolError(f"{SHARE_CUDA_OP} takes one handle")
        found = held(client, call.args[0])
        if found.device.type != "cuda" or not self.cuda_ipc_with(client.identity):
            return None
        return protocol.encode_cuda_ipc(cuda_ipc.describe(found))

    def _send(self, client: ClientState, call: OpCall):
        """Ship a tensor to a peer daemon (for the client's genie::recv there)."""
        from .peers import check_transfer_id

        if len(call.args) != 3 or not isinstance(call.args[0], HandleRef) or not isinstance(call.args[1], str):
            raise ProtocolError(f"{SEND_OP} takes [handle, peer endpoint, transfer id]")
        found = held(client, call.args[0])
        self.send_to_peer(call.args[1], check_transfer_id(call.args[2]), found)
        return None

    def _recv(self, client: ClientState, call: OpCall, device: torch.device):
        from .peers import check_transfer_id

        if len(call.args) != 1 or type(call.outs) is not int:
            raise ProtocolError(f"{RECV_OP} takes [transfer id] and one output handle")
        tensor = self.mailbox.take(check_transfer_id(call.args[0]), self.transfer_timeout)
        # CPU: keep the frame, copied only if it lies off COMPUTE_ALIGNMENT (ZeroMQ frames do).
        tensor = tensor.to(device) if device.type != "cpu" else aligned_for_compute(tensor)
        client.put(call.outs, tensor)
        self._enforce_limit(client, call)
        return tensor

    def _persist(self, client: ClientState, call: OpCall):
        """Mark handles as long-lived state (KV caches): reported in stats, first to keep under pressure."""
        for ref in call.args:
            if not isinstance(ref, HandleRef):
                raise ProtocolError(f"{PERSIST_OP} takes handles")
            client.get(ref.id)
            client.persistent.add(ref.id)
        return None

    def _resolve(self, client: ClientState, value, frames: list, device: torch.device, depth: int):
        if type(value) in _PLAIN:
            return value
        if isinstance(value, HandleRef):
            return held(client, value)
        if isinstance(value, list):
            if depth >= protocol.MAX_NESTING:
                raise ProtocolError("arguments nested too deeply")
            return [self._resolve(client, v, frames, device, depth + 1) for v in value]
        if isinstance(value, InlineTensor):
            if max(value.frames) >= len(frames):
                raise ProtocolError(f"inline tensor refers to frame {max(value.frames)}, message has {len(frames)}")
            t = frames_to_tensor([frames[i].buffer for i in value.frames], value.dtype, value.shape)
            # A GPU copy reads the frame as it lies; CPU kernels need it aligned (COMPUTE_ALIGNMENT).
            return self._uploader(device).upload(t) if device.type == "cuda" else aligned_for_compute(t)
        if isinstance(value, BulkTensor):
            t = self._bulk_upload(client, value)
            if t.device == device:
                if t.is_cuda:  # landed by the UCX lane's thread: its block must outlive this stream's use
                    t.record_stream(torch.cuda.current_stream(device))
                    self.gpu_memory_uploads += 1
                    self.gpu_memory_upload_bytes += t.nbytes
                return t
            if t.is_cuda:  # landed on another GPU than the op's (a client naming devices oddly)
                return t.to(device)
            return self._uploader(device).upload(t) if device.type == "cuda" else t
        if type(value) is SharedCudaTensor:
            imported = self._imported.get(id(value))
            if isinstance(imported, BaseException):
                raise imported
            if imported is None:
                raise ProtocolError("CUDA IPC tensor was not imported")
            return imported
        if isinstance(value, DeviceRef):
            if value.type == "cpu":
                return torch.device("cpu")
            if value.index >= len(self.devices):
                raise ProtocolError(f"device index {value.index} out of range ({len(self.devices)} devices)")
            return self.devices[value.index]
        if type(value) is GeneratorRef:
            return client.drawing_generator(value, device)
        if isinstance(value, dict):
            raise ProtocolError("maps are not valid operator arguments")
        return value

    def _store(self, client: ClientState, outs, result, name: str) -> None:
        if outs is None or (result is None and outs == []):  # an op returning nothing: `-> ()`
            return
        if isinstance(outs, int):
            if result is None:
                return
            if not isinstance(result, torch.Tensor):
                raise ProtocolError(f"{name} returned {type(result).__name__}, client expected a tensor")
            client.put(outs, result)
            return
        if not isinstance(result, (list, tuple)) or len(result) > len(outs):
            raise ProtocolError(f"{name}: returned more outputs than the client has handles for ({len(outs)})")
        for o, r in zip(outs, result):
            self._store(client, o, r, name)

    def _poison(self, client: ClientState, call: OpCall, poison: Poison) -> None:
        """Poison what the op writes; if that is nothing, the request's answer reports the failure."""
        landed = False
        for handle in handles_in(call.outs):
            client.put(handle, poison)
            landed = True
        try:
            op = op_table.resolve(call.name)
        except ProtocolError:
            op = None
        for position, name in op_table.written_arguments(op) if op is not None else ():
            target = call.args[position] if position < len(call.args) else call.kwargs.get(name)
            for ref in found_in(target, HandleRef):
                if ref.id in client.tensors:
                    client.put(ref.id, poison)
                    landed = True
        if not landed and self._unlanded is None:
            self._unlanded = poison

    def _describe(self, outs, result):
        """The reported op's outputs as plain values (tensors as metadata, kept under their handles)."""
        if isinstance(result, torch.Tensor):
            if not isinstance(outs, int):
                raise ProtocolError("a reported tensor needs a handle id")
            return {"tensor": [outs, dtype_name(result.dtype), list(result.shape), list(result.stride()),
                               result.storage_offset(), result.untyped_storage().nbytes()]}
        if type(result) is msgpack.ExtType:  # a tuple too: before the tuple case
            if result.code != protocol.EXT_CUDA_IPC:
                raise ProtocolError("cannot report this extension value")
            return result
        if isinstance(result, (list, tuple)):
            sub = outs if isinstance(outs, list) and len(outs) >= len(result) else [None] * len(result)
            return [self._describe(o, r) for o, r in zip(sub, result)]
        if isinstance(result, complex):
            return protocol.encode_complex(result)
        if isinstance(result, (bool, int, float)) or result is None:
            return result
        if isinstance(result, torch.dtype):
            return protocol.encode_dtype(result)
        raise ProtocolError(f"cannot report a {type(result).__name__}")

    def _bulk_upload(self, client: ClientState, value: BulkTensor, being_written_ok: bool = False) -> torch.Tensor:
        """The payload the client sent on its bulk lane, as a tensor over the received buffer."""
        if self.bulk is None:
            raise ProtocolError("this daemon has no bulk lanes")
        raw = self.bulk.take_upload(client.identity, value.xfer, self.transfer_timeout, being_written_ok)
        return bytes_as_tensor(raw, value.dtype, value.shape, f"bulk transfer {value.xfer}")

    def _fetch(self, client: ClientState, handle: int, out_frames: list, bulk_min: int = 0,
               later: list | None = None):
        try:
            found = client.get(handle)
        except KeyError as e:
            return {"error": protocol.error_body(e)}
        if isinstance(found, Poison):
            return {"error": found.describe()}
        nbytes = found.numel() * found.element_size()
        # A channels-last or transposed tensor goes as its memory lies, with its strides (the
        # client lays it out so): no permuting copy here, none there. (On a GPU the run is staged
        # or sent like any contiguous tensor.)
        span = dense_span(found.detach())
        layout = {"strides": list(found.stride())} if span is not None else {}
        source = span if span is not None else found.detach()
        if bulk_min and nbytes >= bulk_min and self.bulk is not None:
            try:
                if found.device.type == "cuda" and self.bulk.moves_gpu_memory(client.identity, found.device):
                    src = dense_bytes(source)
                    # UCX reads the memory with no stream of ours: whatever stream wrote it must be done.
                    torch.cuda.synchronize(found.device)
                    xfer = self.bulk.send_download(client.identity, src)
                    self.gpu_memory_downloads += 1
                    self.gpu_memory_download_bytes += nbytes
                elif found.device.type == "cuda":
                    # The lane sends synchronously: the pinned buffer is free again right after.
                    with self._uploader(found.device).download(source) as staged:
                        xfer = self.bulk.send_download(client.identity, staged)
                else:
                    payload = tensor_to_buffer(source)
                    if nbytes <= NAMED_DOWNLOAD_BYTES:
                        # Copied into the client's mapping of one of our segments now and named
                        # in the answer: no lane record after it, no wake-up of its lane thread.
                        named = self.bulk.named_download(client.identity, payload)
                        if named is not None:
                            return {"segment": named, "dtype": dtype_name(found.dtype), "shape": list(found.shape),
                                    **layout}
                    if later is not None:
                        download = self.bulk.later_download(client.identity, payload)
                        if download is not None:
                            later.append(download)
                        xfer = download.xfer if download is not None else None
                    else:
                        xfer = self.bulk.send_download(client.identity, payload)
            except ConnectionError as e:
                return {"error": protocol.error_body(e)}
            if xfer is not None:
                return {"bulk": xfer, "dtype": dtype_name(found.dtype), "shape": list(found.shape), **layout}
        # A copy: the answer's frames may still be leaving (a zmq send without copy, a partial send
        # queued on the direct lane) when a later request writes the tensor in place (measured:
        # 8-10 of 40 async reads of 0.25-0.5 MiB then got values written after them).
        # (A GPU tensor's bytes are copied to the host on the way anyway.)
        src = source
        if src.device.type == "cpu":
            src = snapshot(src) if is_dense(src) else dense(src)  # dense() of another layout is a copy already
        chunks = tensor_to_frames(src)
        first = len(out_frames)
        out_frames.extend(chunks)
        ref = first if len(chunks) == 1 else list(range(first, first + len(chunks)))
        if span is not None:
            return [ref, dtype_name(found.dtype), list(found.shape), layout["strides"]]
        return [ref, dtype_name(found.dtype), list(found.shape)]


# What a request may hold to run on the event loop (see Executor.quick_to_start): tensors among
# its ops' arguments (sizes named in them count as 4-byte elements) of at most this many bytes in
# all (a 724x724 float matmul, ~20 ms on one slow core), and replays whose last run took at most this long.
INLINE_TENSOR_BYTES = 4 << 20
INLINE_REPLAY_S = 0.01
# Downloads up to this size are copied into a shared segment by the request itself (on the event
# loop when it runs there: ~2-8 ms at most); larger ones go on the lane, from the worker.
NAMED_DOWNLOAD_BYTES = 16 << 20


_PLAIN = frozenset({int, float, bool, str, type(None)})  # arguments that are their own value


def _argument_bytes(client: ClientState, values, depth: int = 0) -> int:
    """Bytes of the client's tensors among `values` (nested lists too), plus 4 per element of any
    size a list of ints names; a handle made earlier in the same request counts nothing here (its
    size is named by the op that makes it)."""
    total = 0
    for value in values:
        if isinstance(value, HandleRef):
            found = client.tensors.get(value.id)
            if isinstance(found, torch.Tensor):
                total += found.numel() * found.element_size()
        elif isinstance(value, list) and depth < 4:
            if value and all(type(v) is int for v in value):
                elements = 1
                for v in value:
                    elements *= max(v, 1)
                total += 4 * elements
            else:
                total += _argument_bytes(client, value, depth + 1)
    return total


class _RemoteOpError(Exception):
    """The reported op failed; the server answers the request with this error."""

    def __init__(self, poison: Poison) -> None:
        super().__init__(poison.message)
        self.poison = poison


RemoteOpError = _RemoteOpError
