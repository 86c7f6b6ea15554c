#!/usr/bin/env python
"""Generation speed of the actor's backends: ``hf`` (model.generate), ``static`` and ``cuda-graph``.

    .venv/bin/python bench/bench_generation.py                               # CPU: tiny-opt, small-opt
    python3 bench/bench_generation.py --models opt-1.3b --dtype bf16         # GPU: random OPT-1.3B shape
    python3 bench/bench_generation.py --models opt-1.3b llama-1b --batch 16 --prompt 256 --answer 256
    python3 bench/bench_generation.py --shape smollm2-135m llama-1b --batch 64 --prompt 128 --answer 256
    .venv/bin/python bench/bench_generation.py --models ../smollm2 --dtype bf16 --batch 32 --prompt 64 \
        --answer 64 --sample --backends hf-multinomial hf static             # step 3's sampling on CPU

Built-in names (``tiny-opt``, ``small-opt``, ``tiny-llama``) are the project's tiny
models; ``opt-1.3b``, ``opt-350m``, ``llama-1b`` and ``smollm2-135m`` are random-initialised models of
those shapes built from a config (no download; ``--shape`` names them). Prompts are random tokens, left padded
by a few positions in half of the rows; EOS is disabled so every row decodes the full
answer length (the worst case step 3 can meet). For each backend: prefill time, decode
time per token, tokens/s (batch × answer tokens / total time), the one-off capture time,
peak GPU memory, and whether its greedy output equals ``hf``'s token for token.

``--sample`` samples at temperature 1 instead (step 3's ``--do_sample``): ``hf`` and ``static`` draw with
:func:`utils.generation.sample_categorical`, ``hf-multinomial`` is ``model.generate(do_sample=True)``'s own
``torch.multinomial`` (what step 3 did before). The first backend is the speed-up's reference.

The static backends decode with the fused Llama step (utils/model/fused_decode.py) where the model allows it;
``static-forward`` and ``cuda-graph-forward`` with the model's own forward (the path before it),
``cuda-graph-compiled`` with the fused step ``torch.compile``'d inside the graph. Also per backend: the aten ops
one more answer token costs (a generate of 3 tokens less one of 2, eager, counted by :class:`utils.op_count.OpCounter`;
on a GPU each is about one kernel, the fused RMSNorm's 6 CPU ops one), and on a GPU the bandwidth limit of a decode
step (the weights plus the KV cache of the mean context ``prompt + answer / 2``, read once, at ``--hbm_gbps``) and
the measured decode's share of it.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import os
import time

from utils.arguments import DTYPES

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
SHAPES = {  # random-initialised models of real shapes (vocab 8192, as the GPU recipe's tokenizer)
    "opt-1.3b": dict(arch="opt", hidden=2048, layers=24, heads=32, ffn=8192, proj=2048, pre_ln=True),
    "opt-350m": dict(arch="opt", hidden=1024, layers=24, heads=16, ffn=4096, proj=512, pre_ln=False),
    "llama-1b": dict(arch="llama", hidden=2048, layers=16, heads=32, ffn=8192),
    # SmolLM2-135M as published: 9 query heads on 3 KV heads, tied embeddings, its 49 152-token vocabulary
    "smollm2-135m": dict(arch="llama", hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152,
                         tied=True, rope_theta=100000.0),
}
BACKENDS = ("hf", "hf-multinomial", "static", "static-forward", "cuda-graph", "cuda-graph-forward",
            "cuda-graph-compiled")
HBM_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600}  # by name in the device's


def shape_config(name: str):
    """The config of a real shape (:data:`SHAPES`): OPT ids in facebook/opt's layout (pad 1, BOS = EOS 2)."""
    from transformers import LlamaConfig, OPTConfig

    s = SHAPES[name]
    if s["arch"] == "opt":
        return OPTConfig(vocab_size=8192, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], ffn_dim=s["ffn"], word_embed_proj_dim=s["proj"],
                         do_layer_norm_before=s["pre_ln"], max_position_embeddings=2048,
                         pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return LlamaConfig(vocab_size=s.get("vocab", 8192), hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                       num_attention_heads=s["heads"], num_key_value_heads=s.get("kv_heads", s["heads"]),
                       intermediate_size=s["ffn"], max_position_embeddings=2048,
                       tie_word_embeddings=s.get("tied", False), rope_theta=s.get("rope_theta", 10000.0),
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model(name: str, dtype, device):
    """A causal LM: a built-in tiny model, or a random one of a real shape (:data:`SHAPES`)."""
    import torch
    from transformers import AutoModelForCausalLM

    if name not in SHAPES:
        from utils.model.tiny import resolve_model_path

        return AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=dtype).to(device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(name))
    return model.to(dtype)


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def make_call(model, backend: str, ids, mask, answer: int, sample: bool, eager: bool = False, log=None):
    """(``call()`` → the generated ``[B, P + answer]``, the StaticGenerator or None) for ``backend``; ``eager``: the
    same decode path without the CUDA graph (to count its ops)."""
    from utils.generation import StaticGenerator, generate_kwargs

    B, P = ids.shape
    no_eos = -1  # never emitted: every row decodes `answer` tokens
    pad = model.config.pad_token_id
    if backend in ("hf", "hf-multinomial"):
        decoding = (dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if backend == "hf-multinomial"
                    else generate_kwargs(sample, 1.0, 0, 1.0))
        kw = dict(attention_mask=mask, max_new_tokens=answer, pad_token_id=pad, eos_token_id=None, **decoding)
        return (lambda: model.generate(ids, **kw)), None
    gen = StaticGenerator(model, P, answer, no_eos, pad, use_cuda_graph=backend.startswith("cuda-graph") and not eager,
                          decode="forward" if backend.endswith("-forward") else "auto",
                          compile_decode=backend.endswith("-compiled") and not eager, log=log)
    return (lambda: gen.generate(ids, mask, do_sample=sample, temperature=1.0, top_k=0)), gen


def ops_per_token(model, backend: str, ids, mask, sample: bool) -> tuple[int, str]:
    """(aten ops one more answer token costs: a generate of 3 tokens less one of 2, eager; the decode path)."""
    import torch

    from utils.op_count import OpCounter

    counts, path = [], "generate"
    for answer in (2, 3):
        call, gen = make_call(model, backend, ids, mask, answer, sample, eager=True)
        call()  # allocation, the path's one-off work
        with torch.no_grad(), OpCounter() as ops:
            call()
        counts.append(ops.kernel_count)
        path = gen.decode_path if gen is not None else path
    return counts[1] - counts[0], path


def decode_limit_ms(model, batch: int, context: float, gbps: float) -> float:
    """ms a decode step takes at ``gbps`` to read every weight once (the embedding's ``batch`` rows alone, unless
    tied to the LM head) and the KV cache of ``context`` positions a row."""
    config = model.config
    params = {id(p): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        weight_bytes -= (embed.shape[0] - batch) * embed.shape[1] * embed.element_size()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv_bytes = 2 * config.num_hidden_layers * batch * kv_heads * context * head_dim * embed.element_size()
    return (weight_bytes + kv_bytes) / (gbps * 1e9) * 1000


def run(model, backend: str, ids, mask, answer: int, device, repeats: int, sample: bool = False, log=None):
    """(output of the last repeat, {prefill_s, decode_ms_per_token, tokens_per_s, capture_s, total_s})."""
    import torch

    call, gen = make_call(model, backend, ids, mask, answer, sample, log=log)
    prefill = None
    if gen is None:
        prefill = lambda: model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)  # noqa: E731
    with torch.no_grad():
        out = call()  # warm-up (and, for cuda-graph, the one-off capture)
        sync(device)
        start = time.time()
        for _ in range(repeats):
            out = call()
        sync(device)
        total = (time.time() - start) / repeats
        if prefill is not None:
            start = time.time()
            for _ in range(repeats):
                prefill()
            sync(device)
            prefill_s = (time.time() - start) / repeats
        else:
            prefill_s = gen.last_prefill_seconds
    decode = max(total - prefill_s, 1e-9) / max(answer - 1, 1)
    B = ids.shape[0]
    return out, {"prefill_s": prefill_s, "decode_ms_per_token": decode * 1000, "tokens_per_s": B * answer / total,
                 "capture_s": gen.capture_seconds if gen is not None else 0.0, "total_s": total}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=None, help="default: tiny-opt small-opt (CPU), opt-1.3b (GPU)")
    parser.add_argument("--shape", nargs="+", default=None, choices=[n for n in SHAPES],
                        help="random-initialised models of these shapes (added to --models)")
    parser.add_argument("--backends", nargs="+", default=None, choices=BACKENDS,
                        help="default: hf static-forward static (CPU); hf cuda-graph-forward cuda-graph "
                             "cuda-graph-compiled (GPU)")
    parser.add_argument("--hbm_gbps", type=float, default=None,
                        help="the GPU's memory bandwidth in GB/s for the decode's bandwidth limit (default: by "
                             f"the device's name: {', '.join(f'{k} {v}' for k, v in HBM_GBPS.items())})")
    parser.add_argument("--no_op_count", action="store_true", help="skip counting the aten ops a token")
    parser.add_argument("--batch", type=int, default=None, help="default 8 on CPU, 16 on a GPU")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32 on CPU, 256 on a GPU)")
    parser.add_argument("--answer", type=int, default=None, help="answer tokens (default 32 on CPU, 256 on a GPU)")
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="default fp32 CPU, bf16 GPU")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sample", action="store_true", help="sample at temperature 1 (step 3's --do_sample)")
    args = parser.parse_args()

    import torch

    from utils.runtime import torch_dtype

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    models = (args.models or []) + (args.shape or []) or (["opt-1.3b"] if cuda else ["tiny-opt", "small-opt"])
    backends = args.backends or (["hf", "cuda-graph-forward", "cuda-graph", "cuda-graph-compiled"] if cuda
                                 else ["hf", "static-forward", "static"])
    B = args.batch or (16 if cuda else 8)
    P = args.prompt or (256 if cuda else 32)
    A = args.answer or (256 if cuda else 32)
    dtype = torch_dtype(args.dtype or ("bf16" if cuda else "fp32"))
    where = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    gbps = args.hbm_gbps or next((v for k, v in HBM_GBPS.items() if cuda and k in where), None)
    lines = [f"generation on {where}, torch {torch.__version__}: batch {B}, prompt {P} (half the rows left padded "
             f"by 1-7), answer {A} tokens, {'sampled' if args.sample else 'greedy'}, "
             f"{str(dtype).replace('torch.', '')}, mean of {args.repeats} after 1 warm-up"
             + (f"; bandwidth limit at {gbps:.0f} GB/s" if gbps else ""), "",
             f"| model | backend | decode path | aten ops a token | prefill (ms) | decode (ms/token) | "
             f"bandwidth limit (ms/token) | share of the limit | tokens/s | speed-up vs {backends[0]} | "
             f"capture (s) | peak GPU memory (GiB) | greedy output = {backends[0]} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in models:
        torch.manual_seed(0)
        model = build_model(name, dtype, device).eval()
        model.generation_config.eos_token_id = None  # no EOS: every row decodes the full answer
        ids = torch.randint(4, model.config.vocab_size - 1, (B, P), device=device)
        mask = torch.ones(B, P, dtype=torch.long, device=device)
        for row in range(0, B, 2):
            n = 1 + row % 7
            ids[row, :n] = model.config.pad_token_id
            mask[row, :n] = 0
        reference = hf_stats = None
        for backend in backends:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            ops, path = ("—", "—") if args.no_op_count or backend.endswith("-compiled") else ops_per_token(
                model, backend, ids, mask, args.sample)
            said = []
            out, stats = run(model, backend, ids, mask, A, device, args.repeats, args.sample, log=said.append)
            if backend.endswith("-compiled"):
                path = "fused, compiled" if not any("torch.compile" in m and "failed" in m for m in said) else \
                    "fused (compile failed)"
            limit = decode_limit_ms(model, B, P + A / 2, gbps) if gbps else None
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            first = reference is None
            if first:
                reference, hf_stats = out, stats
            same = "—" if first or args.sample else (
                "yes" if torch.equal(out[:, :reference.shape[1]], reference) else
                f"no ({(out[:, P:reference.shape[1]] != reference[:, P:]).any(dim=1).sum().item()}/{B} rows differ)")
            speedup = f"{hf_stats['total_s'] / stats['total_s']:.2f}x" if not first else "—"
            share = f"{limit / stats['decode_ms_per_token']:.0%}" if limit else "—"
            lines.append(f"| {name} | {backend} | {path} | {ops} | {stats['prefill_s'] * 1000:.1f} "
                         f"| {stats['decode_ms_per_token']:.2f} | {f'{limit:.3f}' if limit else '—'} | {share} "
                         f"| {stats['tokens_per_s']:.0f} | {speedup} | {stats['capture_s']:.2f} | {peak:.2f} "
                         f"| {same} |")
            print(lines[-1], flush=True)
        del model
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
