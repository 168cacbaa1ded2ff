"""genie.Graph: a block recorded once and replayed by the daemon (like torch.cuda.CUDAGraph)."""
from __future__ import annotations

import copy
import gc
import time

import pytest
import torch

import genie

DEV = "remote_accelerator:0"


def test_replay_repeats_the_recorded_step(dev):
    w = torch.randn(8, 8) / 4
    x = torch.randn(1, 8)
    rw, rx = w.to(dev), x.to(dev)
    g = genie.Graph()
    with genie.graph(g):
        rx.copy_(torch.tanh(rx @ rw) + 0.5)  # runs once here, and is recorded
    assert g.ops >= 3
    for _ in range(5):
        g.replay()
    expected = x
    for _ in range(6):
        expected = torch.tanh(expected @ w) + 0.5
    torch.testing.assert_close(rx.cpu(), expected)


def test_decode_by_replay_gives_the_same_tokens_as_local_eager(dev):
    from genie.examples.gpt import GPTConfig, TinyGPT, generate, generate_static

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2)).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 12))
    expected = generate(model, prompt, 10)
    assert generate_static(model, prompt, 10) == expected  # the static cache itself is exact
    remote = copy.deepcopy(model).to(dev)
    assert generate_static(remote, prompt.to(dev), 10, replay=True) == expected


@pytest.mark.parametrize("action", ["item", "cpu", "upload"])
def test_recording_refuses_what_a_replay_cannot_do(dev, action):
    x = torch.ones(4, device=dev)
    with pytest.raises(genie.GenieError, match="cannot be recorded in a genie.graph"):
        with genie.graph(genie.Graph()):
            y = x * 2
            if action == "item":
                y.sum().item()
            elif action == "cpu":
                y.cpu()
            else:
                y.add_(torch.ones(4).to(dev))
    assert (x + 1).sum().item() == 8.0  # the stream carries on


def test_dropped_outputs_are_freed_after_each_replay_and_the_program_with_the_graph(dev):
    allocated = torch.remote_accelerator.memory_allocated
    base = torch.ones(256, 256, device=dev)
    torch.remote_accelerator.synchronize()
    gc.collect()
    before = allocated()
    g = genie.Graph()
    with genie.graph(g):
        out = base * 2 + 1  # an output the client keeps, then drops
        base.mul_(1.0)
    del out
    gc.collect()
    for _ in range(20):
        g.replay()
    torch.remote_accelerator.synchronize()
    during = allocated()
    assert during <= before, (before, during)  # the dropped output is not kept, let alone once per replay
    del g
    gc.collect()
    torch.remote_accelerator.synchronize()
    assert allocated() <= before, (before, allocated())


def test_a_ctrl_c_as_the_program_is_defined_still_drops_it_with_the_graph(dev, monkeypatch):
    """The drop was set up only once the daemon had checked the definition: a Ctrl-C in that
    wait left the program on the daemon for good (scripts/interrupt_fuzz.py)."""
    from genie.runtime import get_runtime
    from genie.runtime.stream import DeviceStream

    stream = get_runtime().stream(0)

    def programs() -> int:
        gc.collect()
        torch.remote_accelerator.synchronize()  # (drops go with the next batch)
        return stream.link.request("stats", {"dev": 0}).body["programs"]

    x = torch.ones(8, device=dev)
    before = programs()
    real_synchronize = DeviceStream.synchronize

    def interrupted_once(self):
        monkeypatch.setattr(DeviceStream, "synchronize", real_synchronize)
        real_synchronize(self)  # the definition goes out and is checked,
        raise KeyboardInterrupt  # and the Ctrl-C lands as the wait returns

    g = genie.Graph()
    with pytest.raises(KeyboardInterrupt):
        with genie.graph(g):
            x.add_(1)
            monkeypatch.setattr(DeviceStream, "synchronize", interrupted_once)
    assert programs() == before + 1
    del g
    assert programs() == before


def test_a_graph_keeps_the_tensors_it_reads_after_their_owners_drop_them(dev):
    # The usual shape of a decode loop: a helper records a step over tensors only its closure
    # holds, and hands back the graph and the output. Replays must still find those tensors.
    def record():
        w = torch.full((4, 4), 0.25, device=dev)
        bias = torch.ones(1, 4, device=dev)
        state = torch.zeros(1, 4, device=dev)
        g = genie.Graph()
        with genie.graph(g):
            state.copy_(state @ w + bias)
        return g, state

    g, state = record()
    gc.collect()
    allocated = torch.remote_accelerator.memory_allocated
    torch.remote_accelerator.synchronize()
    held = allocated()
    for _ in range(3):
        g.replay()
    expected = torch.zeros(1, 4)
    for _ in range(4):
        expected = expected @ torch.full((4, 4), 0.25) + 1
    torch.testing.assert_close(state.cpu(), expected)
    del g
    gc.collect()
    torch.remote_accelerator.synchronize()
    assert allocated() < held  # w and bias go with the graph


def test_a_graph_collected_while_another_records_stays_out_of_its_program(dev):
    # A Graph that only the cycle collector frees can die in the middle of another recording
    # (pytest.raises' tracebacks make such cycles). Its drop must not become part of that program.
    x = torch.zeros(3, device=dev)
    old = genie.Graph()
    with genie.graph(old):
        x.add_(1)
    cycle = [old]
    cycle.append(cycle)
    gc.disable()
    try:
        del old, cycle
        g = genie.Graph()
        with genie.graph(g):
            gc.collect()  # the old graph dies here
            x.mul_(2)
    finally:
        gc.enable()
    g.replay()
    assert x.cpu().tolist() == [4.0] * 3


def test_a_graph_dropped_just_before_an_op_run_for_its_result_leaves_that_op_last(dev, sent_ops):
    x = torch.tensor([0.0, 3.0], device=dev)
    g = genie.Graph()
    with genie.graph(g):
        x.mul_(2)
    g.replay()
    del g  # its drop goes with the next batch, where an op whose output shape depends on data runs last
    gc.collect()
    assert torch.nonzero(x).tolist() == [[1]]
    assert sent_ops.count("aten::nonzero") == 1  # its result came with the first answer (it was re-run before)
    assert x.tolist() == [0.0, 12.0]


@pytest.mark.parametrize("sync", ["synchronize", "cpu", "flush, then synchronize"])
def test_a_failed_op_that_poisons_no_tensor_is_raised_at_the_next_sync(dev, sync):
    x = torch.zeros(1, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        x.add_(1)
    g.program_id += 1000  # a program the daemon does not know (as after a failed definition)
    g.replay()
    with pytest.raises(genie.RemoteExecutionError, match="no such program"):
        if sync == "cpu":
            x.cpu()
        else:
            if sync.startswith("flush"):
                genie.flush()
                time.sleep(0.2)  # its answer arrives before the sync asks for nothing new
            torch.remote_accelerator.synchronize()
    assert x.cpu().tolist() == [1.0]  # raised once; the stream carries on
    g.program_id -= 1000


def test_a_failing_replayed_op_poisons_its_outputs(index_errors_are_op_errors):
    dev = index_errors_are_op_errors
    idx = torch.zeros(1, dtype=torch.long, device=dev)
    table = torch.randn(4, 2, device=dev)
    out = torch.zeros(1, 2, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        out.copy_(table[idx])
    idx.fill_(99)  # out of range for the next replay
    g.replay()
    with pytest.raises(genie.RemoteExecutionError, match="index"):
        out.cpu()


def test_bytes_per_replayed_token_do_not_grow_with_context(dev):
    from genie.examples.gpt import GPTConfig, StaticKVCache, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2)).eval().to(dev)
    link_stats = genie.transport_stats

    def bytes_per_token(context: int) -> float:
        cache = StaticKVCache(model.cfg, 1, context + 16, dev)
        with torch.no_grad():
            pos = torch.arange(context, device=dev)
            logits, _ = model(torch.randint(0, 512, (1, context)).to(dev), pos, cache)
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            pos = pos[-1:] + 1
            g = genie.Graph()
            with genie.graph(g):
                logits, _ = model(token, pos, cache)
                token.copy_(logits[:, -1].argmax(dim=-1, keepdim=True))
                pos.add_(1)
            token.item()
            start = sum(s["bytes_sent"] + s["bytes_received"] for s in link_stats().values())
            for _ in range(8):
                g.replay()
                token.item()
            end = sum(s["bytes_sent"] + s["bytes_received"] for s in link_stats().values())
        return (end - start) / 8

    short, long = bytes_per_token(16), bytes_per_token(200)
    # Equal but for msgpack's integer widths (request and handle ids grow during the run).
    assert abs(short - long) <= 4, (short, long)
    assert short < 300, short  # a replay and a scalar read, not the step's ops


def test_random_ops_draw_new_values_on_each_replay(dev):
    x = torch.zeros(8, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        x.copy_(torch.rand(8, device=dev))  # RNG ops replay through the general path, on the client's generator
    first = x.cpu()
    g.replay()
    second = x.cpu()
    assert not torch.equal(first, second)
    assert ((second >= 0) & (second < 1)).all()


def _segments():
    from genie.runtime import get_runtime

    return get_runtime().stream(0).link.request("stats", {"dev": 0}).body["program_segments"]


def test_replays_run_as_traced_segments_and_a_second_recording_reuses_them(dev):
    from genie.examples.gpt import GPTConfig, TinyGPT, generate, generate_static

    torch.manual_seed(1)
    model = TinyGPT(GPTConfig(n_layers=2, dim=64)).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5))
    expected = generate(model, prompt, 6)
    remote = copy.deepcopy(model).to(dev)
    before = _segments()
    assert generate_static(remote, prompt.to(dev), 6) == expected
    first = _segments()
    assert first["traced"] + first["reused"] > before["traced"] + before["reused"]  # the step ran as TorchScript
    assert first["interpreted"] == before["interpreted"]  # every multi-op segment of the GPT step traced
    assert generate_static(remote, prompt.to(dev), 6) == expected  # a new genie.Graph for the same step
    second = _segments()
    assert second["traced"] == first["traced"] and second["reused"] > first["reused"]


def test_a_failing_traced_segment_reruns_op_by_op_without_repeating_side_effects(index_errors_are_op_errors):
    dev = index_errors_are_op_errors
    idx = torch.zeros(1, dtype=torch.long, device=dev)
    table = torch.randn(4, 2, device=dev)
    out = torch.zeros(1, 2, device=dev)
    before, after = torch.zeros(3, device=dev), torch.zeros(3, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        before.add_(1)             # lands once per run, before the failing op
        out.copy_(table[idx] * 2)  # fails on the replay below
        after.add_(1)              # independent of the failure: runs, as in an op-by-op run
    idx.fill_(99)
    g.replay()
    with pytest.raises(genie.RemoteExecutionError, match="index"):
        out.cpu()
    assert before.cpu().tolist() == [2.0] * 3
    assert after.cpu().tolist() == [2.0] * 3


def test_replayed_scalars_keep_their_types(dev):
    # Programs that differ only in 1 vs 1.0 (or 0.0 vs -0.0) must not share a trace.
    x = torch.arange(4, device=dev)
    outs = []
    for scalar in (1, 1.0):
        y = torch.zeros(4, dtype=torch.float32, device=dev)
        g = genie.Graph()
        with genie.graph(g):
            y.copy_(x * scalar)
        g.replay()
        outs.append(y)
        r = (x * scalar)
        assert r.dtype == (torch.int64 if scalar == 1 and type(scalar) is int else torch.float32)
    z = torch.ones(2, device=dev)
    signs = []
    for scalar in (0.0, -0.0):
        w = torch.zeros(2, device=dev)
        g = genie.Graph()
        with genie.graph(g):
            w.copy_(z * scalar)
        g.replay()
        signs.append(torch.signbit(w.cpu()).tolist())
    assert signs == [[False, False], [True, True]]


def test_a_write_merged_before_a_failing_one_lands_once_with_its_value(index_errors_are_op_errors):
    dev = index_errors_are_op_errors
    src = torch.arange(3.0, device=dev)
    a = torch.zeros(3, device=dev)
    b = torch.zeros(4, device=dev)
    idx = torch.zeros(1, dtype=torch.long, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        y = src[:1] + 10
        a.copy_(src * 2)            # an overwrite: shares its segment with the next write
        b.index_copy_(0, idx, y)    # fails on the replay below; the segment re-runs op by op
    idx.fill_(99)
    src.add_(1)
    g.replay()
    assert a.cpu().tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(genie.RemoteExecutionError, match="index"):
        b.cpu()


def test_ops_reading_a_merged_write_then_a_failing_write_give_op_by_op_values(index_errors_are_op_errors):
    dev = index_errors_are_op_errors
    # Overwrites do not cut a segment: here every op is one traced segment. The last write fails
    # on the replay; the op-by-op re-run writes `a` again, and `d` is computed from it as before.
    src = torch.arange(3.0, device=dev)
    a, d = torch.zeros(3, device=dev), torch.zeros(3, device=dev)
    b = torch.zeros(4, device=dev)
    idx = torch.zeros(1, dtype=torch.long, device=dev)
    g = genie.Graph()
    with genie.graph(g):
        a.copy_(src * 2)
        c = a + 1                   # reads what the segment wrote
        d.copy_(c * c)
        b.index_copy_(0, idx, c[:1])
    idx.fill_(99)
    src.add_(1)
    before = _segments()
    g.replay()
    assert a.cpu().tolist() == [2.0, 4.0, 6.0]
    assert d.cpu().tolist() == [9.0, 25.0, 49.0]
    with pytest.raises(genie.RemoteExecutionError, match="index"):
        b.cpu()
    after = _segments()
    assert after["traced"] + after["reused"] == before["traced"] + before["reused"] + 1  # one segment


def test_a_failing_accumulating_write_lands_as_often_as_op_by_op(index_errors_are_op_errors):
    dev = index_errors_are_op_errors
    # index_add_ with one index out of range writes the valid part before it raises; replayed, it
    # must do that once, as op by op, not once more when its segment is re-run. The failed op
    # poisons `x`; `base` views the same memory and shows what landed.
    landed = []
    for replayed in (False, True):
        base = torch.zeros(4, device=dev)
        x = base[0:4]
        idx = torch.tensor([0, 1]).to(dev)
        src = torch.ones(2, device=dev)
        g = genie.Graph()
        with genie.graph(g):
            y = src * 2.0
            x.index_add_(0, idx, y)
        idx.copy_(torch.tensor([0, 99]))
        if replayed:
            g.replay()
        else:
            x.index_add_(0, idx, src * 2.0)  # the same ops, one by one
        with pytest.raises(genie.RemoteExecutionError, match="index"):
            x.cpu()
        landed.append(base.cpu().tolist())
    assert landed[0] == landed[1] == [4.0, 2.0, 0.0, 0.0], landed


def _train_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def _mlp():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


class _TwinTraining:
    """The same MLP and AdamW on the CPU and on the device (capturable there, as graphs need),
    after one warm-up step each (the optimizer makes its state outside any graph)."""

    def __init__(self, dev) -> None:
        self.local = _mlp()
        self.remote = copy.deepcopy(self.local).to(dev)
        self.x, self.y = torch.randn(6, 8), torch.randint(0, 3, (6,))
        self.xr, self.yr = self.x.to(dev), self.y.to(dev)
        self.opt_local = torch.optim.AdamW(self.local.parameters(), lr=0.05)
        self.opt_remote = torch.optim.AdamW(self.remote.parameters(), lr=0.05, capturable=True)
        self.local_step()
        self.remote_step()

    def local_step(self) -> float:
        return _train_step(self.local, self.opt_local, self.x, self.y).item()

    def remote_step(self) -> torch.Tensor:
        return _train_step(self.remote, self.opt_remote, self.xr, self.yr)

    def assert_same(self, got: list[float], expected: list[float]) -> None:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        for a, b in zip(self.local.parameters(), self.remote.parameters()):
            torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-4, atol=1e-5)


def test_a_training_step_with_a_capturable_optimizer_replays_like_eager(dev):
    twins = _TwinTraining(dev)
    loss = torch.zeros((), device=dev)
    g = genie.Graph()
    with genie.graph(g):
        loss.copy_(twins.remote_step())  # step 2, recorded
    expected = [twins.local_step() for _ in range(6)]  # steps 2-7
    got = [loss.item()]
    for _ in range(5):
        g.replay()
        got.append(loss.item())
    twins.assert_same(got, expected)


def test_a_write_into_a_cpu_tensor_while_recording_is_refused(dev):
    remote = _mlp().to(dev)
    x, y = torch.randn(6, 8, device=dev), torch.randint(0, 3, (6,)).to(dev)
    optimizer = torch.optim.AdamW(remote.parameters(), lr=0.05)  # step counts on the CPU
    _train_step(remote, optimizer, x, y)
    with pytest.raises(genie.GenieError, match="capturable=True"):
        with genie.graph(genie.Graph()):
            _train_step(remote, optimizer, x, y)  # its CPU step count += 1 would never replay
    counter = torch.zeros(())
    with pytest.raises(genie.GenieError, match=r"aten::add_.* writes into a tensor on cpu"):
        with genie.graph(genie.Graph()):
            x.mul_(1.0)
            counter.add_(1)
    assert (x.sum() * 0 + 1).item() == 1.0  # the device works on after a refused recording


def test_a_replay_runs_under_the_settings_it_was_recorded_under(dev):
    """As a CUDA graph keeps the kernels chosen at capture: a step recorded under float32 matmul
    precision "medium" replays under it after the program set "highest" again (it ran under
    whatever was in force at each replay), and a setting changed inside the block is refused."""
    from genie.transport import numerics

    torch.manual_seed(0)
    a, b = torch.randn(128, 256), torch.randn(256, 64)
    ra, rb = a.to(dev), b.to(dev)
    out = torch.zeros(128, 64, device=dev)
    try:
        torch.set_float32_matmul_precision("medium")
        want = a @ b
        g = genie.Graph()
        with genie.graph(g):
            out.copy_(ra @ rb)
        torch.set_float32_matmul_precision("highest")
        if torch.equal(want, a @ b):
            pytest.skip("this CPU computes float32 matmuls the same at every precision")
        out.zero_()
        g.replay()
        assert torch.equal(out.cpu(), want)
        assert torch.equal((ra @ rb).cpu(), a @ b)  # ops outside the replay: the settings of now
        with pytest.raises(genie.GenieError, match="changed inside the genie.graph block"):
            with genie.graph(genie.Graph()):
                out.copy_(ra @ rb)
                torch.set_float32_matmul_precision("medium")
                out.add_(ra @ rb)
    finally:
        numerics.apply(numerics.DEFAULT)


needs_accelerator_graph = pytest.mark.skipif(not hasattr(torch.accelerator, "Graph"),
                                             reason="torch.accelerator.Graph needs PyTorch >= 2.13")


@needs_accelerator_graph
def test_torch_accelerator_graph_captures_without_running_then_replays(dev, tmp_path):
    """torch.accelerator.Graph, as on CUDA: the capture runs nothing (the block's writes and
    results appear at the first replay), each replay runs it once."""
    x = torch.zeros(4, device=dev)
    w = torch.full((4,), 2.0, device=dev)
    g = torch.accelerator.Graph()
    g.enable_debug_mode()
    with g:
        x += w
        y = x * 3
    assert x.cpu().tolist() == [0.0] * 4
    with pytest.raises(Exception, match="inside a torch.accelerator.Graph capture, which runs nothing"):
        y.cpu()  # made by the block: it exists from the first replay on (a CUDA graph's holds garbage)
    g.replay()
    assert x.cpu().tolist() == [2.0] * 4 and y.cpu().tolist() == [6.0] * 4
    g.replay()
    g.replay()
    assert x.cpu().tolist() == [6.0] * 4 and y.cpu().tolist() == [18.0] * 4
    g.debug_dump(str(tmp_path / "ops.txt"))
    assert (tmp_path / "ops.txt").read_text().split() == ["aten::add_.Tensor", "aten::mul.Tensor"]
    assert g.pool() != torch.accelerator.Graph().pool()
    with pytest.raises(RuntimeError, match="already holds a capture"):
        g.capture_begin()
    g.reset()
    with pytest.raises(RuntimeError, match="captured nothing"):
        g.replay()
    with g:  # reset: it may capture again
        x.mul_(0.5)
    g.replay()
    assert x.cpu().tolist() == [3.0] * 4


@needs_accelerator_graph
def test_a_training_step_captured_with_torch_accelerator_graph_replays_like_eager(dev):
    twins = _TwinTraining(dev)
    loss = torch.zeros((), device=dev)
    g = torch.accelerator.Graph()
    with torch.Stream(device="remote_accelerator"), g:
        loss.copy_(twins.remote_step())  # captured, not run
    expected = [twins.local_step() for _ in range(5)]  # steps 2-6
    got = []
    for _ in range(5):
        g.replay()
        got.append(loss.item())
    twins.assert_same(got, expected)


@needs_accelerator_graph
def test_an_empty_torch_accelerator_graph_capture_warns_and_replays_nothing(dev, tmp_path):
    """As a CUDA graph's: torch's __exit__ ends the capture whatever happened in the block, so an
    error there, when nothing was recorded yet, must reach the program as itself (a Ctrl-C as a
    KeyboardInterrupt, found by scripts/interrupt_fuzz.py), not as "recorded no remote ops"."""
    x = torch.ones(4, device=dev)
    g = torch.accelerator.Graph()
    g.enable_debug_mode()
    with pytest.warns(UserWarning, match="captured no remote_accelerator ops"):
        with pytest.raises(KeyboardInterrupt):
            with g:
                raise KeyboardInterrupt
    g.replay()  # nothing
    g.debug_dump(str(tmp_path / "ops.txt"))
    assert (tmp_path / "ops.txt").read_text() == ""
    assert x.cpu().tolist() == [1.0] * 4
    g.reset()
    with g:  # it may capture again
        x.add_(1)
    g.replay()
    assert x.cpu().tolist() == [2.0] * 4


@needs_accelerator_graph
def test_an_exception_in_a_graph_hook_reaches_the_program_as_itself(dev):
    """Genie's C++ graph calls into Python; what that raises comes back to the program with its own
    type (a python_error, restored by torch's bindings), not as a RuntimeError with its text: a
    Ctrl-C as a capture begins was a RuntimeError with an empty message."""
    from genie.frontend import graphs, native_guard

    def hook(action, state, path):
        if action == "begin":
            raise KeyboardInterrupt
        if action == "replay":
            raise LookupError("from the hook")
        return graphs._accelerator_graph(action, state, path)

    x = torch.ones(4, device=dev)
    g = torch.accelerator.Graph()
    native_guard.set_graph_hook(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            g.capture_begin()
        native_guard.set_graph_hook(graphs._accelerator_graph)
        with g:
            x.add_(1)
        native_guard.set_graph_hook(hook)
        with pytest.raises(LookupError, match="from the hook"):
            g.replay()
    finally:
        native_guard.set_graph_hook(graphs._accelerator_graph)
    g.replay()
    assert x.cpu().tolist() == [2.0] * 4


def _in_another_thread(work, started, done, errors):
    """Run `work` on a thread once `started` is set, then set `done`; what it raises goes to `errors`."""
    import threading

    def run():
        try:
            started.wait(10)
            work()
        except BaseException as e:  # noqa: B902 -- reported by the test
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("kind", ["genie.graph", "torch.accelerator.Graph"])
def test_a_recording_takes_only_its_own_threads_ops(dev, kind):
    """Another thread's work on the device while a block records runs as usual, is not recorded
    and is not run again by replays (as a CUDA capture in its thread-local mode). Before, its ops
    went into the recording: replays repeated them, and its reads failed as reads in a block."""
    import threading

    if kind == "torch.accelerator.Graph" and not hasattr(torch.accelerator, "Graph"):
        pytest.skip("torch.accelerator.Graph needs torch >= 2.13")
    x, y = torch.zeros(4, device=dev), torch.zeros(4, device=dev)
    big = torch.arange(300_000, dtype=torch.float32)  # large enough for the bulk lane
    read = []

    def other_work():
        y.add_(1)
        read.append(y[0].item())  # a read: refused inside a recording, not here
        read.append(torch.equal((big.to(dev) * 2).cpu(), big * 2))
        y.mul_(torch.tensor(3.0))  # an op with an inline payload

    started, done, errors = threading.Event(), threading.Event(), []
    t = _in_another_thread(other_work, started, done, errors)
    g = genie.Graph() if kind == "genie.graph" else torch.accelerator.Graph()
    with torch.no_grad(), (genie.graph(g) if kind == "genie.graph" else g):
        x.add_(1)
        started.set()
        assert done.wait(20)
        x.add_(1)
    t.join(10)
    assert not errors, errors
    assert read == [1.0, True]
    g.replay()
    g.replay()
    ran = 3 if kind == "genie.graph" else 2  # a torch.accelerator.Graph capture runs nothing
    assert x.cpu().tolist() == [2.0 * ran] * 4
    assert y.cpu().tolist() == [3.0] * 4  # once, when the thread ran it


def test_a_recorded_backward_is_recorded_and_another_threads_is_not(dev):
    """A block's backward runs on autograd's own thread for the device (PyTorch carries the
    block's dispatch modes over to it), and is recorded; another thread's backward afterwards
    runs on that same engine thread and is not."""
    import threading

    torch.manual_seed(0)
    mine, theirs = torch.nn.Linear(4, 2).to(dev), torch.nn.Linear(4, 2).to(dev)
    x = torch.randn(3, 4).to(dev)
    their_grad = []

    def other_work():
        theirs(x).sum().backward()
        their_grad.append(theirs.weight.grad.cpu())

    started, done, errors = threading.Event(), threading.Event(), []
    t = _in_another_thread(other_work, started, done, errors)
    mine(x).sum().backward()  # .grads exist: a backward run again by a replay accumulates into them
    theirs(x).sum().backward()
    once = mine.weight.grad.cpu()
    g = genie.Graph()
    with genie.graph(g):
        mine(x).sum().backward()
        started.set()
        assert done.wait(20)
    t.join(10)
    assert not errors, errors
    g.replay()
    g.replay()
    torch.testing.assert_close(mine.weight.grad.cpu(), once * 4)
    torch.testing.assert_close(theirs.weight.grad.cpu(), their_grad[0])  # not run again
    torch.testing.assert_close(their_grad[0], 2 * x.cpu().sum(0).expand(2, 4))


def test_one_block_records_at_a_time_per_device(dev):
    """A block inside a block is refused; so is a block on another thread while one records (it
    says so), and once the first ends the other thread records as usual."""
    import threading

    x = torch.zeros(2, device=dev)
    with genie.graph(genie.Graph()):
        x.add_(1)
        with pytest.raises(genie.GenieError, match="cannot be nested"):
            with genie.graph(genie.Graph()):
                pass
        refused = []
        t = threading.Thread(target=lambda: refused.append(_record_in_thread(x)))
        t.start()
        t.join(20)
    assert len(refused) == 1 and "another thread is recording a block" in refused[0]
    got = []
    t = threading.Thread(target=lambda: got.append(_record_in_thread(x)))
    t.start()
    t.join(20)
    assert got == ["recorded"]
    assert x.cpu().tolist() == [3.0, 3.0]  # the first block, then the thread's twice (run, replay)


def _record_in_thread(x) -> str:
    try:
        g = genie.Graph()
        with genie.graph(g):
            x.add_(1)
        g.replay()
        return "recorded"
    except genie.GenieError as e:
        return str(e)


def _daemon_holds() -> tuple[int, int]:
    """(handles, bytes allocated) the daemon holds for this client, once queued work has run."""
    torch.remote_accelerator.synchronize()
    body = genie.get_runtime().links[0].request("stats", {"dev": 0}).body
    return body["handles"], body["allocated"]


def test_tensors_dropped_during_a_recording_leave_the_daemon(dev):
    """A tensor made before a torch.accelerator.Graph capture and dropped during it is freed on the
    daemon at once, replayed or not (the capture kept every free for its replays: 1 MB stayed per
    capture never replayed). A tensor the block made and dropped is freed after each replay,
    also when its free went in a batch of its own (the program dropped frees alone, and the
    replays kept the tensor)."""
    if not hasattr(torch.accelerator, "Graph"):
        pytest.skip("torch.accelerator.Graph needs torch >= 2.13")
    x = torch.ones(1000, device=dev)
    before = _daemon_holds()
    for _ in range(3):
        t = torch.ones(250_000, device=dev)
        ag = torch.accelerator.Graph()
        with ag:
            y = x * 2
            del t
            gc.collect()
        del ag, y
        gc.collect()
    assert _daemon_holds() == before
    g = genie.Graph()
    with genie.graph(g):
        y = x * 2
        temp = y + 1  # made by the block, dropped in it, its free taken alone
        torch.remote_accelerator.synchronize()
        del temp
        gc.collect()
        torch.remote_accelerator.synchronize()
        z = y * 3
    for _ in range(3):
        g.replay()
    assert _daemon_holds()[0] == before[0] + 2  # y and z: the temporary is freed after each replay
    assert z.cpu().tolist()[:2] == [6.0, 6.0]
