"""Random programs of views, in-place writes and ordinary ops, run on the CPU and on the device
side by side: every tensor, views of views included, ends with the CPU's values, shape and
conjugate / negative bits; and random programs under autograd end with the CPU's loss and leaf
gradients, or both refuse the backward (a write into a tensor it needs). Real and complex
tensors (conj, real, imag, mH views of them); seeded, so a failure names the seed and its steps.
Against a daemon on a CUDA GPU, in a process that has that GPU too (scripts/gpu_node_check.sh),
the reference side runs on the local GPU: CUDA's kernels, not the CPU's, are what it should equal."""
from __future__ import annotations

import random

import pytest
import torch

SEEDS = range(300)


def _views(rng, t):
    """(name, function) of a view `t` can have, or None."""
    options = ["unsqueeze", "expand", "narrow", "select", "slice_step"] if t.dim() else ["unsqueeze", "expand"]
    if t.dim() >= 2:
        options += ["transpose", "diagonal", "permute"]
    if t.is_contiguous():
        options.append("flatten")
    if t.dim() and t.shape[-1] >= 2:
        options.append("unfold")
    if t.is_complex():
        options += ["conj", "real", "imag"] + (["mH"] if t.dim() >= 2 else [])
    name = rng.choice(options)
    d = rng.randrange(t.dim()) if t.dim() else 0
    if name in ("narrow", "select") and t.shape[d] == 0:
        return None
    if name == "narrow":
        start = rng.randrange(t.shape[d])
        length = rng.randrange(t.shape[d] - start + 1)
        return name, lambda x: x.narrow(d, start, length)
    if name == "select":
        k = rng.randrange(t.shape[d])
        return name, lambda x: x.select(d, k)
    if name == "transpose":
        a, b = rng.sample(range(t.dim()), 2)
        return name, lambda x: x.transpose(a, b)
    if name == "permute":
        order = list(range(t.dim()))
        rng.shuffle(order)
        return name, lambda x: x.permute(*order)
    if name == "unsqueeze":
        at = rng.randrange(t.dim() + 1)
        return name, lambda x: x.unsqueeze(at)
    if name == "slice_step":
        return name, lambda x: x[(slice(None),) * d + (slice(None, None, 2),)]
    return name, {
        "expand": lambda x: x.unsqueeze(0).expand(2, *x.shape), "diagonal": lambda x: x.diagonal(),
        "flatten": lambda x: x.view(-1), "unfold": lambda x: x.unfold(-1, 2, 1), "conj": lambda x: x.conj(),
        "real": lambda x: x.real, "imag": lambda x: x.imag, "mH": lambda x: x.mH,
    }[name]


def _writes(rng, t, pairs):
    """(name, function) of an in-place write into `t`, or None where torch refuses one."""
    if any(n == 0 for n in t.shape) or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return None  # empty, or expanded (several elements share memory: torch refuses writes)
    value = round(rng.uniform(-2, 2), 2)
    name = rng.choice(["add_", "mul_", "fill_", "zero_", "neg_", "copy_", "masked_fill_", "setitem", "addcmul_"]
                      + (["clamp_"] if not t.is_complex() else []) + (["t_"] if t.dim() == 2 else []))
    if name == "copy_":
        same = [k for k, (c, _) in enumerate(pairs) if c.shape == t.shape and c.dtype == t.dtype]
        k = rng.choice(same)
        return name, lambda x: x.copy_(pairs[k][1] if x.device.type == "remote_accelerator" else pairs[k][0])
    if name == "setitem":
        if not t.dim():
            return None
        row = rng.randrange(t.shape[0])

        def setitem(x):
            x[row] = value
            return x
        return name, setitem
    return name, {
        "add_": lambda x: x.add_(value), "mul_": lambda x: x.mul_(value), "fill_": lambda x: x.fill_(value),
        "zero_": lambda x: x.zero_(), "neg_": lambda x: x.neg_(), "clamp_": lambda x: x.clamp_(-0.5, 0.5),
        "masked_fill_": lambda x: x.masked_fill_((x.abs() if x.is_complex() else x) > 0.5, value),
        "addcmul_": lambda x: x.addcmul_(x, x, value=0.5), "t_": lambda x: x.t_(),
    }[name]


def _computes(rng, t):
    name = rng.choice(["add", "mul", "sum", "clone", "contiguous", "exp", "cat", "reshape"]
                      + (["matmul"] if t.dim() == 2 else []))
    if name == "sum" and not t.dim():
        return None
    d = rng.randrange(t.dim()) if t.dim() else 0
    return name, {
        "add": lambda x: x + 1, "mul": lambda x: x * x, "sum": lambda x: x.sum(d), "clone": lambda x: x.clone(),
        "contiguous": lambda x: x.contiguous(), "exp": lambda x: (x * 0.3).exp(), "reshape": lambda x: x.reshape(-1),
        "cat": lambda x: torch.cat([x, x]) if x.dim() else x.reshape(1), "matmul": lambda x: x @ x.transpose(0, 1),
    }[name]


def _play(rng, pairs: list, steps: int, choose) -> list[str]:
    """`steps` random steps on both sides: `choose(rng, cpu_tensor, pairs)` gives (name, function)
    or None; a view's or an op's result joins `pairs`. Stops where the CPU refuses a step (e.g. a
    write whose operands overlap). The steps taken, by tensor index and name."""
    taken = []
    for _ in range(steps):
        k = rng.randrange(len(pairs))
        c, r = pairs[k]
        chosen = choose(rng, c, pairs)
        if chosen is None:
            continue
        name, fn = chosen
        taken.append(f"{k}.{name}")
        try:
            out_c = fn(c)
        except RuntimeError:
            taken.append("(refused on the CPU)")
            break
        out_r = fn(r)
        if not (name.endswith("_") or name == "setitem"):  # writes return the tensor written
            pairs.append((out_c, out_r))
    return taken


def run_program(seed: int, dev, steps: int = 40, ref: str = "cpu"):
    """The program of `seed`, run on both sides; its steps, and the pairs (reference, remote) it made."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = torch.complex64 if seed % 2 else torch.float32
    cpu = [torch.randn(4, 6, dtype=dtype), torch.randn(6, 4, dtype=dtype), torch.randn(2, 3, 4, dtype=dtype)]
    pairs = [(c.to(ref), c.to(dev)) for c in cpu]
    def choose(rng, c, pairs):
        draw = rng.random()
        return _views(rng, c) if draw < 0.4 else _writes(rng, c, pairs) if draw < 0.8 else _computes(rng, c)

    taken = _play(rng, pairs, steps, choose)
    return taken, pairs


@pytest.mark.parametrize("chunk", range(0, len(SEEDS), 50))
def test_random_view_and_write_programs_match_cpu(dev, reference, chunk):
    failures = []
    for seed in SEEDS[chunk:chunk + 50]:
        taken, pairs = run_program(seed, dev, ref=reference)
        for k, (c, r) in enumerate(pairs):
            got, want = r.cpu(), c.resolve_conj().resolve_neg().cpu()
            if (c.shape != got.shape or (c.is_conj(), c.is_neg()) != (r.is_conj(), r.is_neg())
                    or not torch.allclose(want, got, atol=1e-3, rtol=1e-3, equal_nan=True)):
                diff = ((want - got).abs().max().item() if want.shape == got.shape and want.numel() else "-")
                failures.append(f"seed {seed}, tensor {k} (largest difference {diff}): {' '.join(taken)}")
                break
    assert not failures, "\n".join(failures)


def _autograd_start(seed: int, place) -> tuple:
    """The rng, the (cpu, remote) pairs of an autograd program (its leaves that require grad, to
    which the program adds), and a list of the leaves; `place(rng)`: each remote leaf's device."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = torch.complex64 if seed % 2 else torch.float32
    leaves = [torch.randn(4, 6, dtype=dtype, requires_grad=True), torch.randn(2, 3, 4, dtype=dtype, requires_grad=True)]
    pairs = [(c, c.detach().to(place(rng)).requires_grad_()) for c in leaves]
    return rng, pairs, list(pairs)


def _write_into_non_leaf(rng, c):
    if c.is_leaf or (c._base is not None and c._base.is_leaf) or c.numel() == 0 or any(
            st == 0 and n > 1 for st, n in zip(c.stride(), c.shape)):
        return None  # torch refuses in-place writes into leaves and their views, and into expanded tensors
    value = round(rng.uniform(-2, 2), 2)
    return rng.choice([("mul_", lambda x: x.mul_(value)), ("add_", lambda x: x.add_(value))])


def _backward_outcome(losses: list, leaves: list) -> tuple[bool, list]:
    """Run both losses' backward: whether the two sides agree (the same refusal, or equal losses
    and leaf gradients), and what each refused (None: ran)."""
    refused = []
    for loss in losses:
        try:
            loss.backward()
            refused.append(None)
        except RuntimeError as e:
            refused.append("modified by an inplace operation" in str(e) or str(e))
    same = refused[0] == refused[1] and torch.allclose(losses[0].detach(), losses[1].detach().cpu(), atol=1e-3,
                                                       rtol=1e-3, equal_nan=True)
    if same and refused[0] is None:
        same = all((c.grad is None) == (r.grad is None) and (c.grad is None or torch.allclose(
            c.grad, r.grad.cpu(), atol=1e-3, rtol=1e-3, equal_nan=True)) for c, r in leaves)
    return same, refused


def run_autograd_program(seed: int, dev, steps: int = 30):
    """Leaves that require grad, random views, ops and in-place writes on non-leaves, one loss:
    its steps, the losses and the leaves (cpu, remote). A write into a tensor the backward needs
    makes both sides' backward refuse (version counters), which is part of what is compared."""
    rng, pairs, leaves = _autograd_start(seed, lambda rng: dev)

    def choose(rng, c, pairs):
        draw = rng.random()
        return _views(rng, c) if draw < 0.45 else _computes(rng, c) if draw < 0.9 else _write_into_non_leaf(rng, c)

    taken = _play(rng, pairs, steps, choose)
    losses = [sum((t.real if t.is_complex() else t).sum() * (i + 1) * 0.01 for i, t in enumerate(side))
              for side in zip(*pairs)]
    return taken, losses, leaves


@pytest.mark.parametrize("chunk", range(0, 200, 50))
def test_random_autograd_programs_match_cpu(dev, reference, chunk):
    failures = []
    # Against a CUDA daemon the reference loss is this process's GPU's (CUDA's kernels); gradients
    # are the CPU's, compared where the two forwards agree: a local CUDA backward is not possible in
    # a process that imports genie (pytorch/pytorch#161129, README: local CUDA autograd).
    on_cuda = reference == "cuda"
    for seed in range(chunk, chunk + 50):
        taken, (loss_c, loss_r), leaves = run_autograd_program(seed, dev)
        if on_cuda:
            _, (_, loss_g), _ = run_autograd_program(seed, "cuda")
            if not torch.allclose(loss_c.detach(), loss_g.detach().cpu(), atol=1e-3, rtol=1e-3, equal_nan=True):
                if not torch.allclose(loss_g.detach().cpu(), loss_r.detach().cpu(), atol=1e-3, rtol=1e-3,
                                      equal_nan=True):
                    failures.append(f"seed {seed} (loss, against local CUDA): {' '.join(taken)}")
                continue
        same, refused = _backward_outcome([loss_c, loss_r], leaves)
        if not same:
            failures.append(f"seed {seed} ({refused}): {' '.join(taken)}")
    assert not failures, "\n".join(failures)


TWO_DEVICES = ["remote_accelerator:0", "remote_accelerator:1"]


def _moves(rng, t, pairs):
    """(name, function) of a `.to()` of `t`: to the other daemon's device, its own, or the CPU and
    back, maybe with another dtype or memory format. The reference side makes what PyTorch's
    `.to()` makes between two devices: the tensor itself where nothing has to change, else a copy
    (conjugation and negation resolved, the layout kept unless a format is asked for)."""
    import torch._prims_common as prims

    dest = rng.choice(TWO_DEVICES + ["cpu"])
    back = rng.choice(TWO_DEVICES)
    wider, narrower = ((torch.complex128, torch.complex64) if t.is_complex() else (torch.float64, torch.float16))
    dtype = rng.choice([None, None, wider, narrower] + ([] if t.is_complex() else [torch.bfloat16]))
    fmt = rng.choice([None, None, torch.contiguous_format] + ([torch.channels_last] if t.dim() == 4 else []))
    remote = next(r for c, r in pairs if c is t)
    aliased = (dest == str(remote.device) and dtype in (None, t.dtype)
               and (fmt is None or prims.suggest_memory_format(t) == fmt))
    options = {k: v for k, v in (("dtype", dtype), ("memory_format", fmt)) if v is not None}

    def move(x):
        if x.device.type == "cpu":  # the reference
            if aliased:
                return x
            y = x.resolve_conj().resolve_neg().clone(memory_format=fmt or torch.preserve_format)
            return y.to(dtype) if dtype is not None else y
        y = x.to(dest, **options)
        return y.to(back) if dest == "cpu" else y
    return f"to({dest}, {dtype}, {fmt})", move


def run_two_device_program(seed: int, steps: int = 40):
    """A program of views, writes, ops and moves between two daemons' devices (and the CPU)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = torch.complex64 if seed % 3 == 1 else torch.float32
    cpu = [torch.randn(4, 6, dtype=dtype), torch.randn(6, 4, dtype=dtype), torch.randn(2, 3, 4, 5, dtype=dtype)]
    pairs = [(c, c.to(rng.choice(TWO_DEVICES))) for c in cpu]

    def choose(rng, c, pairs):
        draw = rng.random()
        return (_views(rng, c) if draw < 0.3 else _writes(rng, c, pairs) if draw < 0.6
                else _moves(rng, c, pairs) if draw < 0.85 else _computes(rng, c))

    return _play(rng, pairs, steps, choose), pairs


def test_random_programs_moving_tensors_between_two_daemons_match_cpu(two_daemons):
    """Moves between daemons (tcp and ipc) mixed with views and in-place writes: a write after a
    move must not reach the moved copy (it did, before daemons copied what they send to a peer at
    the send), and dtype and memory-format changes on the way give the CPU's values."""
    failures = []
    for seed in range(300):
        taken, pairs = run_two_device_program(seed)
        for k, (c, r) in enumerate(pairs):
            want, got = c.resolve_conj().resolve_neg(), r.resolve_conj().resolve_neg().cpu()
            tol = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) else 1e-3
            if (want.dtype, want.shape) != (got.dtype, got.shape) or not torch.allclose(
                    want, got, atol=tol, rtol=tol, equal_nan=True):
                failures.append(f"seed {seed}, tensor {k}: {' '.join(taken)}")
                break
    assert not failures, "\n".join(failures[:10])


def run_replayed_program(seed: int, dev, steps: int = 25, replays: int = 3):
    """A random step of views, writes and ops on three tensors, recorded with genie.graph and
    replayed `replays` times, and the same step run 1 + `replays` times on the CPU: the tensors
    (those made in the step too) as the two left them, and the steps; None where the step changes a
    tensor's shape in place (`t_`: not a step one can replay)."""
    import genie

    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = torch.complex64 if seed % 3 == 1 else torch.float32
    start = [torch.randn(4, 6, dtype=dtype), torch.randn(6, 4, dtype=dtype), torch.randn(2, 3, 4, dtype=dtype)]
    pairs = [(c.clone(), c.clone()) for c in start]
    steps_taken = []  # (tensor index, name, function)

    def choose(rng, c, pairs):
        draw = rng.random()
        chosen = _views(rng, c) if draw < 0.35 else _writes(rng, c, pairs) if draw < 0.8 else _computes(rng, c)
        if chosen is not None:
            steps_taken.append((next(i for i, (cc, _) in enumerate(pairs) if cc is c), *chosen))
        return chosen

    if "(refused on the CPU)" in _play(rng, pairs, steps, choose):
        steps_taken.pop()
    if any(name == "t_" for _, name, _ in steps_taken):
        return None

    def run_step(tensors: list) -> list:
        for k, name, fn in steps_taken:
            pairs[:] = [(t, t) for t in tensors]  # what copy_ steps read from
            out = fn(tensors[k])
            if not (name.endswith("_") or name == "setitem"):
                tensors.append(out)
        return tensors

    remote = [c.to(dev) for c in start]
    graph = genie.Graph()
    with genie.graph(graph):
        remote = run_step(remote)
    for _ in range(replays):
        graph.replay()
    reference = [c.clone() for c in start]
    for _ in range(1 + replays):
        local = run_step(list(reference))
    return local, remote, [f"{k}.{name}" for k, name, _ in steps_taken]


def test_random_programs_recorded_and_replayed_match_cpu(dev):
    """genie.graph replays of random steps over views of views and in-place writes: after three
    replays every tensor equals the CPU's after four runs of the step."""
    failures, replayed = [], 0
    for seed in range(150):
        result = run_replayed_program(seed, dev)
        if result is None:
            continue
        replayed += 1
        local, remote, taken = result
        for k, (c, r) in enumerate(zip(local, remote)):
            want, got = c.resolve_conj().resolve_neg(), r.resolve_conj().resolve_neg().cpu()
            if c.shape != got.shape or not torch.allclose(want, got, atol=1e-3, rtol=1e-2, equal_nan=True):
                failures.append(f"seed {seed}, tensor {k}: {' '.join(taken)}")
                break
    assert replayed > 50 and not failures, "\n".join(failures[:10])


def _move_under_autograd(rng, c, pairs):
    """(name, function) of a `.to()` to one of two daemons' devices, maybe widening the dtype; the
    reference side (CPU) copies where `.to()` copies."""
    dest, wider = rng.choice(TWO_DEVICES), rng.choice([None, None, torch.complex128 if c.is_complex() else torch.float64])
    remote = next(r for cc, r in pairs if cc is c)
    aliased = dest == str(remote.device) and wider in (None, remote.dtype)

    def move(x):
        if x.device.type == "cpu":
            return x if aliased else (x.to(wider) if wider else x) * 1  # a copy, under autograd
        return x.to(dest, wider) if wider else x.to(dest)
    return f"to({dest}, {wider})", move


def run_two_device_autograd_program(seed: int, steps: int = 30):
    """run_autograd_program with moves between two daemons' devices (and dtype changes) among the
    steps: the backward crosses daemons. The reference side copies where `.to()` copies."""
    rng, pairs, leaves = _autograd_start(seed, lambda rng: rng.choice(TWO_DEVICES))

    def choose(rng, c, pairs):
        draw = rng.random()
        if 0.65 <= draw < 0.9:
            return _move_under_autograd(rng, c, pairs)
        return _views(rng, c) if draw < 0.35 else _computes(rng, c) if draw < 0.65 else _write_into_non_leaf(rng, c)

    taken = _play(rng, pairs, steps, choose)
    losses = [sum(((t.real if t.is_complex() else t).sum() * (i + 1) * 0.01).to(torch.float64).cpu()
                  for i, t in enumerate(side)) for side in zip(*pairs)]
    return taken, losses, leaves


def test_random_autograd_programs_across_two_daemons_match_cpu(two_daemons):
    failures, backwards = [], 0
    for seed in range(100):
        taken, losses, leaves = run_two_device_autograd_program(seed)
        same, refused = _backward_outcome(losses, leaves)
        backwards += same and refused[0] is None
        if not same:
            failures.append(f"seed {seed} ({refused}): {' '.join(taken)}")
    assert backwards > 30 and not failures, (backwards, "\n".join(failures[:10]))
