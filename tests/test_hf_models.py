"""Hugging Face transformers models, as users run them, on remote_accelerator.

Small random-initialised configurations of four families (one a mixture of experts) (no weights are downloaded): the
forward pass with a padding mask, greedy generate() (its KV cache and mask handling), and
training steps with AdamW, each against the same model on the CPU."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[test]')")


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=1))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=100, bos_token_id=0, eos_token_id=1))


def _mixtral():  # mixture of experts: torch._grouped_mm, and histc of int32 expert ids off the CPU
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=100, num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=1))


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100,
        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 100, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding, as batched generation uses
    return ids, mask


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("make", [_gpt2, _llama, _mixtral], ids=["gpt2", "llama", "mixtral"])
def test_causal_lm_forward_and_generate_match_cpu(dev, make):
    torch.manual_seed(0)
    model = make().eval()
    _forward_and_generate_match(model, copy.deepcopy(model).to(dev), dev)


def _forward_and_generate_match(model, remote, dev, new_tokens=6):
    ids, mask = _inputs()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = remote(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    generated = remote.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(generated.cpu(), expected)


@pytest.mark.parametrize("make, labels", [(_llama, None), (_mixtral, None), (_bert, torch.tensor([0, 2]))],
                         ids=["llama", "mixtral", "bert"])
def test_training_steps_match_cpu(dev, make, labels):
    torch.manual_seed(0)
    model = make()
    remote = copy.deepcopy(model).to(dev)
    ids, mask = _inputs()
    labels = ids if labels is None else labels
    optimizers = torch.optim.AdamW(model.parameters(), 1e-2), torch.optim.AdamW(remote.parameters(), 1e-2)
    for _ in range(2):
        for m, opt, device in ((model, optimizers[0], "cpu"), (remote, optimizers[1], dev)):
            opt.zero_grad()
            loss = m(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
            loss.backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), remote.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-4, rtol=1e-3, msg=name)


def test_llama_with_flex_attention_matches_cpu_and_trains_as_sdpa(dev):
    """attn_implementation="flex_attention": Hugging Face builds its block mask with a compiled
    create_block_mask on the model's device and calls flex_attention, both refused for a remote
    device before. Forward and generate as the CPU's flex_attention (padding mask included); one
    training step's gradients as SDPA's (flex_attention has no backward on the CPU)."""
    torch.manual_seed(0)
    model = _llama()
    model.config._attn_implementation = "flex_attention"
    model.eval()
    remote = copy.deepcopy(model).to(dev)
    _forward_and_generate_match(model, remote, dev, new_tokens=4)
    model.config._attn_implementation = "sdpa"
    ids, _ = _inputs()
    for m, device in ((model, "cpu"), (remote, dev)):
        m.train()
        m(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()
    for (name, p), q in zip(model.named_parameters(), remote.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_llama_decode_step_recorded_with_a_static_cache_and_replayed(dev):
    """The README's recipe: prefill op by op into a transformers StaticCache, record one decode
    step with genie.graph, replay it per token; the tokens are greedy generate()'s on the CPU."""
    import genie

    torch.manual_seed(0)
    model = _llama().eval()
    remote = copy.deepcopy(model).to(dev)
    ids, _ = _inputs()
    ids = ids[:1]
    new_tokens = 8
    expected = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    length = ids.shape[1]
    with torch.no_grad():
        cache = transformers.StaticCache(config=remote.config, max_cache_len=32)
        out = remote(input_ids=ids.to(dev), past_key_values=cache, cache_position=torch.arange(length, device=dev))
        token = out.logits[:, -1:].argmax(-1)
        tokens = [token.item()]
        position = torch.tensor([length], device=dev)
        step = genie.Graph()
        with genie.graph(step):
            out = remote(input_ids=token, past_key_values=cache, cache_position=position)
            token.copy_(out.logits[:, -1:].argmax(-1))
            position.add_(1)
        tokens.append(token.item())
        for _ in range(new_tokens - 2):
            step.replay()
            tokens.append(token.item())
    assert tokens == expected[0, length:].tolist()


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2-tied-embeddings", "llama"])
def test_save_pretrained_of_a_remote_model_round_trips(dev, make, tmp_path):
    """save_pretrained reads storages' data_ptr() to find tied weights (it raised for remote
    tensors); the saved file loads back to the same weights, tied ones tied."""
    torch.manual_seed(0)
    model = make()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(dev).save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert set(loaded.state_dict()) == set(expected)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    if make is _gpt2:
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_storage_identity_of_remote_tensors(dev, tmp_path):
    from safetensors.torch import load_file, save_file

    a, b = torch.randn(4, device=dev), torch.randn(4, device=dev)
    first = a.untyped_storage().data_ptr()
    assert first != 0 and a.untyped_storage().data_ptr() == first and a.storage().data_ptr() == first
    assert b.untyped_storage().data_ptr() != first
    with pytest.raises(RuntimeError):
        a.untyped_storage().cpu()  # still no memory to read through
    path = str(tmp_path / "ab.safetensors")
    save_file({"a": a, "b": b}, path)
    back = load_file(path)
    torch.testing.assert_close(back["a"], a.cpu(), rtol=0, atol=0)
