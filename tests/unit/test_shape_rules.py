"""Direct output plans (genie/frontend/shape_rules.py) against meta execution, case by case.

A rule may decline (None: meta execution plans the op); where it answers, its plan must be the
one meta execution gives, and the daemon's kernel must lay its result out that way."""
from __future__ import annotations

import random

import pytest
import torch

from daemon import attention
from genie.frontend import meta, shape_rules
from meta_planning import meta_plan

CAT = torch.ops.aten.cat.default
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def rule(op):
    """The rule capture uses for `op`."""
    return shape_rules.RULES[id(op)]


def laid_out(rng: random.Random, shape: tuple, dtype=torch.float32) -> torch.Tensor:
    """A tensor of `shape` in one of several layouts: contiguous, permuted, sliced, expanded,
    channels-last."""
    kind = rng.choice(["contiguous", "contiguous", "permuted", "sliced", "expanded", "channels_last"])
    if kind == "permuted" and len(shape) > 1:
        order = list(range(len(shape)))
        rng.shuffle(order)
        base = torch.randn([shape[i] for i in order]).to(dtype)
        return base.permute([order.index(i) for i in range(len(shape))])
    if kind == "sliced" and shape:
        return torch.randn(*shape[:-1], shape[-1] * 2).to(dtype)[..., ::2]
    if kind == "expanded" and shape and shape[0] > 1:
        return torch.randn(1, *shape[1:]).to(dtype).expand(shape)
    if kind == "channels_last" and len(shape) == 4:
        return torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)
    return torch.randn(shape).to(dtype)


def check(func, planner, args, kwargs, kernel=None) -> bool:
    """True if the rule answered; then its plan must be meta execution's, and the CPU kernel's
    result (`kernel`, else the op itself: what a CPU daemon runs) laid out as planned."""
    try:
        expected = meta_plan(func, args, kwargs)
    except (RuntimeError, IndexError, ValueError, TypeError, meta.NeedsRemoteExecution):
        expected = None  # the op refuses these inputs: the rule must decline them
    got = planner(args, kwargs)
    if got is None:
        return False
    assert expected is not None, f"rule answered inputs the op refuses: {args} {kwargs}"
    assert got == expected, f"{got} != {expected}"
    assert got.outputs.meta_key == expected.outputs.meta_key
    with torch.no_grad():
        real = (kernel or func)(*args, **kwargs)
    planned = got.outputs
    assert (real.dtype, tuple(real.shape)) == (planned.dtype, planned.shape)
    # Strides of size-1 dimensions address nothing, and torch's meta and CPU kernels differ
    # there (a broadcast add: (1, 1) on the CPU, (3, 1) in meta): compared where they matter.
    assert [st for n, st in zip(real.shape, real.stride()) if n > 1] == \
        [st for n, st in zip(planned.shape, planned.stride) if n > 1]
    return True


def test_cat_rule_matches_meta_execution():
    rng = random.Random(0)
    answered = 0
    for _ in range(400):
        rank = rng.randint(1, 5)
        shape = [rng.randint(1, 4) for _ in range(rank)]
        dim = rng.randrange(-rank, rank)
        parts = []
        for _ in range(rng.randint(1, 3)):
            s = list(shape)
            s[dim] = rng.randint(0 if rng.random() < 0.05 else 1, 4)
            if rng.random() < 0.05:
                s = s[:-1] or [2]  # a rank that differs
            dtype = torch.float16 if rng.random() < 0.05 else torch.float32
            parts.append(laid_out(rng, tuple(s), dtype))
        answered += check(CAT, rule(CAT), (parts, dim) if rng.random() < 0.8 else (parts,), {})
    assert answered > 80  # the common case (contiguous parts) is answered without meta execution


def test_cat_rule_answers_a_growing_kv_cache():
    past, new = torch.randn(1, 4, 64, 48), torch.randn(1, 4, 1, 48)
    assert check(CAT, rule(CAT), ([past, new], -2), {})
    assert check(CAT, rule(CAT), ([past, new], 2), {})
    # The new key as models make it: split, view, transpose (strides (192, 48, 192, 1)).
    key = torch.randn(1, 1, 576).split(192, dim=-1)[1].view(1, 1, 4, 48).transpose(1, 2)
    assert check(CAT, rule(CAT), ([past, key], 2), {})
    assert check(CAT, rule(CAT), ([key, key], 2), {})


def test_sdpa_rule_matches_meta_execution_and_the_daemon_kernel():
    rng = random.Random(1)
    answered = grouped = 0
    for _ in range(300):
        b, h, lq, s, e, ev = (rng.randint(1, 3) for _ in range(6))
        if rng.random() < 0.1:
            s = rng.randint(1, 3)
        dtype = torch.float32
        gqa = rng.random() < 0.3
        if gqa:  # grouped-query attention: key/value heads divide the query's (or do not: declined)
            h = rng.choice([2, 4, 6])
            kh = rng.choice([d for d in (1, 2, 3) if h % d == 0] + ([4] if rng.random() < 0.2 else []))
        else:
            kh = h if rng.random() < 0.9 else 1
        q = laid_out(rng, (b, h, lq, e), dtype)
        k = laid_out(rng, (b, kh, s, e if rng.random() < 0.95 else e + 1), dtype)
        v = laid_out(rng, (b, k.shape[1], s, ev), dtype)
        kwargs = {}
        args = [q, k, v]
        mask_kind = rng.choice(["none", "none", "bool", "float", "bad"])
        if mask_kind != "none":
            mshape = [rng.choice([1, n]) for n in (b, h, lq, s)][rng.randint(0, 3):]
            if mask_kind == "bad":
                mshape = [n + 1 for n in mshape]
            mask = torch.rand(mshape) > 0.3 if mask_kind == "bool" else torch.randn(mshape)
            if mask_kind == "bool":
                mask[..., 0] = True  # every row attends to something: the math stays finite
            args.append(mask)
        elif rng.random() < 0.5:
            args.append(None)
        if rng.random() < 0.3:
            kwargs["is_causal"] = True
        if rng.random() < 0.3:
            kwargs["scale"] = 0.5
        if gqa or rng.random() < 0.2:
            kwargs["enable_gqa"] = gqa or rng.random() < 0.5
        args = tuple(args)
        did = check(SDPA, rule(SDPA), args, kwargs, attention.sdpa_contiguous)
        answered += did
        grouped += did and k.shape[1] != h
    assert answered > 80 and grouped > 10


def test_sdpa_rule_answers_a_decode_step_with_a_transposed_query():
    x = torch.randn(1, 1, 4, 48)  # (batch, length, heads, dim) as a model's view makes it
    q = x.transpose(1, 2)
    k = v = torch.randn(1, 65, 4, 48).transpose(1, 2)
    assert check(SDPA, rule(SDPA), (q, k, v), {}, attention.sdpa_contiguous)
    assert check(SDPA, rule(SDPA), (q, k, v, None, 0.0, False), {"scale": 0.1}, attention.sdpa_contiguous)


def random_shape(rng: random.Random, low: int = 0, high: int = 4) -> tuple:
    return tuple(rng.randint(1, 4) for _ in range(rng.randint(low, high)))


def random_dtype(rng: random.Random) -> torch.dtype:
    return rng.choice([torch.float32] * 6 + [torch.float16, torch.float64, torch.int64])


def tensor_of(rng: random.Random, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return laid_out(rng, shape, dtype)
    return laid_out(rng, shape).mul(3).to(dtype)


@pytest.mark.parametrize("name", ["gelu", "silu", "relu", "tanh", "sigmoid", "exp", "neg", "rsqrt", "sqrt", "abs"])
def test_unary_rules_match_meta_execution(name):
    rng = random.Random(name)
    op = getattr(torch.ops.aten, name).default
    answered = 0
    for _ in range(60):
        x = tensor_of(rng, random_shape(rng), random_dtype(rng))
        kwargs = {"approximate": "tanh"} if name == "gelu" and rng.random() < 0.3 else {}
        answered += check(op, rule(op), (x,), kwargs)
    assert answered > 15


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
def test_binary_rules_match_meta_execution(name):
    rng = random.Random(name)
    op = getattr(torch.ops.aten, name).Tensor
    answered = 0
    for _ in range(200):
        shape = random_shape(rng)
        x = tensor_of(rng, shape, random_dtype(rng))
        kind = rng.choice(["same", "broadcast", "bigger", "scalar", "bad"])
        if kind == "scalar":
            other = rng.choice([2, 0.5, True, -3])
        else:
            if kind == "same":
                oshape = shape
            elif kind == "broadcast":
                oshape = tuple(rng.choice([1, n]) for n in shape)[rng.randint(0, len(shape)):]
            elif kind == "bigger":
                oshape = random_shape(rng, 0, 2) + tuple(rng.choice([1, n]) for n in shape)
            else:
                oshape = tuple(n + 1 for n in shape) or (2,)
            other = tensor_of(rng, oshape, x.dtype if rng.random() < 0.85 else random_dtype(rng))
        kwargs = {"alpha": 2} if name in ("add", "sub") and rng.random() < 0.2 else {}
        args = (x, other) if rng.random() < 0.9 or not isinstance(other, torch.Tensor) else (other, x)
        answered += check(op, rule(op), args, kwargs)
    assert answered > 40


def test_linear_rule_matches_meta_execution():
    rng = random.Random(2)
    op = torch.ops.aten.linear.default
    answered = 0
    for _ in range(200):
        dtype = random_dtype(rng)
        fin, fout = rng.randint(1, 5), rng.randint(1, 5)
        x = tensor_of(rng, random_shape(rng, 0, 3) + (fin if rng.random() < 0.9 else fin + 1,), dtype)
        w = tensor_of(rng, (fout, fin), dtype if rng.random() < 0.9 else random_dtype(rng))
        b = rng.choice([None, tensor_of(rng, (fout,), dtype), tensor_of(rng, (1, fout), dtype)])
        args = (x, w, b) if b is not None or rng.random() < 0.5 else (x, w)
        answered += check(op, rule(op), args, {})
    assert answered > 8  # of 200 (15-27 with other seeds): it wants every operand plainly contiguous


def test_layer_norm_rule_matches_meta_execution():
    rng = random.Random(3)
    op = torch.ops.aten.layer_norm.default
    answered = 0
    for _ in range(200):
        dtype = random_dtype(rng)
        shape = random_shape(rng, 1, 4)
        normalized = list(shape[len(shape) - rng.randint(1, len(shape)):])
        if rng.random() < 0.1:
            normalized[0] += 1
        weight = tensor_of(rng, tuple(normalized), dtype) if rng.random() < 0.6 else None
        bias = tensor_of(rng, tuple(normalized), dtype) if rng.random() < 0.5 else None
        args = (tensor_of(rng, shape, dtype), normalized, weight, bias)
        answered += check(op, rule(op), args, {"eps": 1e-6} if rng.random() < 0.3 else {})
    assert answered > 30


def test_embedding_rule_matches_meta_execution():
    rng = random.Random(4)
    op = torch.ops.aten.embedding.default
    answered = 0
    for _ in range(100):
        rows, dim = rng.randint(1, 6), rng.randint(1, 5)
        weight = tensor_of(rng, (rows, dim), random_dtype(rng))
        index_dtype = rng.choice([torch.int64, torch.int64, torch.int32])
        indices = laid_out(rng, random_shape(rng, 0, 3)).abs().mul(rows).floor().clamp(max=rows - 1).to(index_dtype)
        answered += check(op, rule(op), (weight, indices), {})
    assert answered > 30


@pytest.mark.parametrize("name", ["add_.Tensor", "sub_.Tensor", "mul_.Tensor", "div_.Tensor", "addcdiv_.default",
                                  "addcmul_.default"])
def test_in_place_rules_match_meta_execution(name):
    rng = random.Random(name)
    packet, overload = name.split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    answered = 0
    for _ in range(150):
        shape = random_shape(rng)
        x = tensor_of(rng, shape, random_dtype(rng))

        def operand():
            if rng.random() < 0.2:
                return rng.choice([2, 0.5, -1.5])
            oshape = tuple(rng.choice([1, n]) for n in shape)[rng.randint(0, len(shape)):]
            if rng.random() < 0.1:
                oshape = (2,) + oshape  # grows the result: an in-place op refuses it
            return tensor_of(rng, oshape, x.dtype if rng.random() < 0.9 else random_dtype(rng)).abs() + 1

        if packet.startswith("addc"):
            args, kwargs = (x, operand(), operand()), ({"value": rng.choice([0.5, -2])} if rng.random() < 0.5 else {})
            if not all(isinstance(a, torch.Tensor) for a in args):
                continue
        else:
            args, kwargs = (x, operand()), ({"alpha": 3} if "add" in name and rng.random() < 0.2 else {})
        try:
            expected = meta_plan(op, args, kwargs)
        except (RuntimeError, IndexError, ValueError, TypeError, meta.NeedsRemoteExecution):
            expected = None
        got = rule(op)(args, kwargs)
        if got is None:
            continue
        assert got == expected
        with torch.no_grad():
            assert op(*args, **kwargs) is x  # the CPU kernel takes these inputs too
        answered += 1
    assert answered > 20


def _planned_outputs_match(plan, results):
    """Each planned output (a tuple) is the kernel's result: dtype, shape and contiguous strides,
    or None where the kernel gives none."""
    for planned, real in zip(plan.outputs, results):
        if isinstance(planned, meta.Value):
            assert planned.value is None and real is None
            continue
        assert (real.dtype, tuple(real.shape), tuple(real.stride())) == (planned.dtype, planned.shape, planned.stride)
        assert planned.storage_nbytes == real.numel() * real.element_size()


def test_fused_rnn_cell_rules_match_the_daemon_kernels_and_meta_execution():
    """torch's meta kernel for the LSTM cell fails without biases and the GRU cell ops have none:
    the rules plan them, and the CPU daemon's kernels (daemon/rnn_cells.py) give those layouts
    whatever the inputs' layouts. Where torch's meta kernel works (LSTM cell with biases) the
    plans are equal."""
    from daemon import rnn_cells

    lstm, gru = torch.ops.aten._thnn_fused_lstm_cell.default, torch.ops.aten._thnn_fused_gru_cell.default
    gru_backward = torch.ops.aten._thnn_fused_gru_cell_backward.default
    rng = random.Random(0)
    for _ in range(40):
        b, h, bias = rng.randint(1, 4), rng.randint(1, 6), rng.random() < 0.5
        biases = (laid_out(rng, (4 * h,)), laid_out(rng, (4 * h,))) if bias else (None, None)
        args = (laid_out(rng, (b, 4 * h)), laid_out(rng, (b, 4 * h)), laid_out(rng, (b, h)), *biases)
        plan = rule(lstm)(args, {})
        if not all(t is None or shape_rules._plain_dense(t) for t in biases):
            assert plan is None  # biases only as torch's layers hold them
            continue
        _planned_outputs_match(plan, rnn_cells.lstm_cell(*args))
        if bias:
            assert plan == meta_plan(lstm, args, {})
        biases = (torch.randn(3 * h), torch.randn(3 * h)) if bias else (None, None)
        args = (laid_out(rng, (b, 3 * h)), laid_out(rng, (b, 3 * h)), laid_out(rng, (b, h)), *biases)
        plan = rule(gru)(args, {})
        hy, workspace = rnn_cells.gru_cell(*args)
        _planned_outputs_match(plan, (hy, workspace))
        grad = laid_out(rng, (b, h))
        plan = rule(gru_backward)((grad, workspace, bias), {})
        _planned_outputs_match(plan, rnn_cells.gru_cell_backward(grad, workspace, bias))
    # Inputs that do not fit the op are declined (meta execution or the daemon then says why).
    assert rule(lstm)((torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 3)), {}) is None
    assert rule(gru)((torch.randn(2, 9), torch.randn(2, 6), torch.randn(2, 3)), {}) is None
    assert rule(lstm)((torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 2), torch.randn(8), None), {}) is None
    assert rule(gru_backward)((torch.randn(2, 3), torch.randn(2, 14), True), {}) is None


def test_layout_tests_match_torch_on_random_layouts():
    """The plain-int twins of torch's channels-last tests (cat's memory-format suggestion, and
    channels-last contiguity) answer as torch does, size-0, size-1 and broadcast dimensions included."""
    from torch._prims_common import are_strides_like_channels_last_or_false

    rng = random.Random(3)
    for _ in range(3000):
        rank = rng.choice([3, 4, 4, 5])
        shape = tuple(rng.choice([0, 1, 1, 2, 3]) if rng.random() < 0.1 else rng.choice([1, 2, 3, 4]) for _ in range(rank))
        kind = rng.choice(["strides", "layout"])
        if kind == "layout":
            t = laid_out(rng, shape) if 0 not in shape else torch.empty(shape)
            if rank == 4 and rng.random() < 0.3:
                t = t.contiguous(memory_format=torch.channels_last)
            if rank == 5 and rng.random() < 0.3:
                t = t.contiguous(memory_format=torch.channels_last_3d)
            stride = t.stride()
        else:
            stride = tuple(rng.choice([0, 1, 2, 3, 4, 6, 8, 12, 24]) for _ in range(rank))
        assert shape_rules.strides_like_channels_last(shape, stride) == \
            are_strides_like_channels_last_or_false(shape, stride), (shape, stride)
        if rank in (4, 5):
            probe = torch.empty_strided(shape, stride, device="meta")
            fmt = torch.channels_last if rank == 4 else torch.channels_last_3d
            assert shape_rules.channels_last_contiguous(shape, stride) == probe.is_contiguous(memory_format=fmt), \
                (shape, stride)


def test_sync_batch_norm_rules_match_the_daemon_kernels():
    """nn.SyncBatchNorm's ops have no meta kernel in torch: the rules plan them (no round trip per
    op), and the CPU daemon's kernels (daemon/sync_batch_norm.py) give those layouts whatever the
    input's layout, channels-last included."""
    from daemon import sync_batch_norm as sbn

    aten = torch.ops.aten
    alone = lambda plan: meta.Plan((plan.outputs,), ())  # noqa: E731 (a one-output plan as a tuple)
    rng = random.Random(0)
    for _ in range(60):
        shape = rng.choice([(rng.randint(1, 4), rng.randint(1, 5)), (rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 5)),
                            tuple(rng.randint(1, 4) for _ in range(4))])
        dtype = rng.choice([torch.float32, torch.float64, torch.float16])
        x, grad = laid_out(rng, shape, dtype), laid_out(rng, shape, dtype)
        c = shape[1]
        stats = sbn.stats(x, 1e-5)
        _planned_outputs_match(rule(aten.batch_norm_stats.default)((x, 1e-5), {}), stats)
        mean, invstd = stats
        world = (mean.repeat(2, 1), invstd.repeat(2, 1))
        gathered = sbn.gather_stats_with_counts(x, *world, None, None, 0.1, 1e-5, torch.tensor([3.0, 4.0]))
        _planned_outputs_match(rule(aten.batch_norm_gather_stats_with_counts.default)(
            (x, *world, None, None, 0.1, 1e-5, torch.tensor([3.0, 4.0])), {}), gathered)
        weight = rng.choice([None, torch.randn(c).to(dtype)])
        args = (x, weight, None, mean, invstd, 1e-5)
        _planned_outputs_match(alone(rule(aten.batch_norm_elemt.default)(args, {})), [sbn.elemt(*args)])
        flags = tuple(rng.random() < 0.5 for _ in range(3))
        flags = flags if weight is not None else (flags[0], False, False)
        args = (grad, x, mean, invstd, weight, *flags)
        reduced = sbn.backward_reduce(*args)
        _planned_outputs_match(rule(aten.batch_norm_backward_reduce.default)(args, {}), reduced)
        sums = sbn.backward_reduce(grad, x, mean, invstd, weight, True, False, False)[:2]
        args = (grad, x, mean, invstd, weight, *sums, torch.tensor([5, 6], dtype=torch.int32))
        _planned_outputs_match(alone(rule(aten.batch_norm_backward_elemt.default)(args, {})), [sbn.backward_elemt(*args)])
    # Inputs that do not fit are declined (the daemon then says why).
    assert rule(aten.batch_norm_stats.default)((torch.randn(3), 1e-5), {}) is None
    assert rule(aten.batch_norm_elemt.default)((torch.randn(2, 3), None, None, torch.randn(4), torch.randn(4), 1e-5), {}) is None
