"""Output metadata of hot ops worked out directly, where meta execution is slow.

A plan that misses the cache runs the op on meta tensors, and PyTorch's meta kernels for many
ops are Python (torch/_meta_registrations.py overrides the C++ ones): measured here per call,
scaled_dot_product_attention ~1 ms (its math decomposition), layer_norm ~0.7 ms, linear with a
bias on 3-D input ~0.8 ms, gelu ~0.45 ms, add ~0.15 ms, cat ~0.13 ms. Every new shape misses:
decoding with a growing KV cache (torch.cat, as Hugging Face's DynamicCache does) gives cat and
attention a new shape at every token (planning took ~3 ms of a ~4.5 ms decode step of the demo
GPT), and a prompt of a new length gives every op of the model one (~9 ms of a ~13 ms capture).
Each rule answers only inputs whose result it knows for certain (plainly contiguous tensors,
matching shapes, one dtype) and returns None for anything else, which meta execution plans as
before; tests/unit/test_shape_rules.py checks every rule against meta execution and the CPU
kernels on randomized inputs of many layouts.

scaled_dot_product_attention: its meta result is the math decomposition's, a contiguous tensor,
while a daemon's fused kernel may lay the same values out otherwise (the CPU flash kernel
follows the query's layout); the daemon makes its result contiguous (daemon/attention.py), so
both sides agree on strides by construction, as they must for views taken of it.
"""
from __future__ import annotations

import math

import torch

from genie.transport import layout_contract
from genie.transport.tensors import elements_spanned

from .meta import NewTensor, Plan, SameAsInput, Value, contiguous_strides

_CHANNELS_LAST_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}  # innermost dimension first


def strides_like_channels_last(shape: tuple, stride: tuple) -> bool:
    """torch._prims_common.are_strides_like_channels_last_or_false (what Tensor.suggest_memory_format
    and cat's meta kernel consult) for concrete sizes, without its symbolic-shape guards: 8-25 us
    less per call, paid by every cat of a growing KV cache. Checked against torch's on random
    layouts (tests/unit/test_shape_rules.py)."""
    order = _CHANNELS_LAST_ORDER.get(len(shape))
    if order is None or stride[1] == 0:
        return False
    least = 0
    for d in order:
        if shape[d] == 0 or stride[d] < least:
            return False
        if d == 0 and least == stride[1]:
            return False
        least = stride[d] * shape[d]
    return True


def channels_last_contiguous(shape: tuple, stride: tuple) -> bool:
    """Tensor.is_contiguous(memory_format=channels_last / channels_last_3d) for 4-D / 5-D sizes
    (size-1 dimensions ignored, as torch does); False for other ranks."""
    order = _CHANNELS_LAST_ORDER.get(len(shape))
    if order is None:
        return False
    expected = 1
    for d in order:
        if shape[d] != 1:
            if stride[d] != expected:
                return False
            expected *= shape[d]
    return True


def _dense_output(dtype: torch.dtype, shape: tuple) -> Plan:
    return Plan(NewTensor(dtype, shape, contiguous_strides(shape), 0, math.prod(shape) * dtype.itemsize), ())


def _plain_dense(t) -> bool:
    """Row-major strides exactly, size-1 dimensions' too (is_contiguous() ignores those, and
    meta kernels pass them on to results), and not also channels-last contiguous (where torch's
    memory-format suggestion may pick either)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or tuple(t.stride()) != contiguous_strides(t.shape):
        return False
    if t.dim() == 4:
        return not t.is_contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return not t.is_contiguous(memory_format=torch.channels_last_3d)
    return True


def _by_schema_names(op, rule):
    """`rule` (which reads the call's arguments by their schema names) as RULES calls it, with a
    call's positional and keyword arguments; a call with others than the schema's gets None."""
    names = tuple(a.name for a in op._schema.arguments)

    def planned(args: tuple, kwargs: dict) -> Plan | None:
        if len(args) > len(names) or any(k not in names for k in kwargs):
            return None
        return rule(dict(zip(names, args), **kwargs))

    planned.__name__ = rule.__name__
    return planned


def _suggests_row_major(t) -> bool:
    """Whether torch's memory-format suggestion for `t` (Tensor.suggest_memory_format, which cat
    consults) is contiguous_format: always below 4 dimensions; for 4-D and 5-D by torch's test of
    strides."""
    return t.dim() not in (4, 5) or not strides_like_channels_last(tuple(t.shape), t.stride())


def plan_cat(bound: dict) -> Plan | None:
    """aten::cat(Tensor[] tensors, int dim=0): same dtype, same rank, every size but `dim`'s equal,
    no empty tensor (cat skips legacy empty ones), and one tensor at least whose suggested memory
    format is row-major: then the result is row-major whatever the tensors' layouts (cat copies;
    a decoding step's new key, a transposed view, has strides of its own in its size-1
    dimensions)."""
    tensors, dim = bound.get("tensors"), bound.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not tensors or type(dim) is not int:
        return None
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return None
    rank, dtype, shape = first.dim(), first.dtype, tuple(first.shape)
    if rank == 0 or not -rank <= dim < rank:
        return None
    dim %= rank
    total, row_major = 0, False
    for t in tensors:
        if (not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dtype or t.dim() != rank
                or t.numel() == 0):
            return None
        size = tuple(t.shape)
        if size[:dim] != shape[:dim] or size[dim + 1:] != shape[dim + 1:]:
            return None
        total += size[dim]
        row_major = row_major or _suggests_row_major(t)
    if not row_major:
        return None
    return _dense_output(dtype, shape[:dim] + (total,) + shape[dim + 1:])


def _floating_dense(t) -> bool:
    return _plain_dense(t) and t.dtype.is_floating_point and t.numel() > 0


def plan_unary(bound: dict) -> Plan | None:
    """An elementwise op of one floating tensor (gelu, silu, relu, tanh, ...): a plainly
    contiguous input gives a contiguous result of its shape and dtype."""
    if not _floating_dense(bound.get("self")):
        return None
    t = bound["self"]
    return _dense_output(t.dtype, tuple(t.shape))


def plan_binary(bound: dict) -> Plan | None:
    """add / sub / mul / div of a floating tensor and a tensor of the same dtype (both plainly
    contiguous, shapes broadcasting) or a Python int or float: a contiguous result of the
    broadcast shape and that dtype."""
    if not _floating_dense(bound.get("self")):
        return None
    t, other = bound["self"], bound.get("other")
    alpha = bound.get("alpha", 1)
    if type(alpha) not in (int, float):
        return None
    if type(other) in (int, float):
        return _dense_output(t.dtype, tuple(t.shape))
    if not _floating_dense(other) or other.dtype != t.dtype:
        return None
    try:
        shape = tuple(torch.broadcast_shapes(t.shape, other.shape))
    except RuntimeError:
        return None
    return _dense_output(t.dtype, shape)


def plan_view_copy(bound: dict) -> Plan | None:
    """view_copy: a new row-major tensor of the requested shape, whatever the input's strides. Its
    kernel (the same for every device) reshapes, copying, where no view is possible; its meta
    kernel, a Python reference, raises there ("view size is not compatible ..."), so a permuted
    or channels-last input failed on this device. An invalid shape is left to the meta kernel's
    error."""
    t, size = bound.get("self"), bound.get("size")
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not isinstance(size, (list, tuple)):
        return None
    try:
        shape = tuple(torch._prims_common.infer_size(size, t.numel()))
    except (RuntimeError, ValueError, TypeError):
        return None
    return _dense_output(t.dtype, shape)


_IN_PLACE = Plan(SameAsInput(0), ())


def plan_in_place(bound: dict) -> Plan | None:
    """add_ / sub_ / mul_ / div_ / addcdiv_ / addcmul_ on a plainly contiguous floating tensor,
    whose other tensors (plainly contiguous, same dtype) broadcast to its shape and whose other
    arguments are Python numbers: the result is `self`, its metadata unchanged. (Optimizers' and
    training loops' step-dependent scalars make every step's call a new cache key.)"""
    if not _floating_dense(bound.get("self")):
        return None
    t = bound["self"]
    shapes = [t.shape]
    for name, value in bound.items():
        if name == "self":
            continue
        if isinstance(value, torch.Tensor):
            if not _floating_dense(value) or value.dtype != t.dtype:
                return None
            shapes.append(value.shape)
        elif type(value) not in (int, float):
            return None
    try:
        if tuple(torch.broadcast_shapes(*shapes)) != tuple(t.shape):
            return None
    except RuntimeError:
        return None
    return _IN_PLACE


def plan_linear(bound: dict) -> Plan | None:
    """aten::linear(input, weight, bias=None): input of 2 or more dimensions, a 2-D weight and a
    1-D bias (or none) that fit it, one floating dtype, all plainly contiguous: a contiguous
    (..., out_features) result."""
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    if not (_floating_dense(x) and _floating_dense(w)) or x.dim() < 2 or w.dim() != 2:
        return None
    if w.dtype != x.dtype or w.shape[1] != x.shape[-1]:
        return None
    if b is not None and not (_floating_dense(b) and b.dtype == x.dtype and tuple(b.shape) == (w.shape[0],)):
        return None
    return _dense_output(x.dtype, tuple(x.shape[:-1]) + (w.shape[0],))


def plan_layer_norm(bound: dict) -> Plan | None:
    """aten::layer_norm over the input's trailing dimensions, with weight and bias (or none) of
    exactly those sizes, one floating dtype, all plainly contiguous: a contiguous result of the
    input's shape."""
    x, normalized = bound.get("input"), bound.get("normalized_shape")
    if not _floating_dense(x) or not isinstance(normalized, (list, tuple)) or not normalized:
        return None
    normalized = tuple(normalized)
    if len(normalized) > x.dim() or tuple(x.shape[x.dim() - len(normalized):]) != normalized:
        return None
    for p in (bound.get("weight"), bound.get("bias")):
        if p is not None and not (_floating_dense(p) and p.dtype == x.dtype and tuple(p.shape) == normalized):
            return None
    return _dense_output(x.dtype, tuple(x.shape))


def plan_embedding(bound: dict) -> Plan | None:
    """aten::embedding(weight, indices, ...): a plainly contiguous 2-D floating weight and int64 or
    int32 indices: a contiguous indices.shape + (embedding_dim,) result."""
    if bound.get("sparse"):
        return None
    w, idx = bound.get("weight"), bound.get("indices")
    if not _floating_dense(w) or w.dim() != 2 or not _plain_dense(idx) or idx.dtype not in (torch.int64, torch.int32):
        return None
    return _dense_output(w.dtype, tuple(idx.shape) + (w.shape[1],))


def plan_sdpa(bound: dict) -> Plan | None:
    """aten::scaled_dot_product_attention on 4-D (batch, heads, length, dim) inputs of one
    floating dtype with equal batch and head counts, or with enable_gqa key/value heads (equal)
    that divide the query's (grouped-query attention, as Llama-style models call it), an optional mask of 2 to
    4 dimensions that broadcasts to (batch, heads, L, S) without growing it (the CPU kernel
    refuses a 1-D one that meta execution takes), and not both a mask and is_causal: a
    contiguous (batch, heads, L, value dim) result."""
    q, k, v, mask = bound.get("query"), bound.get("key"), bound.get("value"), bound.get("attn_mask")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.layout == torch.strided for t in (q, k, v)):
        return None
    dtype = q.dtype
    if not dtype.is_floating_point or k.dtype != dtype or v.dtype != dtype:
        return None
    (b, h, length, e), (kb, kh, s, ke), (vb, vh, vs, ev) = q.shape, k.shape, v.shape
    if not (b == kb == vb and kh == vh and s == vs and e == ke) or 0 in (b, h, kh, length, e, s, ev):
        return None
    if h != kh and not (bound.get("enable_gqa") is True and h % kh == 0):
        return None
    if mask is not None:
        if (not isinstance(mask, torch.Tensor) or mask.layout != torch.strided or bound.get("is_causal")
                or (mask.dtype != torch.bool and mask.dtype != dtype) or not 2 <= mask.dim() <= 4):
            return None
        try:
            if tuple(torch.broadcast_shapes(mask.shape, (b, h, length, s))) != (b, h, length, s):
                return None
        except RuntimeError:
            return None
    return _dense_output(dtype, (b, h, length, ev))


def _floating_2d(t) -> bool:
    """A non-empty 2-D floating tensor of any strides: the fused cell ops' results are contiguous
    whatever their inputs' layout (torch's CUDA kernels allocate them so; the CPU daemon's
    kernels in daemon/rnn_cells.py make them so)."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype.is_floating_point
            and t.dim() == 2 and t.numel() > 0)


def _cell_inputs(input_gates, hidden_gates, state, input_bias, hidden_bias, gates: int) -> bool:
    """2-D gate inputs of (batch, gates * hidden) and a (batch, hidden) state of one floating
    dtype, and 1-D plainly contiguous biases of gates * hidden, both or neither (as torch's RNN
    cells call the fused cell ops)."""
    if not all(_floating_2d(t) for t in (input_gates, hidden_gates, state)):
        return False
    if (hidden_gates.dtype != input_gates.dtype or state.dtype != input_gates.dtype
            or input_gates.shape != hidden_gates.shape or input_gates.shape[0] != state.shape[0]
            or input_gates.shape[1] != gates * state.shape[1]):
        return False
    if input_bias is None and hidden_bias is None:
        return True
    return all(_floating_dense(b) and b.dtype == input_gates.dtype and tuple(b.shape) == (input_gates.shape[1],)
               for b in (input_bias, hidden_bias))


def plan_fused_lstm_cell(bound: dict) -> Plan | None:
    """aten::_thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias), which
    torch's LSTM layers call for devices other than the CPU: contiguous (hy, cy) like cx and a
    workspace like the gates. (torch's meta kernel fails without biases.)"""
    gates, cx = bound.get("input_gates"), bound.get("cx")
    if not _cell_inputs(gates, bound.get("hidden_gates"), cx, bound.get("input_bias"), bound.get("hidden_bias"), 4):
        return None
    state, workspace = _dense_output(cx.dtype, tuple(cx.shape)).outputs, _dense_output(gates.dtype, tuple(gates.shape)).outputs
    return Plan((state, state, workspace), ())


def plan_fused_gru_cell(bound: dict) -> Plan | None:
    """aten::_thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias, hidden_bias), which
    torch's GRU layers call for devices other than the CPU (no meta kernel in torch): contiguous
    hy like hx and a (batch, 5 * hidden) workspace."""
    hx = bound.get("hx")
    if not _cell_inputs(bound.get("input_gates"), bound.get("hidden_gates"), hx, bound.get("input_bias"),
                        bound.get("hidden_bias"), 3):
        return None
    batch, hidden = hx.shape
    return Plan((_dense_output(hx.dtype, (batch, hidden)).outputs, _dense_output(hx.dtype, (batch, 5 * hidden)).outputs), ())


def plan_fused_gru_cell_backward(bound: dict) -> Plan | None:
    """aten::_thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias) (no meta kernel in torch):
    contiguous gate gradients (batch, 3 * hidden) for input and hidden, grad_hx like grad_hy, and
    bias gradients of 3 * hidden, or None without biases."""
    grad, workspace, has_bias = bound.get("grad_hy"), bound.get("workspace"), bound.get("has_bias")
    if not (_floating_2d(grad) and _floating_2d(workspace) and workspace.dtype == grad.dtype
            and tuple(workspace.shape) == (grad.shape[0], 5 * grad.shape[1]) and type(has_bias) is bool):
        return None
    batch, hidden = grad.shape
    gate_grad = _dense_output(grad.dtype, (batch, 3 * hidden)).outputs
    bias_grad = _dense_output(grad.dtype, (3 * hidden,)).outputs if has_bias else Value(None)
    return Plan((gate_grad, gate_grad, _dense_output(grad.dtype, (batch, hidden)).outputs, bias_grad, bias_grad), ())


def _batch_norm_input(t) -> bool:
    """A non-empty floating tensor of 2 or more dimensions, any strides: nn.SyncBatchNorm's input."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype.is_floating_point
            and t.dim() >= 2 and t.numel() > 0)


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation type CUDA's batch-norm kernels keep statistics in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_vectors(bound: dict, names: tuple, channels: int) -> bool:
    return all(isinstance(bound.get(n), torch.Tensor) and bound[n].dtype.is_floating_point
               and tuple(bound[n].shape) == (channels,) for n in names)


def _like_input_in_suggested_format(t) -> NewTensor:
    """empty_like(t, t.suggest_memory_format()): channels-last strides where t's strides are
    channels-last-like (4-D and 5-D), else contiguous."""
    shape = tuple(t.shape)
    if not strides_like_channels_last(shape, tuple(t.stride())):
        return _dense_output(t.dtype, shape).outputs
    inner = [1] * len(shape)  # strides innermost first in the channels-last order
    order, acc = _CHANNELS_LAST_ORDER[len(shape)], 1
    for d in order:
        inner[d] = acc
        acc *= max(shape[d], 1)
    return NewTensor(t.dtype, shape, tuple(inner), 0, math.prod(shape) * t.dtype.itemsize)


def plan_batch_norm_stats(bound: dict) -> Plan | None:
    """aten::batch_norm_stats(input, eps) (nn.SyncBatchNorm; no meta kernel in torch): per-channel
    (mean, invstd), contiguous, in the accumulation type."""
    x = bound.get("input")
    if not _batch_norm_input(x):
        return None
    vector = _dense_output(_statistics_dtype(x.dtype), (x.shape[1],)).outputs
    return Plan((vector, vector), ())


def plan_batch_norm_gather_stats(bound: dict) -> Plan | None:
    """aten::batch_norm_gather_stats(_with_counts)(input, mean, invstd, running_mean, running_var,
    momentum, eps, count(s)): the (world, channels) statistics combined into (mean, invstd) of
    `channels`, of mean's and invstd's dtypes; the running statistics change values only."""
    mean, invstd = bound.get("mean"), bound.get("invstd")
    if not (_batch_norm_input(bound.get("input")) and isinstance(mean, torch.Tensor) and isinstance(invstd, torch.Tensor)
            and mean.dim() == 2 and mean.shape == invstd.shape and mean.shape[1] == bound["input"].shape[1]
            and mean.dtype.is_floating_point and invstd.dtype.is_floating_point):
        return None
    channels = mean.shape[1]
    return Plan((_dense_output(mean.dtype, (channels,)).outputs, _dense_output(invstd.dtype, (channels,)).outputs), ())


def plan_batch_norm_elemt(bound: dict) -> Plan | None:
    """aten::batch_norm_elemt(input, weight, bias, mean, invstd, eps) and
    aten::batch_norm_backward_elemt(grad_out, input, ...): a result like the input, in its
    suggested memory format (as CUDA's kernels and daemon/sync_batch_norm.py allocate it)."""
    x = bound.get("input")
    if not _batch_norm_input(x) or not _channel_vectors(bound, ("mean", "invstd"), x.shape[1]):
        return None
    if "grad_out" in bound and not (isinstance(bound["grad_out"], torch.Tensor) and bound["grad_out"].shape == x.shape):
        return None
    return Plan(_like_input_in_suggested_format(x), ())


def plan_batch_norm_backward_reduce(bound: dict) -> Plan | None:
    """aten::batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g,
    bias_g): (sum_dy, sum_dy_xmu) of mean's dtype where input_g, grad_weight and grad_bias of the
    weight's dtype where their flags are set; None for the others."""
    x, grad, weight = bound.get("input"), bound.get("grad_out"), bound.get("weight")
    flags = [bound.get(n) for n in ("input_g", "weight_g", "bias_g")]
    if (not _batch_norm_input(x) or not isinstance(grad, torch.Tensor) or grad.shape != x.shape
            or not _channel_vectors(bound, ("mean", "invstd"), x.shape[1]) or any(type(f) is not bool for f in flags)
            or (weight is not None and not _channel_vectors(bound, ("weight",), x.shape[1]))):
        return None
    channels, none = x.shape[1], Value(None)
    sums = _dense_output(bound["mean"].dtype, (channels,)).outputs if flags[0] else none
    param = _dense_output((weight if weight is not None else bound["mean"]).dtype, (channels,)).outputs
    return Plan((sums, sums, param if flags[1] else none, param if flags[2] else none), ())


def plan_grouped_mm(bound: dict) -> Plan | None:
    """aten::_grouped_mm(self, mat2, offs) (mixture-of-experts layers: Hugging Face's Mixtral,
    Qwen-MoE, ...): PyTorch's meta kernel asks for bfloat16 operands, as CUDA's kernel did once,
    while the CPU kernel (and CUDA's since) take float32 and float16 too: Mixtral in float32
    failed on remote_accelerator and ran on the CPU. The result as the kernels lay it out
    (layout_contract.grouped_mm_result); anything unusual (bias, another out_dtype, operands the
    kernels refuse) is left to meta execution, and its error."""
    a, b, offs = bound.get("self"), bound.get("mat2"), bound.get("offs")
    out_dtype = bound.get("out_dtype") or getattr(a, "dtype", None)
    if (bound.get("bias") is not None or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor)
            or a.dtype != b.dtype or a.dtype not in _GROUPED_MM_DTYPES or out_dtype != a.dtype
            or (offs is not None and (not isinstance(offs, torch.Tensor) or offs.dim() != 1
                                      or offs.dtype != torch.int32))):
        return None
    result = layout_contract.grouped_mm_result(a, b, offs, out_dtype)
    if result is None:
        return None
    shape, stride = result
    nbytes = elements_spanned(0, shape, stride) * out_dtype.itemsize
    return Plan(NewTensor(out_dtype, shape, stride, 0, nbytes), ())


_GROUPED_MM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def plan_fused_step(bound: dict) -> Plan:
    """Fused optimizer steps PyTorch has no meta kernel for (aten::_fused_sgd_, _fused_adagrad_:
    torch.optim.SGD / Adagrad with fused=True): they write new values into the tensors of their
    list arguments, whose metadata stays, and return nothing. Without a plan each step would
    run alone on the daemon and wait for it."""
    return Plan(Value(None), ())


_aten = torch.ops.aten
RULES = {id(op): _by_schema_names(op, rule) for op, rule in (
    (_aten.cat.default, plan_cat),
    (_aten.scaled_dot_product_attention.default, plan_sdpa),
    (_aten.linear.default, plan_linear),
    (_aten.layer_norm.default, plan_layer_norm),
    (_aten.embedding.default, plan_embedding),
    (_aten._thnn_fused_lstm_cell.default, plan_fused_lstm_cell),
    (_aten._thnn_fused_gru_cell.default, plan_fused_gru_cell),
    (_aten._thnn_fused_gru_cell_backward.default, plan_fused_gru_cell_backward),
    (_aten._grouped_mm.default, plan_grouped_mm),
    (_aten.batch_norm_stats.default, plan_batch_norm_stats),
    (_aten.batch_norm_gather_stats.default, plan_batch_norm_gather_stats),
    (_aten.batch_norm_gather_stats_with_counts.default, plan_batch_norm_gather_stats),
    (_aten.batch_norm_elemt.default, plan_batch_norm_elemt),
    (_aten.batch_norm_backward_elemt.default, plan_batch_norm_elemt),
    (_aten.batch_norm_backward_reduce.default, plan_batch_norm_backward_reduce),
    *((op, plan_fused_step) for op in (_aten._fused_sgd_.default, _aten._fused_sgd_.tensor_lr,
                                       _aten._fused_adagrad_.default, _aten._fused_adagrad_.tensor_lr)),
    (_aten.view_copy.default, plan_view_copy),
    (_aten.add.Tensor, plan_binary),
    (_aten.sub.Tensor, plan_binary),
    (_aten.mul.Tensor, plan_binary),
    (_aten.div.Tensor, plan_binary),
    (_aten.add_.Tensor, plan_in_place),
    (_aten.sub_.Tensor, plan_in_place),
    (_aten.mul_.Tensor, plan_in_place),
    (_aten.div_.Tensor, plan_in_place),
    (_aten.addcdiv_.default, plan_in_place),
    (_aten.addcmul_.default, plan_in_place),
    *((getattr(_aten, name).default, plan_unary)
      for name in ("gelu", "silu", "relu", "tanh", "sigmoid", "exp", "neg", "rsqrt", "sqrt", "abs")),
)}
