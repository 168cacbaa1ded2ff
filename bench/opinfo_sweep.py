"""Backend coverage the way PyTorch measures one: PyTorch's OpInfo database on remote_accelerator.

For every OpInfo whose results are deterministic, every float32 (or `--dtype`) sample
input is run on the CPU and on `remote_accelerator:0`, and the results are compared with
`torch.testing.assert_close`. Prints the pass rate and the failing ops.

With `--layout channels_last` every 4-D (5-D) tensor of a sample is made channels-last
(channels-last-3d) first, with `--layout permuted` every tensor of 2 or more dimensions gets
its dimensions' order in memory reversed (same values, column-major strides): the sweep then
also shows ops whose planned layout disagrees with the CPU kernels' for such inputs.
With `--layout conj_view` every complex tensor is passed as a conjugate view of the same values
(`t.conj_physical().conj()`, made on each side, as PyTorch's own tests of math views do), with
`--layout neg_view` every floating tensor as a negative view (`torch._neg_view(-t)`). With
`--backward`, the samples of ops with autograd run with inputs that require grad, and the
gradients of a weighted sum of the outputs are compared instead; with `--forward-ad`, the
tangents that forward-mode AD gives the outputs when every floating argument is a dual tensor
with a random tangent.

    python -m bench.opinfo_sweep [--ops add,mul] [--json out.json] [--max-samples N] [--layout L] [--dtype D]
                                 [--backward | --forward-ad]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings

import torch
from torch.utils import _pytree as pytree

import genie

# Ops whose outputs are random or uninitialised memory: not comparable to the CPU.
NONDETERMINISTIC = (
    "normal", "bernoulli", "multinomial", "uniform", "cauchy", "exponential", "geometric", "log_normal",
    "rand", "randn", "randint", "randperm", "dropout", "rrelu", "empty", "new_empty", "empty_like",
    "empty_strided", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "resize_", "resize_as_", "native_dropout", "_native_batch_norm_legit",
)


def is_deterministic(opinfo) -> bool:
    name = opinfo.name
    return not any(name == n or name.startswith(n + "_") or name.startswith(n + ".") or n in name.split(".")
                   for n in NONDETERMINISTIC) and "dropout" not in name and "rand" not in name


def samples_of(opinfo, dtype: torch.dtype, requires_grad: bool) -> list:
    """The op's CPU samples, made exactly as `opinfo.sample_inputs` makes them for PyTorch's tests:
    its function called, then every random generator seeded with the tests' SEED before each
    sample is taken. Not through `sample_inputs` itself, which costs most of the sweep's time
    outside the daemon (bench/NOTES.md): its `torch.manual_seed` also seeds every lazily started
    backend, and on this torch each such call records a stack trace (~50 µs per sample at a
    test's stack depth), and it looks up the calling unittest twice per op with
    `inspect.stack()`, which reads the source of every frame on the stack."""
    import random

    from torch.testing._internal.common_utils import SEED, TEST_NUMPY

    if TEST_NUMPY:
        import numpy
    made, samples = [], iter(opinfo.sample_inputs_func(opinfo, "cpu", dtype, requires_grad))
    while True:
        torch.default_generator.manual_seed(SEED)
        random.seed(SEED)
        if TEST_NUMPY:
            numpy.random.seed(SEED)
        try:
            made.append(next(samples))
        except StopIteration:
            return made


def to_device(tree, dev):
    """The tensors of `tree` on `dev`, as leaves that require grad where the originals did."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to(dev).requires_grad_(t.requires_grad), tree)


def to_cpu(tree):
    leaves, spec = pytree.tree_flatten(tree)
    lazy = [i for i, v in enumerate(leaves) if isinstance(v, genie.LazyTensor)]
    values = genie.materialize_sync([leaves[i] for i in lazy]) if lazy else []
    for i, v in zip(lazy, values):
        leaves[i] = v
    leaves = [v.cpu() if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta") else v for v in leaves]
    return pytree.tree_unflatten(leaves, spec)


def placed(tree, dev, layout: str = "as_given"):
    """The sample's arguments copied to `dev`, the layout's view bits made again there (a copy
    resolves them)."""
    moved = to_device(tree, dev)
    view = DEVICE_VIEWS.get(layout)
    return moved if view is None else pytree.tree_map_only(torch.Tensor, view, moved)


def on_reference(tree, reference: str, layout: str = "as_given"):
    """The sample's arguments where the reference runs: as they are on the CPU, else placed there."""
    return tree if reference == "cpu" else placed(tree, reference, layout)


def _dense(shape, stride) -> bool:
    """Whether a layout covers its storage exactly once (a permutation of row-major)."""
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(shape, stride) if n > 1):
        if st != expected:
            return False
        expected *= n
    return True


def layout_differs(expected, got) -> bool:
    """Whether the daemon holds any output laid out otherwise than the client planned it (the
    strides the result reports): the output's memory, read in storage order on the daemon,
    must equal the CPU's values laid out by the planned strides. A mismatch makes views of the
    result wrong or fail. Checked for dense layouts (the others leave gaps in the storage)."""
    for e, g in zip(pytree.tree_leaves(expected), pytree.tree_leaves(got)):
        if not (isinstance(e, torch.Tensor) and isinstance(g, genie.LazyTensor) and e.layout == torch.strided
                and e.shape == g.shape and g.numel() > 1 and _dense(g.shape, g.stride())):
            continue
        planned = torch.empty_strided(g.shape, g.stride(), dtype=e.dtype).copy_(e)
        held = g.as_strided((g.numel(),), (1,), g.storage_offset()).cpu()
        flat = planned.as_strided((planned.numel(),), (1,))
        if held.dtype == torch.complex32:  # torch.equal has no kernel for it
            held, flat = held.to(torch.complex64), flat.to(torch.complex64)
        if torch.equal(held, flat):
            continue
        if not (held.is_floating_point() or held.is_complex()) or not torch.allclose(
                held, flat, equal_nan=True, rtol=1e-4, atol=1e-5):
            return True
    return False


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return t.contiguous(memory_format=fmt) if fmt is not None and t.layout == torch.strided else t


def _permuted(t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 2 or t.layout != torch.strided:
        return t
    order = list(range(t.dim()))[::-1]
    return t.permute(order).contiguous().permute(order)  # same shape and values, memory order reversed


def _conj_view(t: torch.Tensor) -> torch.Tensor:
    return t.conj_physical().conj() if t.is_complex() and t.layout == torch.strided else t


def _neg_view(t: torch.Tensor) -> torch.Tensor:
    return torch._neg_view(-t) if (t.is_floating_point() or t.is_complex()) and t.layout == torch.strided else t


LAYOUTS = {"as_given": None, "channels_last": _channels_last, "permuted": _permuted,
           "conj_view": _conj_view, "neg_view": _neg_view}
# Views whose bits a copy to the device resolves: made again there, from the copied values.
DEVICE_VIEWS = {"conj_view": _conj_view, "neg_view": _neg_view}


def laid_out(sample, layout: str) -> tuple[tuple, dict]:
    """The sample's positional and keyword arguments, tensors laid out as `layout` says."""
    args, kwargs = (sample.input, *sample.args), sample.kwargs
    change = LAYOUTS[layout]
    if change is None:
        return args, kwargs
    return (pytree.tree_map_only(torch.Tensor, change, args), pytree.tree_map_only(torch.Tensor, change, kwargs))


def run_sample(op, args: tuple, kwargs: dict, dev, layout: str, expected) -> bool:
    """Checks the remote result's values against the reference's, `expected`; returns whether its
    layout differs."""
    remote_args, remote_kwargs = placed((args, kwargs), dev, layout)
    remote = op(*remote_args, **remote_kwargs)
    differs = layout_differs(expected, remote)
    torch.testing.assert_close(to_cpu(remote), expected, equal_nan=True, check_device=False)
    return differs


def _weighted_grads(op, args, kwargs, weights=None):
    """Gradients of sum(output * weight) over the floating outputs that require grad, with
    respect to the inputs that do; the weights (drawn on the CPU when not given)."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [o for o in pytree.tree_leaves(op(*args, **kwargs))
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
    if not leaves or not outs:
        return None, None
    if weights is None:
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(o.shape, generator=g) for o in outs]
    total = sum((o * w.to(o.device)).sum() for o, w in zip(outs, weights))
    return torch.autograd.grad(total, leaves, allow_unused=True), weights


def run_sample_backward(op, args: tuple, kwargs: dict, dev, want, weights) -> None:
    """Checks the remote gradients against the CPU's, `want` (raises where they differ)."""
    remote_args, remote_kwargs = to_device((args, kwargs), dev)
    got, _ = _weighted_grads(op, remote_args, remote_kwargs, weights)
    for w, g in zip(want, got):
        if (w is None) != (g is None):
            raise AssertionError("a gradient is missing on one side")
        if w is not None:
            torch.testing.assert_close(to_cpu(g), w, equal_nan=True, check_device=False)


def _tangents(op, args, kwargs, tangents=None):
    """Forward-mode derivatives: every floating or complex tensor argument made a dual tensor
    (tangents drawn on the CPU when not given), the tangents of the floating/complex outputs."""
    import torch.autograd.forward_ad as fwAD

    leaves, spec = pytree.tree_flatten((args, kwargs))
    duals = [i for i, t in enumerate(leaves)
             if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    if not duals:
        return None, None
    if tangents is None:
        g = torch.Generator().manual_seed(0)
        tangents = [torch.randn(leaves[i].shape, generator=g, dtype=leaves[i].dtype) for i in duals]
    with fwAD.dual_level():
        for i, t in zip(duals, tangents):
            leaves[i] = fwAD.make_dual(leaves[i], t.to(leaves[i].device))
        a, k = pytree.tree_unflatten(leaves, spec)
        outs = [o for o in pytree.tree_leaves(op(*a, **k))
                if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]
        found = [fwAD.unpack_dual(o).tangent for o in outs]
        found = [None if t is None else t.clone() for t in found]  # kept past the dual level
    return found, tangents


def run_sample_forward_ad(op, args: tuple, kwargs: dict, dev, want, tangents) -> None:
    """Checks the remote forward-mode tangents against the CPU's, `want` (raises where they differ)."""
    got, _ = _tangents(op, *to_device((args, kwargs), dev), tangents)
    if len(got) != len(want):
        raise AssertionError("a different number of outputs")
    for w, g in zip(want, got):
        if (w is None) != (g is None):
            raise AssertionError("a tangent is missing on one side")
        if w is not None:
            torch.testing.assert_close(to_cpu(g), w, equal_nan=True, check_device=False)


def sweep(only: set[str] | None = None, max_samples: int | None = None, dev: str = "remote_accelerator:0",
          verbose: bool = False, layout: str = "as_given", dtype: torch.dtype = torch.float32,
          backward: bool = False, forward_ad: bool = False, reference: str = "cpu") -> dict:
    """`reference`: where the values compared with come from: the CPU, or e.g. this process's own
    GPU where the daemon computes on CUDA (outputs and forward AD; gradients need the CPU, as a
    local CUDA backward is impossible after import genie: pytorch/pytorch#161129)."""
    from torch.testing._internal.common_methods_invocations import op_db

    passed = failed = skipped = 0
    failures: dict[str, list[str]] = collections.defaultdict(list)
    layouts: collections.Counter = collections.Counter()  # op -> samples whose planned layout differs
    per_op: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for opinfo in op_db:
        if only and opinfo.name not in only:
            continue
        if not is_deterministic(opinfo) or dtype not in opinfo.supported_dtypes("cpu") or (
                backward and not opinfo.supports_autograd) or (forward_ad and not opinfo.supports_forward_ad):
            continue
        try:
            samples = samples_of(opinfo, dtype, backward)
        except Exception:
            continue
        if max_samples:
            samples = samples[:max_samples]
        counts = per_op.setdefault(opinfo.name, [0, 0])
        if verbose:
            print(f"OP {opinfo.name}", file=sys.stderr, flush=True)
        for sample in samples:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    args, kwargs = laid_out(sample, layout)
                    if backward:
                        want, weights = _weighted_grads(opinfo.op, args, kwargs)
                        if want is None:  # nothing of it takes part in autograd
                            raise LookupError
                    elif forward_ad:
                        want, tangents = _tangents(opinfo.op, *on_reference((args, kwargs), reference, layout))
                        if not want or all(t is None for t in want):
                            raise LookupError
                        want = to_cpu(want)
                    else:
                        ref_args, ref_kwargs = on_reference((args, kwargs), reference, layout)
                        expected = to_cpu(opinfo.op(*ref_args, **ref_kwargs))
            except Exception:
                skipped += 1  # the reference itself rejects this sample
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if backward:
                        run_sample_backward(opinfo.op, args, kwargs, dev, want, weights)
                    elif forward_ad:
                        run_sample_forward_ad(opinfo.op, args, kwargs, dev, want, tangents)
                    elif run_sample(opinfo.op, args, kwargs, dev, layout, expected):
                        layouts[opinfo.name] += 1
                passed += 1
                counts[0] += 1
            except Exception as e:
                failed += 1
                counts[1] += 1
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                failures[opinfo.name].append(msg)
                if verbose:
                    print(f"FAIL {opinfo.name}: {msg}", file=sys.stderr)
    total = passed + failed
    return {
        "passed": passed, "failed": failed, "skipped_cpu_rejects": skipped,
        "pass_rate": passed / total if total else 0.0,
        "ops": len(per_op), "ops_all_pass": sum(1 for p, f in per_op.values() if f == 0 and p > 0),
        "seconds": time.perf_counter() - t0,
        "failures": {k: v[:3] for k, v in failures.items()},
        "failed_per_op": {k: f for k, (p, f) in per_op.items() if f},
        "layout_differs": dict(layouts),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--json", default="")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="as_given",
                   help="lay the samples' tensors out this way first")
    p.add_argument("--dtype", default="float32", help="the samples' dtype (a torch dtype name: complex64, ...)")
    p.add_argument("--backward", action="store_true", help="compare gradients instead of outputs")
    p.add_argument("--forward-ad", action="store_true",
                   help="compare forward-mode derivatives (tangents of dual tensors) instead of outputs")
    p.add_argument("--reference", default="cpu",
                   help="where the compared values come from: cpu, or e.g. cuda against a CUDA daemon")
    p.add_argument("--strict-layouts", action="store_true",
                   help="exit with status 1 when the daemon holds any result otherwise than planned")
    args = p.parse_args(argv)
    only = {o for o in args.ops.split(",") if o} or None
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        p.error(f"not a torch dtype: {args.dtype}")
    if args.backward and args.reference != "cpu":
        p.error("--backward compares with the CPU (a local CUDA backward is impossible after import genie)")
    result = sweep(only, args.max_samples, verbose=args.verbose, layout=args.layout, dtype=dtype,
                   backward=args.backward, forward_ad=args.forward_ad, reference=args.reference)
    for name, msgs in sorted(result["failures"].items()):
        print(f"  {name}: {msgs[0]}")
    print(f"OpInfo {args.dtype} samples ({'backward' if args.backward else 'forward AD' if args.forward_ad else args.layout}): {result['passed']} passed, {result['failed']} failed "
          f"({result['pass_rate'] * 100:.1f}% pass) over {result['ops']} ops "
          f"({result['ops_all_pass']} fully passing), {result['seconds']:.0f}s")
    if result["layout_differs"]:
        print("the daemon holds results otherwise than planned: " + ", ".join(
            f"{name} ({n})" for name, n in sorted(result["layout_differs"].items())))
        if args.strict_layouts:
            return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
