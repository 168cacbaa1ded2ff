"""Which requests a daemon may run on its event loop (Executor.quick_to_start), without a daemon:
never a replay that still has to trace, and on a GPU never with the client's GPU work queued or
with an op the daemon has not run before under the same numerics settings (a first conv loads
cuDNN, a first TF32 matmul took ~4 s on an H100: the loop would miss heartbeats)."""
from __future__ import annotations

import dataclasses

import torch

from daemon import fused, programs
from daemon.executor import REPLAY_OP, Executor
from daemon.handles import ClientState, MemoryAccount
from genie.transport import numerics
from genie.transport.protocol import Exec, OpCall


def _request(*names, args=()):
    return Exec(device=0, ops=[OpCall(n, list(args), {}, None) for n in names], frees=[], fetch=[], report=False)


def _client_with_program(program_id: int) -> tuple[ClientState, programs.Program]:
    client = ClientState(b"unit", MemoryAccount())
    program = programs.Program([], set())
    program.compiled = programs.Compiled(0, [], [], [], [])
    seg = fused.Segment(0, 2, inputs=[0], outputs=[1], drop=[], key=("unit-inline",))
    program.compiled.segments = [(seg, None)]
    client.programs[program_id] = program
    return client, program


def test_a_replay_that_must_trace_first_goes_to_the_worker():
    executor = Executor([torch.device("cpu")])
    client, program = _client_with_program(7)
    replay = _request(REPLAY_OP, args=[7])
    assert not executor.quick_to_start(client, replay)
    program.compiled.segments[0][0].fn = fused.INTERPRET  # what its first replay leaves behind
    program.seconds = 0.001                                 # with how long it ran
    assert executor.quick_to_start(client, replay)
    assert executor.quick_to_start(client, _request(REPLAY_OP, args=[8]))  # unknown: the op reports it
    assert executor.quick_to_start(client, _request(REPLAY_OP, args=[[7]]))  # malformed: likewise


def test_on_a_gpu_only_ops_run_there_before_and_only_with_the_gpu_idle(monkeypatch):
    executor = Executor([torch.device("cpu")])
    executor.has_cuda = True  # the rules, without a GPU: the stream query is stood in for
    client = ClientState(b"unit", MemoryAccount())
    idle = [True]
    monkeypatch.setattr(client.streams, "idle", lambda devices: idle[0])
    request = _request("aten::conv2d", "aten::relu")
    assert not executor.quick_to_start(client, request)
    settings = executor._settings_key(request)
    executor._warm_ops.update({("aten::conv2d", settings)})
    assert not executor.quick_to_start(client, request)
    executor._warm_ops.add(("aten::relu", settings))
    assert executor.quick_to_start(client, request)
    tf32 = ["tf32", *numerics.DEFAULT[1:]]  # other settings pick other kernels: not warm yet
    assert not executor.quick_to_start(client, dataclasses.replace(request, numerics=tf32))
    idle[0] = False
    assert not executor.quick_to_start(client, request)


def test_running_a_request_on_a_gpu_daemon_warms_its_ops():
    executor = Executor([torch.device("cpu")])
    executor.has_cuda = True
    client = ClientState(b"unit", MemoryAccount())
    request = _request("aten::zeros")
    executor.run(client, request, [])  # a bad call still counts: it ran
    assert ("aten::zeros", executor._settings_key(request)) in executor._warm_ops


def _call(name, *args, **kwargs):
    return Exec(device=0, ops=[OpCall(name, list(args), kwargs, None)], frees=[], fetch=[], report=False)


def test_requests_on_large_tensors_or_naming_large_sizes_go_to_the_worker():
    # A CPU daemon that ran `(a @ a @ a @ a).item()` of 4096x4096 inline stalled its event loop for
    # seconds: its clients' heartbeats went unanswered and they declared it lost.
    from daemon.executor import INLINE_TENSOR_BYTES
    from genie.transport.protocol import HandleRef

    executor = Executor([torch.device("cpu")])
    client = ClientState(b"unit", MemoryAccount())
    side = 1
    while 4 * side * side * 2 <= INLINE_TENSOR_BYTES:
        side *= 2
    client.put(1, torch.zeros(side // 2, side // 2))  # two of it fit
    client.put(2, torch.zeros(side, side))            # two of it do not
    assert executor.quick_to_start(client, _call("aten::mm", HandleRef(1), HandleRef(1)))
    assert not executor.quick_to_start(client, _call("aten::mm", HandleRef(2), HandleRef(2)))
    assert not executor.quick_to_start(client, _call("aten::cat", [HandleRef(2), HandleRef(2)]))  # nested
    assert executor.quick_to_start(client, _call("aten::zeros", [64, 64]))
    assert not executor.quick_to_start(client, _call("aten::zeros", [4096, 4096]))  # a size named in the op
    assert executor.quick_to_start(client, _call("aten::slice.Tensor", HandleRef(1), 0, 0, 2**63 - 1))


def test_a_replay_runs_inline_only_after_a_short_run():
    from daemon.executor import INLINE_REPLAY_S

    executor = Executor([torch.device("cpu")])
    client, program = _client_with_program(9)
    program.compiled.segments[0][0].fn = fused.INTERPRET  # traced (or settled on interpreting)
    replay = _request(REPLAY_OP, args=[9])
    assert not executor.quick_to_start(client, replay)  # never run: its length is unknown
    program.seconds = INLINE_REPLAY_S / 2
    assert executor.quick_to_start(client, replay)
    program.seconds = INLINE_REPLAY_S * 100
    assert not executor.quick_to_start(client, replay)


def test_requests_that_only_move_memory_may_run_on_the_loop_whatever_the_threads():
    # Adopting bulk uploads, freeing, and reading dense CPU tensors run no kernel, so no OpenMP
    # team starts on the event loop (Executor.moves_memory_only); anything else may.
    from genie.transport.protocol import ADOPT_OP, BulkTensor, InlineTensor

    executor = Executor([torch.device("cpu")])
    client = ClientState(b"unit", MemoryAccount())
    client.put(1, torch.ones(4, 4))
    client.put(2, torch.ones(4, 8)[:, ::2])
    client.put(3, torch.ones(4, dtype=torch.complex64).conj())
    client.put(4, torch.ones(4, 4).t())

    def request(ops=(), fetch=(), device=0):
        return Exec(device=device, ops=[OpCall(n, list(a), {}, 9) for n, a in ops], frees=[5], fetch=list(fetch),
                    report=False)

    adopt = (ADOPT_OP, [BulkTensor(1, torch.float32, (4,))])
    assert executor.moves_memory_only(client, request([adopt]))
    assert executor.moves_memory_only(client, request(fetch=[1]))
    assert executor.moves_memory_only(client, request(fetch=[77]))  # unknown: answered with an error
    assert not executor.moves_memory_only(client, request(fetch=[2]))  # made dense first: a copy kernel
    assert executor.moves_memory_only(client, request(fetch=[4]))  # a dense run in another order: sent as it lies
    assert executor.moves_memory_only(client, request([(ADOPT_OP, [BulkTensor(1, torch.float32, (4,)), [2, 2], [1, 2]])]))
    assert not executor.moves_memory_only(client, request(fetch=[3]))  # conjugation resolved first
    assert not executor.moves_memory_only(client, request([adopt, ("aten::relu", [])]))
    assert not executor.moves_memory_only(client, request([(ADOPT_OP, [InlineTensor((0,), torch.float32, (4,))])]))
    assert not executor.moves_memory_only(client, request([adopt], device=3))  # no such device: refused there
