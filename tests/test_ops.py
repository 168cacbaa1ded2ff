"""Ops on remote tensors equal the same ops on the CPU."""
import pytest
import torch
import torch.nn.functional as F

from outcomes import outcome

torch.manual_seed(0)
A = torch.randn(4, 5)
B = torch.randn(5, 3)
V = torch.randn(5)


def check(dev, fn, *inputs, atol=1e-5, rtol=1e-5):
    expected = fn(*inputs)
    got = fn(*[i.to(dev) if isinstance(i, torch.Tensor) else i for i in inputs])
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=rtol)
    else:
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.cpu(), e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fn", [
    lambda a, v: a + v,                 # (4,5) + (5,)
    lambda a, v: a * v[None, :] - 1,
    lambda a, v: a.unsqueeze(0) / (v.abs() + 1).view(1, 1, 5),
    lambda a, v: torch.where(a > 0, a, v),
    lambda a, v: torch.maximum(a, v),
], ids=["add", "mul_sub", "div3d", "where", "maximum"])
def test_broadcasting(dev, fn):
    check(dev, fn, A, V)


@pytest.mark.parametrize("fn", [
    lambda a: a.sum(), lambda a: a.sum(dim=1), lambda a: a.mean(dim=0, keepdim=True),
    lambda a: a.max(), lambda a: a.max(dim=1), lambda a: a.argmax(dim=0), lambda a: a.prod(dim=1),
    lambda a: a.std(dim=1), lambda a: a.var(), lambda a: a.norm(), lambda a: a.cumsum(0),
    lambda a: a.logsumexp(1), lambda a: a.amin(dim=(0, 1)), lambda a: (a > 0).any(dim=1),
    lambda a: a.sort(dim=1), lambda a: a.topk(2, dim=1),
], ids=["sum", "sum1", "mean0", "max", "maxdim", "argmax", "prod", "std", "var", "norm", "cumsum",
        "logsumexp", "amin", "any", "sort", "topk"])
def test_reductions(dev, fn):
    check(dev, fn, A)


def test_matmul_family(dev):
    check(dev, torch.matmul, A, B)
    check(dev, lambda a, b: a @ b @ b.t(), A, B)
    check(dev, torch.bmm, torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    check(dev, lambda a, v: a @ v, A, V)
    check(dev, torch.einsum, "ij,jk->ik", A, B)


def test_nn_functionals(dev):
    w, b = torch.randn(3, 5), torch.randn(3)
    check(dev, F.linear, A, w, b)
    check(dev, F.conv2d, torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4), 1, 1)
    check(dev, lambda x: F.softmax(x, dim=-1), A)
    check(dev, lambda x: F.log_softmax(x, dim=0), A)
    check(dev, lambda x, g, bb: F.layer_norm(x, (5,), g, bb), A, torch.randn(5), torch.randn(5))
    check(dev, F.embedding, torch.tensor([[0, 2], [4, 1]]), torch.randn(5, 3))
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    check(dev, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    check(dev, lambda x: F.gelu(x) + F.silu(x) + torch.tanh(x) + torch.sigmoid(x), A)
    check(dev, lambda x: F.max_pool2d(x, 2), torch.randn(1, 2, 6, 6))
    check(dev, lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), torch.randn(1, 2, 3, 3))
    check(dev, lambda x, t: F.cross_entropy(x, t), torch.randn(4, 5), torch.tensor([0, 1, 4, 2]))


def test_attention_result_has_the_layout_the_client_plans(dev):
    """A query made by view + transpose (as models make it): the CPU's fused kernel lays its
    result out like the query, torch's meta kernel (and so the client) row-major. The daemon
    gives the planned layout, so a view the client's metadata allows runs there too (it failed)."""
    x = torch.randn(1, 64, 4, 48)
    r = x.to(dev)
    q, rq = x.transpose(1, 2), r.transpose(1, 2)
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        got = F.scaled_dot_product_attention(rq, rq, rq, is_causal=True)
        assert got.is_contiguous()
        torch.testing.assert_close(got.view(1, 4, 64 * 48).cpu(), expected.reshape(1, 4, 64 * 48))
        # Decoding: one query position against a cache grown by torch.cat, shapes new every step.
        cache, rcache = torch.randn(1, 4, 8, 48), None
        rcache = cache.to(dev)
        for _ in range(3):
            step = torch.randn(1, 1, 4, 48).transpose(1, 2)
            cache, rcache = torch.cat([cache, step], dim=2), torch.cat([rcache, step.to(dev)], dim=2)
            out = F.scaled_dot_product_attention(step, cache, cache)
            rout = F.scaled_dot_product_attention(step.to(dev), rcache, rcache)
            torch.testing.assert_close(rout.cpu(), out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                                   torch.bool, torch.uint8])
def test_dtype_casts(dev, dtype):
    check(dev, lambda a: (a * 10).to(dtype), A)
    check(dev, lambda a: (a * 10).to(dtype).float() + 1, A)


def test_type_promotion_with_python_scalars(dev):
    i = torch.arange(5)
    check(dev, lambda x: x + 1.5, i)
    check(dev, lambda x: x * 2, i)
    check(dev, lambda x: x / 2, i)
    check(dev, lambda x: (x > 2) & (x < 4), i)


def test_indexing(dev):
    check(dev, lambda a, idx: a[idx], A, torch.tensor([3, 0, 1]))
    check(dev, lambda a: a[1:3, ::2], A)
    check(dev, lambda a: a[..., None, 2], A)
    check(dev, lambda a: a[a > 0], A)
    check(dev, lambda a, idx: a.gather(1, idx), A, torch.tensor([[0], [1], [2], [4]]))
    check(dev, lambda a, idx, src: a.index_add(0, idx, src), A, torch.tensor([0, 2]), torch.ones(2, 5))


def test_ops_named_unsafe_run_checked(dev):
    """_unsafe_index & co. and segment_reduce(unsafe=True) were refused by the daemon (they skip
    bounds checks); it runs their checked equivalents (daemon/checked_ops.py): the CPU's values in
    bounds, an error out of bounds (the CPU's kernels check these too), and the daemon carries on."""
    aten = torch.ops.aten
    mask, index = torch.tensor([[True], [False], [True]]), torch.tensor([3, 99, 0])  # 99: masked off, any value
    check(dev, lambda a, i: aten._unsafe_index(a, [i]), A, torch.tensor([3, 0, 1]))
    check(dev, lambda a, i, v: aten._unsafe_index_put(a, [i], v, True), A, torch.tensor([1, 1]), torch.ones(2, 5))
    check(dev, lambda a, m, i: aten._unsafe_masked_index(a, m, [i], -1.5), A, mask, index)
    check(dev, lambda a, m, i, v: aten._unsafe_masked_index_put_accumulate(a, m, [i], v), A, mask, index,
          torch.ones(3, 5))
    check(dev, lambda d, n: aten.segment_reduce(d, "max", lengths=n, unsafe=True), torch.arange(6.0),
          torch.tensor([2, 0, 4]))
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        aten._unsafe_index(A.to(dev), [torch.tensor([7], device=dev)]).cpu()
    check(dev, lambda a: a * 2, A)


def test_data_dependent_shapes(dev):
    x = torch.tensor([0.0, 3.0, 0.0, 1.0, 3.0])
    check(dev, torch.nonzero, x)
    check(dev, lambda t: torch.unique(t, return_counts=True), x)
    check(dev, lambda t: torch.masked_select(t, t > 0.5), x)


@pytest.mark.parametrize("make", [
    lambda d: torch.randn(2, 4, 4).to(d).to_sparse(layout=torch.sparse_bsc, blocksize=(2, 2)),
    lambda d: torch.randn(2, 4, 4).to(d).to_sparse_bsr((2, 2)),
    lambda d: torch.randn(2, 3, 3).to(d).to_sparse_csr(),
    lambda d: torch.randn(2, 3, 3).to(d).to_sparse_csc(),
], ids=["batched_bsc", "batched_bsr", "batched_csr", "batched_csc"])
def test_other_sparse_layouts_are_refused_when_made(dev, make):
    """Strided, sparse COO and 2-D sparse CSR, CSC, BSR and BSC tensors live on the device
    (tests/test_sparse.py), batched or hybrid ones do not: refused at the call, by name, not later
    by the daemon."""
    from genie.errors import UnsupportedOperationError

    with pytest.raises(UnsupportedOperationError, match="to_dense"):
        make(dev)
    assert (torch.ones(2).to(dev) * 3).cpu().tolist() == [3.0, 3.0]


def test_ops_on_the_newest_entry_of_a_growing_tensor_are_planned_once(dev, monkeypatch):
    """A decode loop reads `ids[:, -1:]` of a tensor that grows every step: a view with a new
    storage offset and size-1 stride each time. Ops that make new tensors from such row-major
    inputs reuse one plan (no meta execution per step), and their results stay right."""
    from genie.frontend import meta

    planned = []
    real_plan_op = meta.plan_op
    monkeypatch.setattr(meta, "plan_op", lambda func, *a: planned.append(str(func)) or real_plan_op(func, *a))
    ids = torch.tensor([[3, 1, 4]]).to(dev)
    local = torch.tensor([[3, 1, 4]])
    seen_after_warmup = []
    for step in range(6):
        last, local_last = ids[:, -1:], local[:, -1:]
        nxt = (last * 7 + 1).remainder(11).clone()
        ids, local = torch.cat([ids, nxt], 1), torch.cat([local, (local_last * 7 + 1).remainder(11).clone()], 1)
        if step == 1:
            planned.clear()
        seen_after_warmup = [p for p in planned if "slice" not in p and "cat" not in p]
    assert ids.cpu().tolist() == local.tolist()
    assert seen_after_warmup == []  # mul, add, remainder, clone: planned in the first steps only


def test_dtype_casts_of_views_keep_layouts_and_values(dev, sent_ops):
    """.to(dtype) / .half() / .float() take a short path of their own (planned once per input
    layout and dtype): results as the CPU's for dense tensors, transposes and slices, twice over."""
    x = torch.randn(4, 6)
    xr = x.to(dev)
    for _ in range(2):
        for make in (lambda t: t.to(torch.float64), lambda t: t.t().half(), lambda t: t[:, 1:4].bfloat16(),
                     lambda t: t.to(torch.int32), lambda t: t.half().float()):
            got, want = make(xr), make(x)
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
            assert torch.equal(got.cpu(), want)
    assert "aten::_to_copy" in sent_ops


def test_uploaded_tensors_grow_like_any_other(dev):
    """An upload's memory on the daemon is the received message, which cannot grow: resize_ and
    out= results of another size failed ('storage that is not resizable'). The daemon moves it
    to memory of its own, for every handle sharing it, and runs the op again."""
    out = torch.zeros(2).to(dev)
    torch.add(torch.ones(5, device=dev), 1, out=out)
    torch.testing.assert_close(out.cpu(), torch.full((5,), 2.0))
    local = torch.tensor([1.0, 2.0])
    remote = local.to(dev)
    remote_view, local_view = remote.view(2), local.view(2)
    for t, view in ((local, local_view), (remote, remote_view)):
        t.resize_(4)
        t[2:] = 7
        view.mul_(10)  # still a view of the grown tensor's storage
    torch.testing.assert_close(remote.cpu(), local)
    torch.testing.assert_close(remote_view.cpu(), local_view)
    cat_out = torch.tensor([], device=dev)
    torch.cat([torch.ones(2, device=dev), torch.zeros(1, device=dev)], out=cat_out)
    torch.testing.assert_close(cat_out.cpu(), torch.tensor([1.0, 1.0, 0.0]))


GROUPED_MM_CASES = {  # (mat_a, mat_b, offs): each operand layout torch._grouped_mm takes
    "2d-3d": lambda: (torch.randn(10, 8), torch.randn(3, 6, 8).transpose(-2, -1), torch.tensor([3, 7, 10], dtype=torch.int32)),
    "3d-3d": lambda: (torch.randn(3, 5, 8), torch.randn(3, 6, 8).transpose(-2, -1), None),
    "2d-2d": lambda: (torch.randn(5, 16), torch.randn(6, 16).T, torch.tensor([4, 8, 16], dtype=torch.int32)),
    "3d-2d": lambda: (torch.randn(3, 6, 8), torch.randn(10, 8).T, torch.tensor([3, 7, 10], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", sorted(GROUPED_MM_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_as_on_cpu(dev, reference, case, dtype):
    """torch._grouped_mm (mixture-of-experts layers) in float32 failed on the client (the meta
    kernel asks for bfloat16); its result is padded to 16-byte rows, as the kernels make it.
    Against a CUDA daemon the reference is the local GPU's (CUDA's kernels round otherwise)."""
    torch.manual_seed(0)
    a, b, offs = GROUPED_MM_CASES[case]()
    a, b = a.to(dtype), b.to(dtype)
    want = outcome(lambda: torch._grouped_mm(a.to(reference), _on(b, reference),
                                             offs=None if offs is None else offs.to(reference)))
    got = outcome(lambda: torch._grouped_mm(a.to(dev), _on(b, dev), offs=None if offs is None else offs.to(dev)))
    if isinstance(want, str):  # the reference refuses it (a GPU without this dtype's kernel): so must the daemon
        assert isinstance(got, str), want
        return
    assert got.stride() == want.stride()
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(got[..., :3].cpu(), want[..., :3].cpu())  # a view by the planned strides


def _on(t, dev):
    """t on the device with t's strides (a transposed weight stays column-major, as the op wants)."""
    return t.mT.contiguous().to(dev).mT if t.stride(-2) == 1 else t.to(dev)


def test_integer_histc_counts_as_cuda_does(dev):
    """On any device but the CPU, Hugging Face's MoE layers call histc on int32 ids: CUDA's kernel
    takes integers, the CPU's does not ('"histogram_cpu" not implemented for 'Int''); a CPU daemon
    counts them as CUDA does, in the input's dtype."""
    ids = torch.tensor([0, 3, 1, 1, 3, 3, 2, 7, -1], dtype=torch.int32)
    got = torch.histc(ids.to(dev), bins=4, min=0, max=3)
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu(), torch.histc(ids.float(), bins=4, min=0, max=3).to(torch.int32))
    floats = torch.histc(ids.float().to(dev), bins=5)  # floating inputs: the CPU's own kernel
    assert torch.equal(floats.cpu(), torch.histc(ids.float(), bins=5))


def test_view_copy_of_a_permuted_tensor(dev):
    """torch.view_copy copies (reshapes) where no view is possible, on every device; its meta
    kernel raised there instead, so a permuted or transposed input failed on remote_accelerator."""
    x = torch.randn(2, 3, 4)
    for order in ([2, 1, 0], [1, 0, 2], [0, 1, 2]):
        local = x.permute(order).contiguous().permute(order).requires_grad_()
        remote = local.detach().to(dev).requires_grad_()
        for size in ((6, 4), (-1,), (4, 6)):
            want, got = torch.view_copy(local, size), torch.view_copy(remote, size)
            assert got.stride() == want.stride()
            assert torch.equal(got.cpu(), want)
            want.pow(2).sum().backward()
            got.pow(2).sum().backward()
        assert torch.equal(remote.grad.cpu(), local.grad)
    with pytest.raises(RuntimeError, match="is invalid for input of size 6"):
        torch.view_copy(torch.randn(6).to(dev), (4, 2))
