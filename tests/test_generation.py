"""The static-cache generation path (utils.generation) and the hybrid-engine decision (step 3).

Token-identity with ``model.generate`` on CPU (fp32): left-padded prompts of different
lengths, EOS in the middle of a batch, LoRA on and off, early stop, batches smaller than
the allocated one; seeded sampling; the inverse-CDF draw and ``model.generate`` sampling through it (the
distribution it draws from); the exact LoRA restore; the backend choice.
"""
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM

from utils.generation import (GenerationCopy, StaticGenerator, choose_backend, generate_kwargs, lora_fused,
                              sample_categorical, uncached_autocast)
from utils.model.model_utils import load_hf_tokenizer
from utils.model.tiny import resolve_model_path
from utils.lora import LinearLayer_LoRA, convert_linear_layer_to_lora

P, A = 10, 12


def _model(name, lora=False):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name)).eval()
    if lora:
        convert_linear_layer_to_lora(model, "layers.", 4)
        with torch.no_grad():  # a non-zero update, so LoRA changes the answers
            for m in model.modules():
                if isinstance(m, LinearLayer_LoRA):
                    m.lora_left_weight.normal_(0, 0.5)
    return model, load_hf_tokenizer(name)


def _prompts(pad, rows=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 600, (rows, P), generator=g)
    mask = torch.ones(rows, P, dtype=torch.long)
    for row, n in enumerate([0, 3, 7, 1, 5, 2][:rows]):  # left padding of different lengths
        ids[row, :n], mask[row, :n] = pad, 0
    return ids, mask


def _hf(model, ids, mask, eos, pad, **kw):
    kw = kw or dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    return model.generate(ids, attention_mask=mask, max_new_tokens=A, pad_token_id=pad, eos_token_id=eos, **kw)


def _padded(seq, pad):
    return torch.cat([seq, seq.new_full((seq.shape[0], P + A - seq.shape[1]), pad)], dim=1)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
@pytest.mark.parametrize("lora", [False, True])
def test_greedy_is_token_identical_to_generate_with_eos_mid_batch(name, lora):
    model, tok = _model(name, lora)
    pad = tok.pad_token_id
    ids, mask = _prompts(pad)
    # make the token row 0 emits 4th the "EOS", so some rows end mid-answer and others run on
    free = _hf(model, ids, mask, eos=None, pad=pad)
    eos = int(free[0, P + 3])
    reference = _hf(model, ids, mask, eos=eos, pad=pad)
    ended = (reference[:, P:] == eos).any(dim=1)
    assert ended[0] and reference.shape[1] <= P + A
    out = StaticGenerator(model, P + 2, A, eos, pad, use_cuda_graph=False).generate(ids, mask)
    assert torch.equal(_padded(out, pad), _padded(reference, pad))
    # after its EOS a row holds only pad ids
    first = (out[0, P:] == eos).nonzero()[0].item()
    assert (out[0, P + first + 1:] == pad).all()


def test_several_end_tokens_stop_a_row_at_the_first_of_them_as_generate_does():
    """--add_eot_token: an answer ends at the EOT or at the EOS, whichever the model emits first."""
    model, tok = _model("tiny-llama")
    pad = tok.pad_token_id
    ids, mask = _prompts(pad)
    free = _hf(model, ids, mask, eos=None, pad=pad)
    ends = [int(free[0, P + 3]), int(free[1, P + 2])]  # row 0's 4th and row 1's 3rd answer tokens end answers
    reference = _hf(model, ids, mask, eos=ends, pad=pad)
    out = StaticGenerator(model, P, A, tuple(ends), pad, use_cuda_graph=False).generate(ids, mask)
    assert torch.equal(_padded(out, pad), _padded(reference, pad))
    ended = torch.isin(out[:, P:], torch.tensor(ends)).any(dim=1)
    assert ended[0] and ended[1]


def test_stops_early_when_every_row_ended_and_reuses_its_buffers():
    model, tok = _model("tiny-opt")
    pad = tok.pad_token_id
    ids, mask = _prompts(pad)
    free = _hf(model, ids, mask, eos=None, pad=pad)
    eos = int(free[0, P])  # row 0's first answer token is the "EOS": row 0 ends at once
    gen = StaticGenerator(model, P, A, eos, pad, use_cuda_graph=False, check_every=2)
    out = gen.generate(ids[:1].expand(4, P), mask[:1].expand(4, P))  # 4 copies of row 0: all end at once
    assert out.shape[1] == P + 2  # the end is noticed at the first check (every 2 tokens), not after A
    assert (out[:, P] == eos).all() and (out[:, P + 1] == pad).all()
    # a smaller batch than the allocated one: padded to it internally, same answers as model.generate
    reference = _hf(model, ids[:3], mask[:3], eos=eos, pad=pad)
    assert torch.equal(_padded(gen.generate(ids[:3], mask[:3]), pad), _padded(reference, pad))
    assert gen.batch_size == 4


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model, tok = _model("tiny-llama")
    pad = tok.pad_token_id
    ids, mask = _prompts(pad)
    gen = StaticGenerator(model, P, A, -1, pad, use_cuda_graph=False)

    def sample(seed, **kw):
        return gen.generate(ids, mask, do_sample=True, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(3, temperature=1.5), sample(3, temperature=1.5))
    assert not torch.equal(sample(3, temperature=1.5), sample(4, temperature=1.5))
    assert torch.equal(sample(5, top_k=1), gen.generate(ids, mask))  # top-1 sampling = greedy
    # top_p: a tiny nucleus keeps only the most likely token, whatever the seed
    assert torch.equal(sample(6, top_p=1e-6), gen.generate(ids, mask))


def test_sample_categorical_draws_each_token_at_its_probability_and_never_a_zero_one(monkeypatch):
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 2.0, 0.0, 2.0]])  # rows need not sum to 1
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_categorical(probs, g) for _ in range(20000)])  # [n, 2]
    freq0 = torch.bincount(draws[:, 0], minlength=4) / len(draws)
    freq1 = torch.bincount(draws[:, 1], minlength=4) / len(draws)
    assert torch.allclose(freq0, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.01) and freq0[1] == 0
    assert torch.allclose(freq1, torch.tensor([0.0, 0.5, 0.0, 0.5]), atol=0.01) and freq1[0] == freq1[2] == 0
    # a uniform number that rounds up to the row's total lands on the last token with a chance, not past it
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw.get("dtype")))
    assert sample_categorical(torch.tensor([[0.5, 0.5, 0.0, 0.0]])).tolist() == [1]


@pytest.mark.parametrize("kw, expected", [
    (dict(temperature=0.5), [0.49 / 0.54, 0.04 / 0.54, 0.01 / 0.54, 0.0]),  # p² renormalised
    (dict(temperature=1.0, top_k=2), [0.7 / 0.9, 0.2 / 0.9, 0.0, 0.0]),
    (dict(temperature=1.0, top_p=0.75), [0.7 / 0.9, 0.2 / 0.9, 0.0, 0.0]),  # the nucleus 0.7 + 0.2 covers 0.75
])
def test_the_sampling_processor_draws_from_the_warped_distribution(kw, expected):
    """``CategoricalSampling`` (what ``generate_kwargs(True, …)`` hands ``model.generate``): the drawn token keeps
    score 0 and every other −inf, at the frequencies of the warped softmax (20 000 identical rows)."""
    scores = torch.tensor([0.7, 0.2, 0.1, 0.0]).log().expand(20000, 4).contiguous()
    torch.manual_seed(0)
    out = generate_kwargs(True, **kw)["logits_processor"](None, scores)
    assert ((out == 0).sum(dim=1) == 1).all() and ((out == 0) | (out == -float("inf"))).all()
    freq = (out == 0).float().mean(dim=0)
    assert torch.allclose(freq, torch.tensor(expected), atol=0.01), freq


def test_generate_samples_through_the_processor_seeded_and_top_k_1_is_greedy():
    model, tok = _model("tiny-llama")
    pad = tok.pad_token_id
    ids, mask = _prompts(pad)
    assert generate_kwargs(False) == dict(do_sample=False, temperature=None, top_k=None, top_p=None)

    def sample(seed, **kw):
        torch.manual_seed(seed)
        return model.generate(ids, attention_mask=mask, max_new_tokens=A, pad_token_id=pad,
                              **generate_kwargs(True, **kw))

    assert torch.equal(sample(1, temperature=2.0), sample(1, temperature=2.0))
    assert not torch.equal(sample(1, temperature=2.0), sample(2, temperature=2.0))
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=A, pad_token_id=pad, **generate_kwargs(False))
    assert torch.equal(sample(3, temperature=1.0, top_k=1), greedy)


def test_lora_fuse_restores_the_base_weights_bit_for_bit_in_bf16():
    model, _ = _model("tiny-opt", lora=True)
    model.to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, LinearLayer_LoRA)]
    before = [m.weight.detach().clone() for m in layers]
    pointers = [m.weight.data_ptr() for m in layers]
    with lora_fused(model):
        assert all(m.fuse_lora for m in layers)
        assert any(not torch.equal(m.weight, b) for m, b in zip(layers, before))
    assert all(torch.equal(m.weight, b) for m, b in zip(layers, before))  # fuse -> unfuse would drift in bf16
    assert [m.weight.data_ptr() for m in layers] == pointers  # in place: a captured CUDA graph stays valid
    assert not any(m.fuse_lora for m in layers)


def test_generation_copy_casts_the_weights_keeps_buffers_and_ties_and_follows_in_place_updates():
    """--generation_dtype bf16: the copy's parameters are the actor's cast to bf16 (after an optimizer-like in-place
    update too, once refreshed, in the same storage), its buffers (the rotary table) are untouched, a tied embedding
    stays one tensor, a hook on the actor (a training engine's) is not copied, and the actor is left as it was."""
    model, tokenizer = _model("tiny-llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    engine_calls = []  # DeepSpeed's engine hooks its forward timers onto the model it wraps
    model.register_forward_pre_hook(lambda module, args: engine_calls.append(module))
    copy = GenerationCopy(model, torch.bfloat16)
    named = dict(copy.module.named_parameters())
    assert named and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in named.values())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert copy.module.lm_head.weight is copy.module.model.embed_tokens.weight
    for (name, buffer), (_, original) in zip(copy.module.named_buffers(), model.named_buffers(), strict=True):
        assert buffer.dtype == original.dtype and torch.equal(buffer, original), name
    storage = {name: p.data_ptr() for name, p in named.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    copy.refresh()
    for (name, p), original in zip(copy.module.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, original.to(torch.bfloat16)), name
        assert p.data_ptr() == storage[name], name  # in place: a graph captured on the copy stays valid
    ids, mask = _prompts(tokenizer.pad_token_id)
    with torch.no_grad():
        fp32_logits = model(ids, attention_mask=mask).logits
        for p in model.parameters():  # the actor's own parameters cast to bf16, its buffers kept: the copy's logits
            p.data = p.data.to(torch.bfloat16)
        engine_calls.clear()
        logits = copy.module(ids, attention_mask=mask).logits
        assert engine_calls == []  # the copy's forward does not call into the engine
        assert torch.equal(logits, model(ids, attention_mask=mask).logits) and engine_calls == [model]
    assert logits.dtype == torch.bfloat16 and not torch.equal(logits.float(), fp32_logits)  # bf16 is not fp32


def test_choose_backend():
    model, _ = _model("tiny-opt")
    assert choose_backend("hf", model) == ("hf", None)
    backend, why = choose_backend("auto", model)
    assert backend == "hf" and "no CUDA device" in why  # the CPU default
    backend, why = choose_backend("cuda-graph", model)
    assert backend == "static" and "CUDA graphs need a CUDA device" in why
    assert choose_backend("static", model) == ("static", None)
    assert choose_backend("static", model, zero_stage=3) == ("static", None)  # whole weights: a ZeRO-3 actor's copy
    next(model.parameters()).ds_id = 0  # as DeepSpeed marks a ZeRO-3 partition
    backend, why = choose_backend("static", model, zero_stage=3)
    assert backend == "hf" and "ZeRO-3" in why
    del next(model.parameters()).ds_id
    model.config.model_type = "gpt2"
    backend, why = choose_backend("static", model)
    assert backend == "hf" and "'gpt2'" in why
    with pytest.raises(ValueError):
        choose_backend("vllm", model)


# --------------------------------------------------------------------------- the hybrid engine decision

def test_hybrid_engine_has_no_policy_for_transformers_5_layers():
    from step3_rlhf_finetuning.rlhf_engine import hybrid_engine_support

    for name, layer in (("tiny-opt", "OPTDecoderLayer"), ("tiny-llama", "LlamaDecoderLayer")):
        usable, why = hybrid_engine_support(_model(name)[0])
        assert not usable and layer in why and "legacy tuple KV cache" in why


def test_cache_api_is_recognised_under_each_transformers_naming():
    # transformers 5.24 renamed the layers' ``past_key_values`` to ``cache`` (the decision crashed-open:
    # "usable" for OPT and Llama); a transformers 5 layer takes the Cache API whatever its parameters' names
    from step3_rlhf_finetuning.rlhf_engine import takes_cache_api

    def layer(module, *params):
        """A layer class defined in ``module`` whose forward takes ``hidden_states`` and ``params``."""
        def forward(self, hidden_states, **kwargs):
            return hidden_states

        forward.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in ("self", "hidden_states", *params)])
        return type("Layer", (torch.nn.Module,), {"__module__": module, "forward": forward})

    for names in (["past_key_values"], ["cache_position"], ["cache"]):
        assert takes_cache_api(layer("my_models", *names))
    assert not takes_cache_api(layer("my_models", "layer_past", "use_cache"))  # the legacy tuple cache
    assert takes_cache_api(layer("transformers.models.x.modeling_x", "kv_state"))  # any transformers >= 5 layer
    assert not takes_cache_api(layer("transformers_like", "layer_past"))


def test_cache_keyword_follows_the_installed_transformers():
    from utils.model.model_utils import cache_kwarg

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return input_ids

    assert cache_kwarg(New()) == "cache" and cache_kwarg(Old()) == "past_key_values"
    model = _model("tiny-opt")[0]
    assert cache_kwarg(model) in inspect.signature(model.forward).parameters  # not a deprecated alias


def test_hybrid_engine_is_used_where_a_legacy_layer_has_a_policy(monkeypatch):
    import deepspeed.module_inject.replace_policy as rp

    from step3_rlhf_finetuning.rlhf_engine import hybrid_engine_support

    class LegacyLayer(torch.nn.Module):
        def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
            return hidden_states

    class LegacyPolicy:
        _orig_layer_class = None

        def __init__(self, client_module):
            LegacyPolicy._orig_layer_class = LegacyLayer

    monkeypatch.setattr(rp, "replace_policies", [LegacyPolicy])
    usable, why = hybrid_engine_support(torch.nn.Sequential(LegacyLayer()))
    assert usable and "LegacyPolicy" in why
    usable, why = hybrid_engine_support(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert not usable and "no inference policy" in why


def test_trainer_generates_with_the_module_generate_under_an_active_hybrid_engine():
    # DeepSpeed's hybrid engine replaces module.generate; the engine object itself has no usable
    # generate when no policy applied (the GPU crash: "'DeepSpeedHybridEngine' object has no attribute
    # '_generate'"). The trainer must call the module's, as DeepSpeed-Chat does.
    from step3_rlhf_finetuning.config import GenerationConfig, PPOConfig
    from step3_rlhf_finetuning.ppo_trainer import DeepSpeedPPOTrainer
    from tests.test_ppo_trainer import EOS, PROMPT_MASK, PROMPTS, make_trainer

    _, engine = make_trainer([[3, 4, EOS], [3, 4, 5], [4, 3, EOS]], scores=[1.0, 2.0, 3.0])
    engine.hybrid_engine_active = True
    trainer = DeepSpeedPPOTrainer(engine, PPOConfig(), GenerationConfig(max_answer_seq_len=4))
    assert trainer.generation_backend == "hybrid-engine" and trainer.generator is None
    assert not hasattr(engine.actor, "generate")  # like the engine in the crash
    exp = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    assert exp.input_ids[0].tolist()[:6] == [5, 6, 7, 3, 4, EOS]


def test_uncached_autocast_sees_in_place_weight_updates_and_keeps_the_active_setting():
    """The CUDA graph's capture context (StaticGenerator._capture), on the CPU's autocast: the cache it turns off is
    the one that hides an in-place update of a weight from the next forward."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = linear(x)
        with torch.no_grad():
            linear.weight.add_(1.0)
        assert torch.equal(linear(x), before)  # autocast's cached bf16 weight: the update is not seen
        with uncached_autocast("cpu"):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert not torch.is_autocast_cache_enabled()
            fresh = linear(x)
            assert fresh.dtype == torch.bfloat16 and not torch.equal(fresh, before)
            with torch.no_grad():
                linear.weight.add_(1.0)
            assert not torch.equal(linear(x), fresh)  # every forward casts the weights as they are now
    with uncached_autocast("cpu"):  # no autocast active: none switched on
        assert not torch.is_autocast_enabled("cpu") and linear(x).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_under_autocast_follows_the_weights_updates():
    """``--torch_autocast`` on a GPU: each generation runs in its own autocast context, and the actor's fp32 weights
    change in place between them. A graph captured over autocast's cached bf16 casts would replay the first
    context's freed casts (seen on an H200: an out-of-range token at the second RL step); it must record the casts."""
    model, tok = _model("tiny-llama")
    model = model.cuda()
    pad, eos = tok.pad_token_id, -1
    ids, mask = (t.cuda() for t in _prompts(pad))
    graph = StaticGenerator(model, P, A, eos, pad, use_cuda_graph=True)
    eager = StaticGenerator(model, P, A, eos, pad, use_cuda_graph=False)
    for update in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, expected = graph.generate(ids, mask), eager.generate(ids, mask)
        assert torch.equal(out, expected), f"after {update} weight update(s)"
        with torch.no_grad():  # an optimizer step: the same tensors, new values
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
