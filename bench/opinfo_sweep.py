"""Backend coverage the way PyTorch measures one: PyTorch's OpInfo database on remote_accelerator.

For every OpInfo whose results are deterministic, every float32 sample input is
run on the CPU and on `remote_accelerator:0`, and the results are compared with
`torch.testing.assert_close`. Prints the pass rate and the failing ops.

    python -m bench.opinfo_sweep [--ops add,mul] [--json out.json] [--max-samples N]
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


def to_device(tree, dev):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to(dev), tree)


def to_cpu(tree):
    leaves, spec = pytree.tree_flatten(tree)
    lazy = [i for i, v in enumerate(leaves) if isinstance(v, genie.LazyTensor)]
    values = genie.materialize_sync([leaves[i] for i in lazy]) if lazy else []
    for i, v in zip(lazy, values):
        leaves[i] = v
    return pytree.tree_unflatten(leaves, spec)


def layout_differs(expected, got) -> bool:
    """Whether a remote result's metadata (what the client planned) lays out any output otherwise
    than the CPU did, which here is what the daemon holds: strides compared over dimensions of
    more than one element (the others address nothing)."""
    for e, g in zip(pytree.tree_leaves(expected), pytree.tree_leaves(got)):
        if (isinstance(e, torch.Tensor) and isinstance(g, genie.LazyTensor) and e.layout == torch.strided
                and e.shape == g.shape
                and [st for n, st in zip(e.shape, e.stride()) if n > 1]
                != [st for n, st in zip(g.shape, g.stride()) if n > 1]):
            return True
    return False


def run_sample(op, sample, dev) -> bool:
    """Checks the remote result's values against the CPU's; returns whether its layout differs."""
    args = (sample.input, *sample.args)
    expected = op(*args, **sample.kwargs)
    remote = op(*to_device(args, dev), **to_device(sample.kwargs, dev))
    differs = layout_differs(expected, remote)
    torch.testing.assert_close(to_cpu(remote), expected, equal_nan=True, check_device=False)
    return differs


def sweep(only: set[str] | None = None, max_samples: int | None = None, dev: str = "remote_accelerator:0",
          verbose: bool = False) -> dict:
    from torch.testing._internal.common_methods_invocations import op_db

    passed = failed = skipped = 0
    failures: dict[str, list[str]] = collections.defaultdict(list)
    layouts: collections.Counter = collections.Counter()  # op -> samples whose planned layout differs
    per_op: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for opinfo in op_db:
        if only and opinfo.name not in only:
            continue
        if not is_deterministic(opinfo) or torch.float32 not in opinfo.supported_dtypes("cpu"):
            continue
        try:
            samples = list(opinfo.sample_inputs("cpu", torch.float32))
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
                    expected = opinfo.op(sample.input, *sample.args, **sample.kwargs)
                del expected
            except Exception:
                skipped += 1  # the CPU itself rejects this sample
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if run_sample(opinfo.op, sample, dev):
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
        "layout_differs": dict(layouts),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--json", default="")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    only = {o for o in args.ops.split(",") if o} or None
    result = sweep(only, args.max_samples, verbose=args.verbose)
    for name, msgs in sorted(result["failures"].items()):
        print(f"  {name}: {msgs[0]}")
    print(f"OpInfo float32 samples: {result['passed']} passed, {result['failed']} failed "
          f"({result['pass_rate'] * 100:.1f}% pass) over {result['ops']} ops "
          f"({result['ops_all_pass']} fully passing), {result['seconds']:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
