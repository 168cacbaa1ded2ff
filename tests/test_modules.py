"""module.to("remote_accelerator") + forward equals the CPU, for an MLP, a CNN and a transformer block."""
import copy

import pytest
import torch
import torch.nn as nn

import genie
from genie.examples.gpt import GPTConfig, TinyGPT, generate
from outcomes import outcome


def compare(dev, model, *inputs, atol=1e-5):
    model = model.eval()
    with torch.no_grad():
        expected = model(*inputs)
    remote = copy.deepcopy(model).to(dev)
    for p in remote.parameters():
        assert isinstance(p, genie.LazyTensor) and isinstance(p, nn.Parameter)
    with torch.no_grad():
        got = remote(*[i.to(dev) for i in inputs])
    torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=1e-4)
    return remote


def test_mlp(dev):
    torch.manual_seed(0)
    compare(dev, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.LogSoftmax(-1)), torch.randn(4, 16))


def test_cnn(dev):
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
    cnn[1].running_mean.uniform_(-0.5, 0.5)
    compare(dev, cnn, torch.randn(2, 3, 16, 16), atol=1e-4)


def test_transformer_block(dev):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    compare(dev, layer, torch.randn(2, 7, 32), atol=1e-4)


def test_forward_with_grad_enabled(dev):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(3, 8)
    expected = mlp(x)
    remote = copy.deepcopy(mlp).to(dev)
    got = remote(x.to(dev))
    assert got.requires_grad
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)


def test_weights_are_sent_once(dev):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # 256 KiB of weights
    remote = copy.deepcopy(model).to(dev)
    genie.synchronize()
    x = torch.randn(1, 256).to(dev)
    genie.synchronize()
    before = sum(s["bytes_sent"] for s in genie.transport_stats().values())
    with torch.no_grad():
        for _ in range(5):
            x = remote(x)
        x.cpu()
    sent = sum(s["bytes_sent"] for s in genie.transport_stats().values()) - before
    assert sent < 16 * 1024, f"{sent} bytes sent for 5 forwards: weights were re-sent"


def test_gpt_generation_matches_cpu(dev):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2, dim=64)).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 8))
    expected = generate(model, prompt, 6)
    model.to(dev)
    assert generate(model, prompt.to(dev), 6) == expected


@pytest.mark.parametrize("read_every", [3, 5, 20])
def test_reading_tokens_n_at_a_time_gives_the_same_tokens_with_fewer_round_trips(dev, read_every):
    from genie.examples.gpt import generate_static

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2, dim=64)).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 8))
    expected = generate(model, prompt, 10)
    assert generate_static(model, prompt, 10, replay=False, read_every=read_every) == expected
    model.to(dev)
    endpoint, = genie.transport_stats()
    reads = -(-10 // read_every)
    for decode, recording in ((generate, 0), (generate_static, 1)):  # a genie.graph recording waits once
        seen = []
        before = genie.transport_stats()[endpoint]["blocking_waits"]
        assert decode(model, prompt.to(dev), 10, on_token=seen.append, read_every=read_every) == expected
        assert seen == expected
        assert genie.transport_stats()[endpoint]["blocking_waits"] - before == reads + recording  # 10 reads one by one


def test_backward_and_optimizer_step_match_cpu(dev):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    remote = copy.deepcopy(model).to(dev)
    x, target = torch.randn(5, 4), torch.randn(5, 1)
    for m, xx, tt in ((model, x, target), (remote, x.to(dev), target.to(dev))):
        loss = ((m(xx) - tt) ** 2).mean()
        loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for p_cpu, p_remote in zip(model.parameters(), remote.parameters()):
        assert isinstance(p_remote.grad, genie.LazyTensor)
        torch.testing.assert_close(p_remote.grad.cpu(), p_cpu.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(p_remote.detach().cpu(), p_cpu.detach(), atol=1e-6, rtol=1e-5)


def test_tied_weights_stay_tied(dev):
    m = _TiedLM().to(dev)
    assert m.head.weight is m.emb.weight
    assert len(list(m.parameters())) == 1


def test_torch_save_stores_values(dev, tmp_path):
    t = torch.arange(6.0, device=dev).reshape(2, 3)
    torch.save({"t": t}, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt")["t"]
    assert loaded.device.type == "cpu" and torch.equal(loaded, torch.arange(6.0).reshape(2, 3))


def test_deepcopy_of_remote_module(dev):
    m = nn.Linear(3, 2).to(dev)
    c = copy.deepcopy(m)
    assert c.weight is not m.weight
    torch.testing.assert_close(c.weight.detach().cpu(), m.weight.detach().cpu())


def test_assigning_data_replaces_the_values(dev):
    """`p.data = ...` (old-style init, vector_to_parameters, dtype changes) takes effect, as on
    the CPU; it was a silent no-op before (the remote handle stayed the old one)."""
    torch.manual_seed(0)
    local = nn.Linear(3, 2)
    remote = nn.Linear(3, 2).to(dev)
    remote.load_state_dict(local.state_dict())
    for m in (local, remote):
        m.weight.data = m.weight.data * 2
        m.bias.data = torch.zeros(2, device=m.bias.device)
    torch.testing.assert_close(remote.weight.detach().cpu(), local.weight.detach())
    torch.testing.assert_close(remote.bias.detach().cpu(), torch.zeros(2))
    vector = torch.arange(8.0)
    torch.nn.utils.vector_to_parameters(vector.to(dev), remote.parameters())
    torch.nn.utils.vector_to_parameters(vector, local.parameters())
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(remote.parameters()).cpu(), vector)
    x = torch.randn(4, 3)
    local(x).sum().backward()
    remote(x.to(dev)).sum().backward()  # still parameters, still trained
    torch.testing.assert_close(remote.weight.grad.cpu(), local.weight.grad)


def test_assigning_data_from_another_device_moves_the_parameter_as_on_cuda(dev):
    """`p.data = p.data.to(dev)` (older training scripts move models so) and `p.data = cpu_t` on a
    remote parameter failed ("incompatible tensor type": PyTorch lets `.data` change type only
    between its own backends). The parameter now moves, the same Python object, as on CUDA."""
    torch.manual_seed(0)
    reference, moved = nn.Linear(3, 2), nn.Linear(3, 2)
    moved.load_state_dict(reference.state_dict())
    weight = moved.weight
    weight.no_weight_decay = True
    calls = []
    weight.register_hook(lambda g: calls.append("grad") or g)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, moved)]
    for p in moved.parameters():
        p.data = p.data.to(dev)
    assert moved.weight is weight and isinstance(weight, nn.Parameter) and weight.requires_grad
    assert weight.device == torch.device(dev) and weight.no_weight_decay is True
    x = torch.randn(4, 3)
    for m, opt, inp in zip((reference, moved), optimizers, (x, x.to(dev))):
        m(inp).pow(2).sum().backward()
        opt.step()
    assert calls == ["grad"]
    torch.testing.assert_close(moved.weight.detach().cpu(), reference.weight.detach())

    moved.bias.data = torch.zeros(2)  # and back, as `cuda_param.data = cpu_tensor`
    assert moved.bias.device.type == "cpu" and isinstance(moved.bias, nn.Parameter)
    assert moved.bias.tolist() == [0.0, 0.0]

    source = torch.zeros(3, device=dev)  # `.data =` shares the new tensor's memory
    plain = torch.ones(3)
    plain.data = source
    source.add_(1)
    assert plain.device == torch.device(dev) and plain.tolist() == [1.0, 1.0, 1.0] and not plain.requires_grad


def test_tensor_data_stays_plain_for_torch_compile():
    """Genie's `.data` setter must not change what torch.compile sees of `.data` on CPU tensors."""
    def f(x, y):
        x.data = x.data * 2 + y
        return x.data + 1

    for backend in ("eager", "aot_eager"):
        compiled = torch.compile(f, fullgraph=True, backend=backend)
        x, expected = torch.ones(3), torch.ones(3)
        torch.testing.assert_close(compiled(x, torch.arange(3.0)), f(expected, torch.arange(3.0)))
        torch.testing.assert_close(x, expected)


def test_the_class_of_a_remote_parameter_makes_parameters_as_nn_parameter_does(dev):
    """`type(p)(data, requires_grad=...)` remakes a parameter by its class (accelerate does so when
    it dispatches a device_map over several devices). A remote parameter's class is LazyTensor,
    whose constructor refused those arguments."""
    p = nn.Linear(3, 2).to(dev).weight
    cls = type(p)
    cpu = cls(torch.ones(2, 3), requires_grad=False)
    assert isinstance(cpu, nn.Parameter) and cpu.device.type == "cpu" and not cpu.requires_grad
    remote = cls(torch.ones(2, 3, device=dev))
    assert isinstance(remote, nn.Parameter) and remote.device == p.device and remote.requires_grad
    assert not cls(torch.ones(2, device=dev), False).requires_grad
    assert remote.to(dev).cpu().tolist() == [[1.0] * 3] * 2
    with pytest.raises(TypeError, match="takes a tensor"):
        cls("weights")


def test_attention_under_autograd_is_one_fused_op_each_way_and_trains_like_cpu(dev, sent_ops):
    import torch.nn.functional as F

    sent = sent_ops
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2))
    remote = copy.deepcopy(model).to(dev)
    idx, target = torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))
    pos = torch.arange(32)
    for m, device in ((model, "cpu"), (remote, dev)):
        logits, _ = m(idx.to(device), pos.to(device))
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.to(device).reshape(-1)).backward()
    torch.remote_accelerator.synchronize()
    for p, rp in zip(model.parameters(), remote.parameters()):
        torch.testing.assert_close(rp.grad.cpu(), p.grad, atol=1e-6, rtol=1e-4)
    assert sent.count("aten::_scaled_dot_product_fused_attention_overrideable") == 2  # one per layer
    assert sent.count("aten::_scaled_dot_product_fused_attention_overrideable_backward") == 2
    assert "aten::_safe_softmax" not in sent and "aten::bmm" not in sent  # not the math decomposition


@pytest.mark.parametrize("layout", ["row-major", "channels-last", "float64", "bool mask"])
def test_attention_gradients_equal_the_cpus_whichever_kernel_torch_picks(dev, layout):
    """The daemon's fused attention ran the CPU flash kernel on any input: on a query whose last
    dimension is not contiguous (channels-last 4-D tensors), where torch itself takes the math
    backend, it gave wrong outputs and gradients (off by up to 166); for float64 the op's
    float32 log-sum-exp cost the gradients ~1e-6 relative. It now runs the kernel torch would
    choose, and torch's math backend (its backward by autograd) otherwise: equal to the CPU."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    dtype = torch.float64 if layout == "float64" else torch.float32
    q, k, v = (torch.randn(2, 4, n, 8, dtype=dtype) * 3 for n in (3, 6, 6))  # sharp: lse precision shows
    if layout == "channels-last":
        q, k, v = (t.contiguous(memory_format=torch.channels_last) for t in (q, k, v))
    mask = torch.rand(3, 6) > 0.3 if layout == "bool mask" else None
    weights = torch.randn(2, 4, 3, 8, dtype=dtype)

    def grads(device):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        for causal in (False, True) if mask is None else (False,):
            out = F.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.to(device),
                                                 is_causal=causal)
            (out * weights.to(device)).sum().backward()
        return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]

    for got, want in zip(grads(dev), grads("cpu")):
        torch.testing.assert_close(got, want)


def test_activation_backwards_run_fused_as_on_the_cpu(dev, sent_ops):
    """SiLU's and Mish's backward ops have CPU/CUDA kernels and a decomposition, which ran on this
    device: 8 ops per SiLU backward, in bfloat16 arithmetic for bfloat16 (every gradient of a
    bfloat16 SiLU differed from the CPU's in the last bit). One fused op now, equal to the CPU's;
    double backward still decomposes, as on the CPU."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(64, dtype=torch.bfloat16)
    weights = torch.randn(64, dtype=torch.bfloat16)

    def grads(device, act, twice=False):
        leaf = x.to(device).requires_grad_()
        (g,) = torch.autograd.grad((act(leaf) * weights.to(device)).sum(), leaf, create_graph=twice)
        if twice:
            (g,) = torch.autograd.grad(g.sum(), leaf)
        return g.cpu()

    for act in (F.silu, F.mish):
        sent_ops.clear()
        assert torch.equal(grads(dev, act), grads("cpu", act))
        name = "aten::silu_backward" if act is F.silu else "aten::mish_backward"
        assert sent_ops.count(name) == 1 and "aten::sigmoid" not in sent_ops[sent_ops.index(name):]
        torch.testing.assert_close(grads(dev, act, twice=True), grads("cpu", act, twice=True))


def test_forward_mode_ad_through_ops_kept_whole(dev):
    """Ops Genie keeps whole when no gradient is recorded (linear, matmul, layer_norm, softmax,
    scaled_dot_product_attention) skipped autograd for dual tensors too, which need no
    requires_grad: torch.func.jvp through F.linear gave zeros, fwAD gave no tangent. And with a
    dual level open, planning quantile hit PyTorch's internal assert in _fw_primal."""
    import torch.autograd.forward_ad as fwAD
    import torch.nn.functional as F
    from torch.func import jacfwd, jvp

    torch.manual_seed(0)
    w, b = torch.randn(6, 4), torch.randn(6)
    x, t = torch.randn(2, 3, 4), torch.randn(2, 3, 4)

    def f(x, w, b):  # (the CPU's attention kernel has no forward-mode derivative: not here)
        a = F.layer_norm(F.linear(x, w, b), (6,))
        return torch.matmul(a, w).softmax(-1) + F.log_softmax(a, -1).sum()

    want = jvp(lambda x: f(x, w, b), (x,), (t,))
    got = jvp(lambda x: f(x, w.to(dev), b.to(dev)), (x.to(dev),), (t.to(dev),))
    for g, e in zip(got, want):
        torch.testing.assert_close(g.cpu(), e, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(jacfwd(lambda w: F.linear(x.to(dev), w))(w.to(dev)).cpu(),
                               jacfwd(lambda w: F.linear(x, w))(w))
    q = torch.tensor([0.25, 0.5])
    for device in ("cpu", dev):
        with fwAD.dual_level():
            out = torch.quantile(fwAD.make_dual(x.flatten().to(device), t.flatten().to(device)), q.to(device))
            tangent = fwAD.unpack_dual(out).tangent.cpu()
        if device == "cpu":
            expected = tangent
    torch.testing.assert_close(tangent, expected)


def test_composite_ops_go_whole_without_autograd_and_decompose_with_it(dev, sent_ops):
    """linear/matmul/layer_norm/softmax are decomposed by ATen at the autograd key: under no_grad
    (or with nothing requiring a gradient) capture now gets each as one op, as under
    inference_mode; when a gradient is recorded they decompose as before, and train like CPU."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 16), torch.randn(32, 16), torch.randn(32)
    ln_w, ln_b = torch.randn(32), torch.randn(32)

    def f(x, w, b, ln_w, ln_b):
        h = F.layer_norm(F.linear(x, w, b), (32,), ln_w, ln_b)
        return F.log_softmax(torch.matmul(h, w), -1).softmax(-1)

    expected = f(x, w, b, ln_w, ln_b)
    remote = [t.to(dev) for t in (x, w, b, ln_w, ln_b)]
    torch.remote_accelerator.synchronize()
    with torch.no_grad():
        sent_ops.clear()
        out = f(*remote)
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert sent_ops[:5] == ["aten::linear", "aten::layer_norm", "aten::matmul", "aten::log_softmax.int",
                            "aten::softmax.int"]
    assert "aten::addmm" not in sent_ops and "aten::native_layer_norm" not in sent_ops

    cpu_leaves = [t.clone().requires_grad_() for t in (x, w, b, ln_w, ln_b)]
    remote_leaves = [t.to(dev).requires_grad_() for t in (x, w, b, ln_w, ln_b)]
    torch.remote_accelerator.synchronize()
    sent_ops.clear()
    g = torch.randn_like(expected)
    f(*cpu_leaves).backward(g)
    f(*remote_leaves).backward(g.to(dev))
    for c, r in zip(cpu_leaves, remote_leaves):
        torch.testing.assert_close(r.grad.cpu(), c.grad, atol=1e-5, rtol=1e-4)
    assert "aten::linear" not in sent_ops and "aten::addmm" in sent_ops  # decomposed: autograd has formulas


def test_decode_steps_with_new_cache_lengths_need_no_meta_execution(dev, monkeypatch):
    """Each token of a torch.cat KV cache gives cat and attention new shapes, which miss the
    metadata cache; their plans come from genie/frontend/shape_rules.py, not from meta execution
    (Python meta kernels: ~3 ms per step of this model). A rule that stops answering the shapes a
    model really produces (a transposed key view, ...) fails this."""
    from genie.frontend import capture, meta

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig()).eval().to(dev)
    planned: list[str] = []
    plan_op = meta.plan_op

    def counting(func, *args):
        planned.append(capture.op_name(func))
        return plan_op(func, *args)

    with torch.no_grad():
        prompt = torch.randint(0, model.cfg.vocab_size, (1, 37), device=dev)  # a length no other test uses
        pos = torch.arange(37, device=dev)
        logits, past = model(prompt, pos)
        for step in range(5):
            if step == 2:  # the first steps plan the one-token shapes that do not change
                monkeypatch.setattr(meta, "plan_op", counting)
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            pos = pos[-1:] + 1
            logits, past = model(token, pos, past)
        in_steps = list(planned)
        logits.sum().item()  # runs them (values: test_gpt_generation_matches_cpu)
    assert past[0][0].shape[2] == 42  # layer 0 keys: 37 + 5 positions
    assert in_steps == []


@pytest.mark.parametrize("make", [
    lambda: nn.LSTM(6, 5, num_layers=2, batch_first=True),
    lambda: nn.LSTM(6, 5, bidirectional=True, bias=False),
    lambda: nn.LSTM(6, 5, proj_size=3),
    lambda: nn.GRU(6, 5, num_layers=2, bidirectional=True),
    lambda: nn.GRU(6, 5, bias=False, batch_first=True),
    lambda: nn.RNN(6, 5, nonlinearity="relu"),
], ids=["lstm2", "lstm_bi_nobias", "lstm_proj", "gru2_bi", "gru_nobias", "rnn_relu"])
def test_recurrent_layers_forward_and_backward_match_cpu(dev, make):
    """torch hands the gate math of LSTM/GRU steps on non-CPU devices to fused cell ops that it
    has for CUDA only; a CPU daemon runs its own kernels for them (daemon/rnn_cells.py)."""
    from genie.frontend.capture import meta_cache

    torch.manual_seed(0)
    model = make()
    remote = copy.deepcopy(model).to(dev)
    x = torch.randn(4, 3, 6)
    out, _ = model(x)
    reported = meta_cache.bypasses
    got, _ = remote(x.to(dev))
    (got * got).sum().backward()
    # Every step's cell planned on the client (shape rules where torch has no meta kernel):
    # none ran on the daemon synchronously, a round trip per step.
    assert meta_cache.bypasses == reported
    torch.testing.assert_close(got.cpu(), out, atol=1e-5, rtol=1e-4)
    (out * out).sum().backward()
    for (name, p), q in zip(model.named_parameters(), remote.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_recurrent_cells_step_by_step_match_cpu(dev):
    torch.manual_seed(0)
    lstm, gru = nn.LSTMCell(4, 3), nn.GRUCell(4, 3)
    r_lstm, r_gru = copy.deepcopy(lstm).to(dev), copy.deepcopy(gru).to(dev)
    xs = torch.randn(5, 2, 4)
    h = c = g = torch.zeros(2, 3)
    rh, rc, rg = h.to(dev), c.to(dev), g.to(dev)
    for x in xs:
        h, c = lstm(x, (h, c))
        g = gru(x, g)
        rh, rc = r_lstm(x.to(dev), (rh, rc))
        rg = r_gru(x.to(dev), rg)
    torch.testing.assert_close(rh.cpu(), h, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rc.cpu(), c, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rg.cpu(), g, atol=1e-5, rtol=1e-4)


def test_recurrent_layers_recorded_and_replayed_match_cpu(dev):
    """A replay runs as a TorchScript trace on the daemon, which calls the fused cell kernels too."""
    torch.manual_seed(0)
    lstm, gru = nn.LSTM(6, 5, num_layers=2), nn.GRU(6, 5)
    r_lstm, r_gru = copy.deepcopy(lstm).to(dev), copy.deepcopy(gru).to(dev)
    x = torch.randn(4, 3, 6).to(dev)
    out = torch.zeros(4, 3, 10, device=dev)
    g = genie.Graph()
    with torch.no_grad(), genie.graph(g):
        out.copy_(torch.cat([r_lstm(x)[0], r_gru(x)[0]], -1))
    for _ in range(2):
        new = torch.randn(4, 3, 6)
        x.copy_(new.to(dev))
        g.replay()
        with torch.no_grad():
            want = torch.cat([lstm(new)[0], gru(new)[0]], -1)
        torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("batch_first", [True, False])
def test_packed_sequences_through_lstm_match_cpu(dev, batch_first):
    """pack_padded_sequence keeps batch_sizes on the CPU (as PackedSequence requires and CUDA does)
    and the packed data on the device; LSTM over it, padding back and backward equal the CPU."""
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 3, batch_first=batch_first, bidirectional=True)
    remote = copy.deepcopy(lstm).to(dev)
    x = (torch.randn(3, 5, 4) if batch_first else torch.randn(5, 3, 4)).requires_grad_()
    xr = x.detach().to(dev).requires_grad_()
    lengths = torch.tensor([5, 3, 2])
    packed = nn.utils.rnn.pack_padded_sequence(xr, lengths, batch_first=batch_first)
    assert packed.batch_sizes.device.type == "cpu" and packed.data.device == torch.device(dev)
    out, (h, _) = lstm(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=batch_first))
    r_out, (r_h, _) = remote(packed)
    want, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first)
    got, got_lengths = nn.utils.rnn.pad_packed_sequence(r_out, batch_first=batch_first)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(r_h.cpu(), h, atol=1e-5, rtol=1e-4)
    assert torch.equal(got_lengths, lengths)
    (want.sum() + h.sum()).backward()
    (got.sum() + r_h.sum()).backward()
    torch.testing.assert_close(xr.grad.cpu(), x.grad, atol=1e-5, rtol=1e-4)
    for p, q in zip(lstm.parameters(), remote.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-4)
    seqs = [torch.randn(2, 4), torch.randn(5, 4), torch.randn(3, 4)]  # unsorted: sorted on the device
    gru = nn.GRU(4, 3)
    _, h = gru(nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False))
    _, r_h = copy.deepcopy(gru).to(dev)(nn.utils.rnn.pack_sequence([s.to(dev) for s in seqs], enforce_sorted=False))
    torch.testing.assert_close(r_h.cpu(), h, atol=1e-5, rtol=1e-4)


def test_transformer_encoder_with_padding_mask_in_eval(dev):
    """With nested tensors (the default; tests/test_nested.py has the cases) and without, the
    remote encoder equals the CPU's."""
    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 8), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    for nested in (True, False):
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                        enable_nested_tensor=nested).eval()
        with torch.no_grad():
            want = encoder(x, src_key_padding_mask=mask)
            got = copy.deepcopy(encoder).to(dev)(x.to(dev), src_key_padding_mask=mask.to(dev))
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


def _inference_mode_cases(d):
    """What PyTorch makes of views across torch.inference_mode: each case's result, or its error."""
    base = torch.arange(16.0).reshape(4, 4).to(d)
    written = base.clone()
    with torch.inference_mode():
        made_inside = torch.arange(16.0).reshape(4, 4).to(d)
        flags = [v.is_inference() for v in (base[1:], base.t(), *base.split(2), base.detach(), base + 1, (base + 1)[1])]
        written[1].mul_(2)  # in-place through a view of a normal tensor, inside
        kept_view = written.view(-1)
    leaf = base.clone().requires_grad_()
    with torch.inference_mode():
        leaf_row = leaf[1]
    (leaf_row * 2).sum().backward()
    return {
        "flags": flags,
        "views of an inference tensor": [v.is_inference() for v in (made_inside[1], made_inside.t(), made_inside * 2)],
        "written": written.cpu().tolist(), "version": written._version, "shares version": kept_view._version == written._version,
        "view, then written outside": outcome(lambda: kept_view.add_(1).sum().item()),
        "inference view written outside": outcome(lambda: made_inside[1].add_(1)),
        "leaf row": (leaf_row.requires_grad, leaf_row.is_leaf), "leaf grad": leaf.grad,
    }


def test_views_under_inference_mode_follow_pytorch(dev):
    """A view is an inference tensor exactly when its input is one (PyTorch's rule). Views of a
    model's tensors inside torch.inference_mode() failed ("Cannot set version_counter for
    inference tensor", the wrapper being made in inference mode; nn.MultiheadAttention failed
    so), and views of inference tensors outside it were normal tensors, which accepted in-place
    writes that PyTorch refuses."""
    assert _inference_mode_cases(dev) == _inference_mode_cases("cpu")

    torch.manual_seed(0)
    mha, x = nn.MultiheadAttention(8, 2, batch_first=True).eval(), torch.randn(2, 5, 8)
    remote, xr = copy.deepcopy(mha).to(dev), x.to(dev)
    with torch.inference_mode():
        want, got = mha(x, x, x)[0], remote(xr, xr, xr)[0]
    assert got.is_inference()
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


@pytest.mark.parametrize("back", ["cpu", "to_cpu"])
def test_moving_a_remote_model_back_keeps_its_parameters_and_ties(dev, back):
    """model.cpu() made every module a new Parameter: tied weights came apart (two CPU copies
    trained apart) and an optimizer made before the move no longer moved the model."""
    torch.manual_seed(0)
    m = _TiedLM().to(dev)
    m(torch.tensor([1, 2], device=dev)).sum().backward()
    weight, grad = m.emb.weight, m.emb.weight.grad.cpu()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m.cpu() if back == "cpu" else m.to("cpu")
    assert m.emb.weight is weight and m.head.weight is weight and weight.device.type == "cpu"
    assert weight.grad.device.type == "cpu" and torch.equal(weight.grad, grad)
    before = weight.detach().clone()
    opt.step()  # the optimizer made on the device steps the model's CPU parameters
    torch.testing.assert_close(weight.detach(), before - 0.5 * grad)


def _waits() -> int:
    endpoint, = genie.transport_stats()
    return genie.transport_stats()[endpoint]["blocking_waits"]


def test_moving_a_model_to_the_cpu_reads_its_tensors_together(dev):
    """model.cpu() waited for one round trip per parameter, gradient and buffer, one after
    another (350 for a 50-layer conv net). Now they come together: one wait, the same values."""
    torch.manual_seed(0)
    local = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(6)])
    local[5][0].weight = local[0][0].weight  # tied: one tensor
    remote = copy.deepcopy(local).to(dev)
    x = torch.randn(3, 4)
    local(x).square().sum().backward()
    remote(x.to(dev)).square().sum().backward()
    genie.synchronize()
    before = _waits()
    remote.cpu()
    assert _waits() - before == 1
    assert remote[5][0].weight is remote[0][0].weight
    for (name, got), want in zip(remote.state_dict().items(), local.state_dict().values()):
        assert got.device.type == "cpu", name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for got, want in zip(remote.parameters(), local.parameters()):
        assert got.grad.device.type == "cpu"
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_values_read_ahead_are_not_used_once_ops_were_queued_after_them(dev):
    """A conversion that queues ops (here a write to a buffer read later) gets each tensor's value
    of its own moment, as the one-by-one reads gave it."""
    m = nn.Module()
    m.register_buffer("a", torch.zeros(2))
    m.register_buffer("b", torch.zeros(2))
    m.to(dev)

    def write_b_then_read(t):
        m.b.add_(1)  # m.b is still the remote buffer until its own turn
        return t.cpu()

    m._apply(write_b_then_read)
    assert m.a.tolist() == [0.0, 0.0] and m.b.tolist() == [2.0, 2.0]  # as on the CPU


def _blocks(n):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(n)])


def test_a_loop_reading_a_state_dict_waits_twice(dev):
    """`{k: v.cpu() for k, v in model.state_dict().items()}` waited once per tensor (42 here).
    From its second read in order, the rest comes in windows read ahead: two waits."""
    local = _blocks(6)
    remote = copy.deepcopy(local).to(dev)
    genie.synchronize()
    before = _waits()
    got = {k: v.cpu() for k, v in remote.state_dict().items()}
    assert _waits() - before == 2
    for name, want in local.state_dict().items():
        assert torch.equal(got[name], want), name
    before = _waits()
    got = {k: v.to("cpu") for k, v in remote.state_dict().items()}
    assert _waits() - before == 2
    before = _waits()  # a detach between reads is a view: it writes nothing, and stands for its tensor
    got = {k: v.detach().cpu() for k, v in remote.state_dict().items()}
    assert _waits() - before == 2
    for name, want in local.state_dict().items():
        assert torch.equal(got[name], want), name


def test_reading_a_few_of_a_state_dicts_tensors_fetches_no_more(dev):
    remote = _blocks(6).to(dev)
    genie.synchronize()
    sd = remote.state_dict()
    before = genie.transport_stats()
    sd["3.0.weight"].cpu()  # one read: nothing ahead
    sd["2.0.weight"].cpu()  # an earlier one: still not in order
    after = genie.transport_stats()
    endpoint, = after
    assert after[endpoint]["blocking_waits"] - before[endpoint]["blocking_waits"] == 2
    assert after[endpoint]["bytes_received"] - before[endpoint]["bytes_received"] < 2048


def test_a_state_dict_read_in_order_gets_the_values_of_its_moment(dev):
    """Values read ahead are not used once an op was queued on the device after them."""
    remote = _blocks(3).to(dev)
    sd = remote.state_dict()
    first = sd["0.0.weight"].cpu()
    second = sd["0.0.bias"].cpu()  # in order: what follows is read ahead now
    remote[2][0].weight.data.fill_(7.0)  # an op queued after that read
    rest = {k: v.cpu() for k, v in list(sd.items())[2:]}
    assert torch.equal(rest["2.0.weight"], torch.full((4, 4), 7.0))
    assert first.shape == (4, 4) and second.shape == (4,)


def test_moving_a_model_while_an_earlier_graph_is_alive(dev):
    """model.to(dev) failed ("_apply(): Couldn't swap ...") while the autograd graph of an earlier
    CPU forward was alive. Now it moves (the parameters keep their identity and the tie), and that
    stale graph's backward raises instead of putting gradients on tensors the model no longer has."""
    torch.manual_seed(0)
    m = _TiedLM()
    ids = torch.tensor([1, 2, 3])
    stale = m(ids).sum()
    expected = m(ids).detach()
    weight = m.emb.weight
    m.to(dev)
    assert m.emb.weight is weight and m.head.weight is weight and weight.device.type == "remote_accelerator"
    torch.testing.assert_close(m(ids.to(dev)).cpu(), expected)
    with pytest.raises(RuntimeError, match="poisoned|built before its parameter moved"):
        stale.backward()
    remote_stale = m(ids.to(dev)).sum()  # and back: a graph on the device alive during .cpu()
    m.cpu()
    assert m.emb.weight is weight and weight.device.type == "cpu"
    torch.testing.assert_close(m(ids).detach(), expected)
    with pytest.raises(RuntimeError, match="poisoned|built before its parameter moved"):
        remote_stale.backward()


def test_moving_a_model_torch_export_has_seen(dev):
    """torch.export leaves weak references on the parameters of the model it exported (its fake
    tensor caches), and swap_tensors refuses those: moving the model failed ("Couldn't swap
    Linear.weight"). Now the model and the exported program's module move, the parameters keep
    their identity, and the model exports again after coming back."""
    import weakref

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = m(x)
        exported = torch.export.export(m, (x,))
        assert weakref.getweakrefs(m[0].weight)  # what made the swap refuse
        weight = m[0].weight
        m.to(dev)
        assert m[0].weight is weight and weight.device.type == "remote_accelerator"
        torch.testing.assert_close(m(x.to(dev)).cpu(), expected)
        torch.testing.assert_close(exported.module().to(dev)(x.to(dev)).cpu(), expected)
        m.cpu()
        assert m[0].weight is weight
        torch.testing.assert_close(torch.export.export(m, (x,)).module()(x), expected)


def test_multihead_attention_moves_after_a_cpu_forward(dev):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    out, weights = m(x, x, x, need_weights=True)  # its graph holds the output projection's weight
    m.to(dev)
    xr = x.to(dev)
    got, got_weights = m(xr, xr, xr, need_weights=True)
    torch.testing.assert_close(got.cpu(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_weights.cpu(), weights, rtol=1e-4, atol=1e-5)


def test_cpu_only_conversions_keep_pytorchs_behaviour():
    """Only modules holding remote parameters convert by swapping."""
    m = nn.Linear(3, 3)
    stale = m(torch.randn(2, 3, requires_grad=True)).sum()
    weight = m.weight
    m.double()
    assert m.weight is weight and not torch.__future__.get_swap_module_params_on_conversion()
    stale.backward()  # as in PyTorch: `param.data = new`, the old graph still runs


@pytest.mark.parametrize("back", [False, True], ids=["to_device", "back_to_cpu"])
def test_hooks_and_attributes_of_parameters_survive_a_move(dev, back):
    """register_hook / register_post_accumulate_grad_hook live on the C++ tensor, which a swap
    replaces: after model.to(dev) (and back) they no longer ran; on CUDA they do. Attributes set on
    a parameter (as libraries mark parameters for their optimizers) were lost the same way."""
    m = nn.Linear(3, 1)
    if back:
        m.to(dev)
    m.weight.no_weight_decay = True
    calls = []
    m.weight.register_hook(lambda g: calls.append("grad") or g * 2)
    m.weight.register_post_accumulate_grad_hook(lambda p: calls.append("accumulated"))
    m.to("cpu" if back else dev)
    x = torch.ones(2, 3, device=m.weight.device)
    m(x).sum().backward()
    assert calls == ["grad", "accumulated"]
    assert m.weight.no_weight_decay is True and isinstance(m.weight, nn.Parameter)
    torch.testing.assert_close(m.weight.grad.cpu(), torch.full((1, 3), 4.0))  # 2 rows of ones, doubled


def test_lazy_modules_move_before_their_first_forward(dev):
    """nn.LazyLinear & co.: .to(dev) failed ("Can't access the shape of an uninitialized parameter").
    Their parameters are made by the first forward and then moved, as the module was asked."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d(), nn.ReLU(), nn.LazyLinear(2))

    x = torch.randn(6, 5)
    expected = make()(x)
    m = make().to(dev)
    got = m(x.to(dev))
    assert type(m[0]) is nn.Linear and type(m[1]) is nn.BatchNorm1d
    for t in [*m.parameters(), *m.buffers()]:
        assert t.device.type == "remote_accelerator"
    torch.testing.assert_close(got.cpu(), expected.detach(), rtol=1e-4, atol=1e-5)  # made alike on the CPU
    got.sum().backward()
    assert m[0].weight.grad.device.type == "remote_accelerator" and m[1].num_batches_tracked.item() == 1
    assert not m[0]._forward_pre_hooks and "_genie_after_init" not in m[0].__dict__
    half = nn.LazyLinear(3).to(dev).half()  # conversions before the first forward apply in order
    assert half(torch.randn(2, 4, device=dev).half()).dtype == torch.float16
    assert half.weight.dtype == torch.float16 and half.weight.device.type == "remote_accelerator"
