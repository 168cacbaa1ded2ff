"""Output plans from meta execution, and the metadata cache (no daemon involved)."""
import pytest
import torch

from genie.frontend import meta
from meta_planning import meta_plan


def plan(func, *args, **kwargs):
    return meta_plan(func, args, kwargs)


def test_new_tensor_plan_has_metadata():
    p = plan(torch.ops.aten.add.Tensor, torch.ones(2, 3), torch.ones(3))
    assert p.outputs == meta.NewTensor(torch.float32, (2, 3), (3, 1), 0, 24)
    assert p.mutations == ()


def test_inplace_returns_the_input():
    p = plan(torch.ops.aten.add_.Tensor, torch.ones(2, 3), torch.ones(3))
    assert p.outputs == meta.SameAsInput(0)


def test_view_keeps_offset_and_storage():
    p = plan(torch.ops.aten.select.int, torch.ones(4, 5), 0, 2)
    assert p.outputs == meta.NewTensor(torch.float32, (5,), (1,), 10, 80)


def test_inplace_view_records_a_mutation():
    p = plan(torch.ops.aten.t_.default, torch.ones(2, 3))
    assert p.outputs == meta.SameAsInput(0)
    assert p.mutations == ((0, (3, 2), (1, 3), 0, 24),)


def test_out_resize_records_growth():
    out = torch.empty(0)
    p = plan(torch.ops.aten.mul.out, torch.ones(5), torch.ones(5), out=out)
    assert p.outputs == meta.SameAsInput(2)
    assert p.mutations == ((2, (5,), (1,), 0, 20),)


def test_multiple_outputs():
    p = plan(torch.ops.aten.max.dim, torch.ones(3, 4), 1)
    assert p.outputs[0].shape == (3,) and p.outputs[1].dtype == torch.int64


@pytest.mark.parametrize("func, args", [
    (torch.ops.aten.nonzero.default, (torch.ones(3),)),
    (torch.ops.aten._local_scalar_dense.default, (torch.ones(()),)),
    (torch.ops.aten.equal.default, (torch.ones(3), torch.ones(3))),
])
def test_data_dependent_ops_need_the_daemon(func, args):
    with pytest.raises(meta.NeedsRemoteExecution):
        plan(func, *args)


def test_user_errors_surface_like_eager():
    with pytest.raises(RuntimeError, match="broadcast"):
        plan(torch.ops.aten.add.Tensor, torch.ones(2), torch.ones(3))


@pytest.mark.parametrize("func, args", [
    (torch.ops.aten.as_strided.default, ((2, 2), (1, 2), 10)),
    (torch.ops.aten.as_strided_.default, ((2, 2), (1, 2), 10)),
    (torch.ops.aten.as_strided.default, ((6,), (1,))),
], ids=["offset", "in_place", "size"])
def test_views_past_their_storage_raise_as_the_cpu_does(func, args):
    """Meta kernels accept these; the CPU and CUDA refuse them at the call, and so must planning."""
    with pytest.raises(RuntimeError) as cpu:
        func(torch.ones(5), *args)
    with pytest.raises(RuntimeError) as planned:
        plan(func, torch.ones(5), *args)
    assert str(planned.value) == str(cpu.value)


def test_views_within_their_storage_plan_as_before():
    p = plan(torch.ops.aten.as_strided.default, torch.ones(20)[2:7], (2, 2), (1, 2), 10)
    assert p.outputs == meta.NewTensor(torch.float32, (2, 2), (1, 2), 10, 80)


def test_cache_counts_hits_and_misses():
    cache = meta.MetaCache(maxsize=2)
    p = plan(torch.ops.aten.neg.default, torch.ones(2))
    assert cache.get("k") is None
    cache.put("k", p)
    assert cache.get("k") is p
    cache.put("k2", p)
    cache.put("k3", p)  # over maxsize: cleared, then stored
    assert cache.info()["size"] == 1
    assert cache.info()["hits"] == 1 and cache.info()["misses"] == 3
