"""Cutting recorded programs into traced segments (daemon/fused.py), without a daemon."""
from __future__ import annotations

import torch

from daemon import fused


def _run(seg, regs, interpret):
    """What a replay does with one segment: TorchScript when traced, else op by op."""
    if not fused.run_traced(seg, regs, interpret):
        interpret(regs)
        fused.drop(seg, regs)


def _plan_with_overwrites(steps, kept):
    # A step here: (reads, writes, writes in place, name, overwritten register or None); an
    # in-place write targets its first read register.
    return fused.plan_segments(steps, lambda s: s[0], lambda s: s[1], lambda s: [s[0][0]] if s[2] else [],
                               lambda s: s[3], kept, lambda s: s[4])


def test_segments_end_around_each_accumulating_write_and_carry_only_what_crosses():
    steps = [
        ([0], [1], False, "a", None),     # r1 = f(r0)
        ([1], [2], False, "b", None),     # r2 = g(r1)
        ([3, 2], [], True, "c", None),    # r3.add_(r2): runs alone
        ([1], [4], False, "d", None),     # r4 = h(r1): r1 crosses both cuts
        ([4], [5], False, "e", None),
    ]
    first, alone, last = _plan_with_overwrites(steps, kept={5})
    assert [(s.start, s.stop) for s in (first, alone, last)] == [(0, 2), (2, 3), (3, 5)]
    assert first.inputs == [0] and first.outputs == [1, 2]        # r1 and r2 are read later
    assert alone.inputs == [3, 2] and alone.fn is fused.INTERPRET
    assert last.inputs == [1] and last.outputs == [5]             # r4 is internal, r5 is live
    assert 0 in first.drop and 2 in alone.drop and 1 in last.drop and 4 in last.drop
    assert first.key != last.key


def test_one_op_segments_are_interpreted_and_the_key_follows_the_steps():
    def steps(name):
        return [([0], [], True, "w1", None), ([0], [1], False, name, None), ([1], [2], False, "b", None),
                ([3, 2], [], True, "w2", None)]
    single, pair, tail = _plan_with_overwrites(steps("a"), kept=set())
    assert single.fn is fused.INTERPRET and pair.fn is None and tail.fn is fused.INTERPRET
    assert _plan_with_overwrites(steps("a"), kept=set())[1].key == pair.key
    assert _plan_with_overwrites(steps("A"), kept=set())[1].key != pair.key


def test_a_traced_segment_runs_the_recorded_ops_and_is_traced_once():
    calls = []

    def interpret(regs):
        calls.append(1)
        regs[2] = torch.ops.aten.mul.Tensor(regs[0], regs[1])
        regs[3] = torch.ops.aten.add.Tensor(regs[2], 1.5)
        return regs[3]

    seg = fused.Segment(0, 2, inputs=[0, 1], outputs=[3], drop=[2], key=("unit-test", id(interpret)))
    regs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), None, None]
    _run(seg, regs, interpret)
    assert seg.fn is not fused.INTERPRET and calls == [1]  # traced once, on meta tensors
    torch.testing.assert_close(regs[3], torch.tensor([4.5, 9.5]))
    regs[0] = torch.tensor([2.0, 2.0])
    _run(seg, regs, interpret)
    assert calls == [1]  # the second run is the traced function's alone
    torch.testing.assert_close(regs[3], torch.tensor([7.5, 9.5]))
    assert regs[2] is None


def test_a_segment_traced_with_one_tensor_twice_is_interpreted_when_they_differ():
    def interpret(regs):
        regs[2] = torch.ops.aten.sub.Tensor(regs[0], regs[1])
        regs[3] = torch.ops.aten.abs.default(regs[2])
        return regs[3]

    seg = fused.Segment(0, 2, inputs=[0, 1], outputs=[3], drop=[], key=("unit-test-same", id(interpret)))
    t = torch.tensor([1.0, -2.0])
    regs = [t, t, None, None]
    _run(seg, regs, interpret)
    assert seg.same_inputs == [(0, 1)]
    torch.testing.assert_close(regs[3], torch.zeros(2))
    regs = [t, torch.zeros(2), None, None]
    _run(seg, regs, interpret)
    torch.testing.assert_close(regs[3], torch.tensor([1.0, 2.0]))


def _recording_interpret(seen):
    def interpret(regs):
        seen.append((regs[0].device.type, float(regs[0].sum()) if regs[0].device.type != "meta" else None))
        regs[1] = torch.ops.aten.mul.Tensor(regs[0], 3.0)
        regs[2] = torch.ops.aten.sub.Tensor(regs[1], 1.0)
        return regs[2]
    return interpret


def test_tracing_never_touches_the_inputs_small_ones_get_zeros(monkeypatch):
    seen = []
    interpret = _recording_interpret(seen)
    seg = fused.Segment(0, 2, inputs=[0], outputs=[2], drop=[1], key=("unit-test-zeros", id(interpret)))
    regs = [torch.full((4,), 2.0), None, None]
    _run(seg, regs, interpret)
    assert seen == [("cpu", 0.0)]  # traced on zeros shaped like the input, not on its data
    torch.testing.assert_close(regs[2], torch.full((4,), 5.0))  # the real run: the traced function's


def test_large_inputs_are_traced_on_meta_tensors(monkeypatch):
    monkeypatch.setattr(fused, "ZEROS_MAX_BYTES", {})
    seen = []
    interpret = _recording_interpret(seen)
    seg = fused.Segment(0, 2, inputs=[0], outputs=[2], drop=[1], key=("unit-test-meta", id(interpret)))
    regs = [torch.full((4,), 2.0), None, None]
    _run(seg, regs, interpret)
    assert seen == [("meta", None)]
    torch.testing.assert_close(regs[2], torch.full((4,), 5.0))


def test_overwrites_do_not_cut_other_writes_run_alone_and_no_segment_reads_what_it_then_writes():
    steps = [
        ([0], [1], False, "k = f(x)", None),
        ([5, 1], [], True, "K.index_copy_(k)", 5),   # overwrites K, which nothing before read
        ([6, 0], [], True, "V.index_copy_(x)", 6),
        ([5, 6], [2], False, "attention(K, V)", None),  # reads what the segment wrote: the same on a re-run
        ([9, 2], [], True, "K2.index_copy_(a)", 9),  # the next layer's cache write
        ([9], [3], False, "attention(K2)", None),
        ([7, 3], [], True, "out.add_(a)", None),      # not an overwrite: reads its target
        ([8], [], True, "pos.add_(1)", None),
    ]
    segments = _plan_with_overwrites(steps, kept=set())
    assert [(s.start, s.stop) for s in segments] == [(0, 6), (6, 7), (7, 8)]
    assert segments[0].targets == [5, 6, 9]
    # add_ is no overwrite: it runs alone, interpreted, each time exactly once
    assert segments[1].fn is fused.INTERPRET and segments[2].fn is fused.INTERPRET
    read_first = [([5], [1], False, "k = g(K)", None), ([5, 1], [], True, "K.copy_(k)", 5),
                  ([6], [], True, "V.zero_()", 6)]
    # K is read before its write: the write starts a new segment (a half-done write must not be re-read)
    assert [(s.start, s.stop) for s in _plan_with_overwrites(read_first, kept=set())] == [(0, 1), (1, 3)]
    read_between = [([5, 0], [], True, "K.copy_(x)", 5), ([5], [1], False, "a = f(K)", None),
                    ([5, 1], [], True, "K.copy_(a)", 5)]
    # a second write into K, which the segment read since: a re-run would read the second write's values
    assert [(s.start, s.stop) for s in _plan_with_overwrites(read_between, kept=set())] == [(0, 2), (2, 3)]


def test_a_merged_overwrite_into_storage_another_input_shares_is_interpreted():
    def interpret(regs):
        regs[2] = torch.ops.aten.neg.default(regs[1])
        torch.ops.aten.copy_.default(regs[0], regs[2])
        return torch.ops.aten.fill_.Scalar(regs[3], 1.0)

    cache = torch.zeros(4)
    seg = fused.Segment(0, 3, inputs=[1, 0, 3], outputs=[], drop=[2], key=("unit-test-alias", id(interpret)))
    seg.targets = [0]
    regs = [cache[:2], cache[2:], None, torch.zeros(1)]  # the target and the source are views of one tensor
    _run(seg, regs, interpret)
    assert seg.fn is fused.INTERPRET
    regs2 = [torch.zeros(2), torch.ones(2), None, torch.zeros(1)]
    seg2 = fused.Segment(0, 3, inputs=[1, 0, 3], outputs=[], drop=[2], key=("unit-test-alias", id(interpret)))
    seg2.targets = [0]
    _run(seg2, regs2, interpret)
    assert seg2.fn is not fused.INTERPRET  # separate storage: traced


def test_every_thread_that_runs_a_segment_turns_graph_optimisation_off():
    # The switch is per thread: a segment traced on the worker and replayed on the event loop
    # must run there without the optimiser too (CSE could merge outputs the client keeps apart).
    import threading

    seg = fused.Segment(0, 2, inputs=[0], outputs=[2], drop=[1], key=("unit-test-threads",))
    interpret = _recording_interpret([])
    _run(seg, [torch.ones(3), None, None], interpret)
    seen = []

    def other_thread():
        regs = [torch.ones(3), None, None]
        _run(seg, regs, interpret)
        seen.append((torch._C._get_graph_executor_optimize(), regs[2]))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join(30)
    assert seen and seen[0][0] is False
    torch.testing.assert_close(seen[0][1], torch.full((3,), 2.0))
