"""The fused Llama decode step (utils/model/fused_decode.py) and what CI keeps of "generation near the hardware".

On a GPU the decode step replayed from a CUDA graph is bound by its kernel count; a host synchronisation stalls
the CPU until the GPU drains. Both are counted here on the CPU (utils/op_count.py), for the fused step and the
model's own forward: the aten ops of one decode step per layer, and the host synchronisations per generated token.
Also: the fused step's logits equal the forward's (GQA, llama3 RoPE scaling, tied embeddings), greedy decoding
through it equals ``model.generate`` token for token in fp32, its weights follow in-place updates, the fallback to
the forward says why in one line, and the optional ``torch.compile`` falls back to the eager step on a failure.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from utils.generation import StaticGenerator
from utils.model import fused_decode
from utils.op_count import OpCounter

PAD, P, A = 0, 6, 10


def _llama(layers=2, seed=0, **overrides):
    """A random Llama of SmolLM2's kind: grouped-query attention (4 query heads on 2 KV heads), tied embeddings,
    llama3 RoPE scaling (as Llama 3.2), in fp32, eval mode."""
    config = dict(vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64, tie_word_embeddings=True,
                  pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
                  rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=16))
    config.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**config)).eval()


def _prompts(rows=4, vocab=128):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, P), generator=g)
    mask = torch.ones(rows, P, dtype=torch.long)
    for row, n in enumerate([0, 2, 5, 1][:rows]):  # left padding of different lengths
        ids[row, :n], mask[row, :n] = PAD, 0
    return ids, mask


def _generator(model, decode="auto", **kw):
    logs = []
    gen = StaticGenerator(model, P, A, -1, PAD, use_cuda_graph=False, decode=decode, log=logs.append, **kw)
    return gen, logs


def _step_logits(gen, ids, mask, tokens) -> list:
    """The logits of decode steps fed ``tokens [steps, B]`` after the prefill of ``ids``, through ``gen``'s
    current decode path."""
    P_ = ids.shape[1]
    with torch.no_grad():
        gen._reset_cache()
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        gen.model(input_ids=ids, attention_mask=mask, position_ids=positions, **{gen.cache_kwarg: gen.cache},
                  use_cache=True)
        gen.mask.zero_()
        gen.mask[:, 0, 0, :P_] = mask.bool()
        gen.pos.copy_(positions[:, -1:])
        if gen.decode_path == "fused":
            gen.fused.start(P_)
        logits = []
        for t, token in enumerate(tokens):
            gen.tok.copy_(token[:, None])
            gen.pos.add_(1)
            gen.mask[:, 0, 0, P_ + t] = True
            logits.append(gen._decode_forward().clone())
    return logits


def _tokens(steps=4, rows=4):
    return torch.randint(3, 128, (steps, rows), generator=torch.Generator().manual_seed(2))


def _decode_logits_both_ways(model, ids, mask):
    """The logits of 4 decode steps after the prefill, through the fused step and the model's forward."""
    results = {}
    for decode in ("forward", "auto"):
        gen, _ = _generator(model, decode)
        gen.generate(ids, mask)  # allocates, chooses the path
        assert gen.decode_path == ("fused" if decode == "auto" else "forward")
        results[decode] = _step_logits(gen, ids, mask, _tokens())
    return results["auto"], results["forward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_logits_equal_the_forward_with_gqa_llama3_rope_and_tied_embeddings(dtype):
    """fp32: equal up to float rounding; bf16: within its rounding (a bf16 step at 4 is 0.03; the fused step rounds
    fewer intermediates: the norms, the rotary and the residual adds are computed in one op each)."""
    model = _llama().to(dtype)
    assert fused_decode.unsupported(model) is None
    fused, forward = _decode_logits_both_ways(model, *_prompts())
    tolerance = 1e-5 if dtype == torch.float32 else 0.15
    for t, (a, b) in enumerate(zip(fused, forward)):
        assert a.shape == b.shape == (4, 128) and a.dtype == b.dtype == dtype
        assert torch.allclose(a.float(), b.float(), atol=tolerance, rtol=tolerance), (t, (a - b).abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_o_proj_read_in_sdpas_grouped_layout_gives_the_same_logits():
    """CUDA's SDPA kernels return ``[B, Hk, G, D]`` laid out as ``[B, G, Hk, D]``; the step then reads it as it lies
    with ``o_proj``'s columns permuted (the CPU's layout is plain, so the permuted branch is forced here)."""
    model = _llama(num_attention_heads=8, num_key_value_heads=2, head_dim=16)  # G = 4
    ids, mask = _prompts()
    gen, _ = _generator(model)
    gen.generate(ids, mask)
    plain = _step_logits(gen, ids, mask, _tokens())
    assert not gen.fused.grouped_output  # the CPU's layout
    gen.fused = fused_decode.LlamaDecodeStep(model, gen.cache, gen.batch_size, gen.total, grouped_output=True)
    grouped = _step_logits(gen, ids, mask, _tokens())
    forward = _decode_logits_both_ways(model, ids, mask)[1]
    for a, b, c in zip(plain, grouped, forward):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5) and torch.allclose(b, c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sample", [False, True])
def test_fused_greedy_equals_generate_and_sampling_keeps_the_seeded_draws(sample):
    """fp32: the fused path's greedy answers are ``model.generate``'s, token for token; sampling draws the same
    tokens from the same generator as the forward path (the same logits, the same draws)."""
    model = _llama(layers=3)
    ids, mask = _prompts()
    gen, logs = _generator(model)
    if sample:
        kw = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
        out = gen.generate(ids, mask, generator=torch.Generator().manual_seed(7), **kw)
        reference = _generator(model, "forward")[0].generate(ids, mask, generator=torch.Generator().manual_seed(7),
                                                            **kw)
    else:
        out = gen.generate(ids, mask)
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=A, pad_token_id=PAD, eos_token_id=None,
                                   do_sample=False, temperature=None, top_k=None, top_p=None)
    assert gen.decode_path == "fused" and logs == [
        "generation: decode step: the fused Llama step (one q/k/v and one gate/up matmul a layer, fused RMSNorm, "
        "rotary from a table, utils/model/fused_decode.py)"]
    assert torch.equal(out, reference)


def test_fused_weights_follow_in_place_updates_in_the_same_storage():
    """An optimizer step changes the actor's weights in place between generations: the concatenated q/k/v and
    gate/up copies are refreshed in place (a CUDA graph captured on them stays valid) and the answers follow."""
    model = _llama()
    ids, mask = _prompts()
    gen, _ = _generator(model)
    before = gen.generate(ids, mask)
    pointers = [w.data_ptr() for w in gen.fused.qkv + gen.fused.gate_up]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    after = gen.generate(ids, mask)
    assert [w.data_ptr() for w in gen.fused.qkv + gen.fused.gate_up] == pointers
    assert not torch.equal(after, before)
    assert torch.equal(after, _generator(model, "forward")[0].generate(ids, mask))


def test_the_forward_runs_where_the_fused_step_cannot_and_says_why_once():
    model = _llama()
    ids, mask = _prompts()
    gen, logs = _generator(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # --torch_autocast without a generation copy
        gen.generate(ids, mask)
        gen.generate(ids, mask)
    assert gen.decode_path == "forward"
    assert logs == ["generation: decode step: the model's own forward (not the fused step: autocast is on "
                    "(generate from a --generation_dtype bf16 copy for the fused step))"]

    assert "'opt'" in fused_decode.unsupported(type("M", (), {"config": type("C", (), {"model_type": "opt"})})())
    assert "biases" in fused_decode.unsupported(_llama(attention_bias=True))
    assert "'gelu'" in fused_decode.unsupported(_llama(hidden_act="gelu"))
    assert "'dynamic'" in fused_decode.unsupported(
        _llama(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)))
    partitioned = _llama()
    partitioned.model.layers[1].mlp.up_proj.weight.data = torch.empty(0)  # a ZeRO-3 partition's placeholder
    assert "partitioned" in fused_decode.unsupported(partitioned)
    mixed = _llama()
    mixed.model.norm.weight.data = mixed.model.norm.weight.data.double()
    assert "several dtypes (float32, float64)" in fused_decode.unsupported(mixed)
    peft_like = _llama()
    peft_like.model.layers[0].self_attn.q_proj = torch.nn.Sequential(peft_like.model.layers[0].self_attn.q_proj)
    assert "Sequential" in fused_decode.unsupported(peft_like)
    gen, logs = _generator(_llama(attention_bias=True))
    gen.generate(ids, mask)
    assert gen.decode_path == "forward" and logs == [
        "generation: decode step: the model's own forward (not the fused step: attention or MLP biases)"]


def test_compiled_fused_step_and_its_fallback():
    """``compile_decode``: the compiled step (the CPU's ``eager`` compiler backend here; inductor on a GPU) gives the
    same answers; a compiler that fails leaves one line and the eager fused step."""
    model = _llama()
    ids, mask = _prompts()
    reference = _generator(model)[0].generate(ids, mask)
    gen, logs = _generator(model, compile_decode=True, compile_backend="eager")
    assert torch.equal(gen.generate(ids, mask), reference) and gen._compiled is not None
    assert len(logs) == 1 and logs[0].endswith(", torch.compile'd")
    gen, logs = _generator(model, compile_decode=True, compile_backend="no-such-backend")
    assert torch.equal(gen.generate(ids, mask), reference) and gen._compiled is None
    assert logs[1].startswith("generation: torch.compile of the fused decode step failed (InvalidBackend: ")
    assert logs[1].endswith("decoding with the eager fused step")


# --------------------------------------------------------------------------- ops per decode step, syncs per token

def _step_ops(model, decode) -> OpCounter:
    gen, _ = _generator(model, decode)
    ids, mask = _prompts()
    gen.generate(ids, mask)  # allocates the cache, chooses the path, leaves the cache filled
    with torch.no_grad(), OpCounter() as ops:
        gen._decode_forward()
    assert gen.decode_path == ("fused" if decode == "auto" else "forward")
    return ops


def _per_layer(decode) -> tuple[float, int]:
    """(aten ops that launch work per layer, ops outside the layers) of one decode step: from 2- and 4-layer
    models (the difference is two layers)."""
    two, four = (_step_ops(_llama(layers=n), decode).kernel_count for n in (2, 4))
    per_layer = (four - two) / 2
    return per_layer, int(two - 2 * per_layer)


# The fused step's ops a layer on the CPU, fp32: 2 RMSNorms × 6 (F.rms_norm's CPU decomposition: pow, mean, add,
# rsqrt, mul, mul; one _fused_rms_norm kernel each on CUDA) + the q/k/v mm + rotary 2 (heads·cos, addcmul with the
# rotated heads the mm also gave) + 1 index_copy_ of k and v into the cache + 1 SDPA + the o_proj addmm (residual
# included) + the gate/up mm + silu and the product + the down addmm (residual included) = 22, on CUDA 12 kernels.
# Outside the layers: the bias (masked_fill_), the rotary gather, the embedding, the final norm (6), the LM head,
# the slot's advance = 11.
FUSED_OPS_PER_LAYER = 22
FUSED_OPS_OUTSIDE = 11


def test_the_fused_decode_step_runs_at_most_22_ops_a_layer_well_below_the_forward():
    fused, fused_outside = _per_layer("auto")
    forward, forward_outside = _per_layer("forward")
    assert fused <= FUSED_OPS_PER_LAYER and fused_outside <= FUSED_OPS_OUTSIDE, (fused, fused_outside)
    # transformers' eager layer: the norms' same 12, then q, k, v apart, rotary ~10, the residual adds, ... (42 with
    # transformers 5.24); without the norms' 12 (fused on CUDA) the fused layer is 12 ops against 30
    assert forward >= 1.5 * fused and forward - 12 >= 2 * (fused - 12), (forward, fused)
    assert forward_outside > fused_outside


def test_the_fused_step_on_a_real_shape_counts_the_same():
    """SmolLM2-135M's proportions (9 query heads on 3 KV heads, head dim 64) at a tenth of its width: the count a
    layer does not depend on the shape."""
    model = _llama(layers=2, hidden_size=576 // 4, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                   intermediate_size=1536 // 4)
    assert fused_decode.unsupported(model) is None
    ops = _step_ops(model, "auto")
    assert ops.kernel_count <= 2 * FUSED_OPS_PER_LAYER + FUSED_OPS_OUTSIDE and ops.sync_count == 0


@pytest.mark.parametrize("decode", ["auto", "forward"])
@pytest.mark.parametrize("sample", [False, True])
def test_at_most_one_host_sync_per_check_every_tokens(decode, sample):
    """The decode loop reads the device once every ``check_every`` tokens ("has every row ended?") and never else:
    no sync in the step (a CUDA graph could not capture one) nor in picking the token (greedy or sampled with
    temperature, top-k, top-p). The prefill's (transformers' mask check) happen once a call, so they cancel in the
    difference between two answer lengths."""
    model = _llama()
    ids, mask = _prompts()
    check_every = 4
    kw = dict(do_sample=True, temperature=0.7, top_k=10, top_p=0.9) if sample else {}

    def syncs(answer):
        gen = StaticGenerator(model, P, answer, -1, PAD, use_cuda_graph=False, check_every=check_every,
                              decode=decode)
        gen.generate(ids, mask, generator=torch.Generator().manual_seed(0), **kw)
        with torch.no_grad(), OpCounter() as ops:
            out = gen.generate(ids, mask, generator=torch.Generator().manual_seed(0), **kw)
        assert out.shape[1] == P + answer  # no end token: every token decoded
        return ops.sync_count, ops.syncs

    short, long_ = syncs(4), syncs(28)
    assert long_[0] - short[0] <= (28 - 4) // check_every, (short, long_)
    assert set(long_[1]) <= {"aten._local_scalar_dense"}
    assert _step_ops(model, decode).sync_count == 0
