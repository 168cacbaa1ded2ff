"""torch.distributed collectives on remote tensors, staged through this process's CPU backend.

A process group's backends (gloo, NCCL) move bytes between processes' memory, and a remote
tensor's memory is on a genie-daemon, beyond their reach. PyTorch dispatches a collective on
remote tensors (`dist.all_reduce(t)`, DistributedDataParallel's gradient buckets and its
start-up broadcast, `dist.all_gather`, ...) to Genie as a `c10d` op; Genie runs the same op on
CPU copies, so the group's CPU backend (gloo) does the communication, waits for it, and writes
the results back into the remote tensors (uploads queued in order with the rest of the work).
Each collective so costs a download and an upload of the tensors it writes, and the call
returns once the exchange is done: the Work it hands back is complete, its future holding the
remote tensors, as DDP's reducer expects of the future of an all_reduce.

Functional collectives (`torch.ops._c10d_functional`, which DTensor uses) return new tensors:
run on CPU copies, waited for, their results uploaded to the input's device.

A group with no CPU backend (NCCL alone) cannot run them: the error says to add gloo.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .lazy_tensor import LazyTensor
from .materialize import to_cpu_many
from .sparse_coo import RemoteSparseCOO

_REMOTE = (LazyTensor, RemoteSparseCOO)  # the remote tensors a collective stages through the CPU

# c10d ops that write nothing: the rest write their first argument (the tensors reduced or
# broadcast in place, or the outputs of a gather, scatter or receive).
_WRITE_NOTHING = frozenset({"send", "barrier", "monitored_barrier_", "check_for_nan"})
# Ops whose first argument is only written: its old values need not be fetched.
_OUTPUT_ONLY = frozenset({"allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                          "gather_", "alltoall_", "alltoall_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
                          "_reduce_scatter_base_", "scatter_", "recv_", "recv_any_source_"})


def _tensors(value, found: list, kind: type = LazyTensor) -> None:
    """The tensors of `kind` in `value` (a tensor, or lists and tuples of them), into `found`."""
    if isinstance(value, kind):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, found, kind)


def _replace(value, table: dict):
    if isinstance(value, torch.Tensor):
        return table.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(v, table) for v in value)
    return value


def _wait(out) -> None:
    for item in out if isinstance(out, tuple) else (out,):
        if isinstance(item, torch.ScriptObject):  # a c10d Work, boxed for the dispatcher
            dist.Work.unbox(item).wait()


def _no_cpu_backend(func, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"{func}: a collective on remote_accelerator tensors runs on CPU copies, through the process "
        f"group's CPU backend, and this group has none ({error}). Create the group with gloo for the "
        "CPU, e.g. dist.init_process_group('gloo') or backend='cpu:gloo,cuda:nccl'")


def run_c10d(func, args, kwargs):
    """A `c10d` op (dist.all_reduce and the others, and what DDP calls) with remote tensors, dense
    or sparse COO (DDP all-reduces the sparse gradients of nn.Embedding(sparse=True) as they are)."""
    name = func._schema.name.split("::", 1)[1]
    writes = name not in _WRITE_NOTHING
    outputs: list = []
    if writes and args:
        _tensors(args[0], outputs, _REMOTE)
    inputs: list = []
    for i, arg in enumerate(args):
        if not (i == 0 and writes and name in _OUTPUT_ONLY):
            _tensors(arg, inputs, _REMOTE)
    for value in kwargs.values():
        _tensors(value, inputs, _REMOTE)
    to_cpu = dict(zip(map(id, inputs), to_cpu_many(inputs))) if inputs else {}
    for t in outputs:
        if id(t) not in to_cpu:
            to_cpu[id(t)] = t.cpu() if t.is_sparse else torch.empty_like(t, device="cpu")
    cpu_args = [_replace(a, to_cpu) for a in args]
    cpu_kwargs = {k: _replace(v, to_cpu) for k, v in kwargs.items()}
    try:
        out = func(*cpu_args, **cpu_kwargs)
    except RuntimeError as e:
        if "No backend type associated with device type cpu" in str(e):
            raise _no_cpu_backend(func, e) from None
        raise
    _wait(out)
    back = {id(to_cpu[id(t)]): t for t in outputs}
    for t in outputs:
        t.copy_(to_cpu[id(t)])  # queued on t's stream, before anything the program does next
    back.update({id(to_cpu[id(t)]): t for t in inputs})
    result = _replace(out, back)
    if not isinstance(result, tuple) and not isinstance(result, torch.ScriptObject):
        return result
    items = result if isinstance(result, tuple) else (result,)
    done = []
    for item in items:
        if isinstance(item, torch.ScriptObject):
            try:
                value = _replace(dist.Work.unbox(item).get_future().value(), back)
            except RuntimeError:  # a Work without a future (gloo's send and recv)
                value = list(outputs)
            future = torch.futures.Future()
            future.set_result(value)
            item = torch._C._distributed_c10d._create_work_from_future(future).boxed()
        done.append(item)
    return tuple(done) if isinstance(result, tuple) else done[0]


def run_functional(func, args, kwargs):
    """A functional collective (`_c10d_functional`): new tensors, on the device of the first remote input."""
    name = func._schema.name.split("::", 1)[1]
    if name == "wait_tensor":
        return args[0]  # the collective that made it was waited for already
    inputs: list = []
    for value in (*args, *kwargs.values()):
        _tensors(value, inputs)
    device = inputs[0].device
    to_cpu = dict(zip(map(id, inputs), to_cpu_many(inputs)))
    out = func(*[_replace(a, to_cpu) for a in args], **{k: _replace(v, to_cpu) for k, v in kwargs.items()})
    results: list = []
    _tensors(out, results, torch.Tensor)
    for t in results:
        torch.ops._c10d_functional.wait_tensor(t)
    return _replace(out, {id(t): t.to(device) for t in results})
