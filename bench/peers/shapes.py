"""Random-initialised models of a named shape for the peer bench (``bench/bench_peers.py --shape``), built offline.

    .venv/bin/python -m bench.peers.shapes smollm2-135m /tmp/smollm2-shape [--tokenizer DIR] [--dtype bf16]

The bench measures speed and memory, so a model of the right shape does the work of the real one: the same
matmuls, the same LM head, the same KV cache. Two shapes:

==================  ======  ======  =====  ========  ============  =======  ===============  ==============
name                hidden  layers  heads  kv heads  intermediate  vocab    tied embeddings  parameters
==================  ======  ======  =====  ========  ============  =======  ===============  ==============
``smollm2-135m``    576     30      9      3         1536          49152    yes              134,515,008
``llama-1b``        2048    16      32     8         8192          128256   yes              1,235,814,400
==================  ======  ======  =====  ========  ============  =======  ===============  ==============

(SmolLM2-135M's config; Llama-3.2-1B's for the second, its 128,256-token vocabulary included: the LM head is a
large share of a 1B model's work.) The parameter counts, by hand: embedding V·H, per layer the attention
``H·H·2 + H·(kv·64)·2``, the MLP ``3·H·I`` and two norms ``2·H``, and the final norm ``H``:
49152·576 + 30·(884,736 + 2,654,208 + 1,152) + 576 and 128256·2048 + 16·(10,485,760 + 50,331,648 + 4,096) + 2048
(tests/test_bench.py checks both).

The tokenizer, with its chat template, is ``--tokenizer``'s (a folder: SmolLM2's real tokenizer, copied next to
the bench's data for a machine without the model), else the real model folder's when there is one, else the
project's offline BPE with a ChatML template (utils/model/tiny.py: a 673-token vocabulary, so texts are longer in
tokens, the same on both sides).

**The answer's end is never sampled**, so both sides generate every answer to the cap and do equal work: one
hidden channel ``d`` carries a constant. Every token's embedding is ``c`` there except the end tokens' (the
tokenizer's EOS and the template's end of turn), which are ``−K``; no layer writes to ``d`` (its rows of every
``o_proj`` and ``down_proj`` are zero), so at every position whose input is not an end token the final hidden
state has ``c / rms`` at ``d``: every ordinary token's logit gains the same ``c / rms`` (softmax ignores it) and
the end tokens' lose ``K / rms``, tens of logits below the rest (``end_token_margin`` measures it). Nothing in
either trainer is changed for it: the model itself never ends an answer.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import os

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, rope_theta=500000.0),
}
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir))
DEFAULT_MODEL = os.environ.get("SMOLLM2_DIR") or os.path.join(os.path.dirname(REPO), "smollm2")  # bench_peers'
CONSTANT_CHANNEL = 0  # the hidden channel d
CONSTANT = 1.0  # c: ordinary tokens' embedding at d
END_WEIGHT = 100.0  # K: the end tokens' embedding at d is −K
SEED = 1234


def shape_config(name: str, tokenizer=None, layers: int | None = None):
    """The ``LlamaConfig`` of shape ``name`` (``layers``: fewer decoder layers, for tests), with ``tokenizer``'s
    special ids."""
    from transformers import LlamaConfig

    if name not in SHAPES:
        from utils.errors import UserInputError

        raise UserInputError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    spec = dict(SHAPES[name])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    theta = spec.pop("rope_theta")
    ids = {}
    if tokenizer is not None:
        ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else
                   tokenizer.eos_token_id)
    return LlamaConfig(**spec, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, rope_parameters={"rope_theta": theta, "rope_type": "default"},
                       **ids)


def load_tokenizer(tokenizer_dir: str | None = None):
    """``(tokenizer, where it came from)``: ``tokenizer_dir``'s, else the real SmolLM2 folder's (``$SMOLLM2_DIR`` or
    ``../smollm2``) when it has one, else the offline BPE of utils/model/tiny.py with its ChatML template."""
    from transformers import AutoTokenizer

    for folder in (tokenizer_dir, DEFAULT_MODEL):
        if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
            tokenizer = AutoTokenizer.from_pretrained(folder)
            if tokenizer.chat_template:
                return tokenizer, folder
    if tokenizer_dir:
        from utils.errors import UserInputError

        raise UserInputError(f"--tokenizer {tokenizer_dir}: no tokenizer.json with a chat template there")
    from utils.model.tiny import build_tokenizer

    return build_tokenizer("llama"), "the project's offline BPE (utils/model/tiny.py)"


def end_token_ids(tokenizer) -> list:
    """The ids that end an answer on either side: the tokenizer's EOS and the chat template's end of turn."""
    from utils.data.chat_template import chat_format

    return sorted(set(chat_format(tokenizer).stop_ids) | {int(tokenizer.eos_token_id)})


def suppress_end_tokens(model, ids) -> None:
    """Make ``ids`` unsampleable after any ordinary token (the module docstring): channel ``d`` of the (tied)
    embedding is ``c``, ``−K`` for ``ids``, and no layer writes to ``d``."""
    import torch

    d = CONSTANT_CHANNEL
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, d] = CONSTANT
        embedding[list(ids), d] = -END_WEIGHT
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[d, :] = 0
            layer.mlp.down_proj.weight[d, :] = 0


def end_token_margin(model, tokenizer, rows: int = 4, length: int = 24) -> float:
    """How far below the best ordinary token the end tokens' logits are, at the least (over random ordinary-token
    inputs, every position): > 30 means their probability is below e⁻³⁰ of the best's."""
    import torch

    ends = end_token_ids(tokenizer)
    g = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    ids[torch.isin(ids, torch.tensor(ends))] = 3 if 3 not in ends else 4
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(ids.to(device)).logits.float()
    ordinary = logits.clone()
    ordinary[..., ends] = float("-inf")
    return float((ordinary.max(dim=-1).values - logits[..., ends].max(dim=-1).values).min())


def build_shape(name: str, out: str, tokenizer_dir: str | None = None, dtype: str = "bf16",
                layers: int | None = None, device: str | None = None, log=print) -> str:
    """Write shape ``name`` (random weights, seed 1234, end tokens suppressed), its tokenizer and a generation config
    to ``out``; returns ``out``. Built on ``device`` (default: cuda when there is one) and saved in ``dtype``."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    tokenizer, source = load_tokenizer(tokenizer_dir)
    config = shape_config(name, tokenizer, layers)
    if len(tokenizer) > config.vocab_size:
        from utils.errors import UserInputError

        raise UserInputError(f"the tokenizer ({source}) has {len(tokenizer)} tokens, more than shape {name}'s "
                             f"vocabulary of {config.vocab_size}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    ends = end_token_ids(tokenizer)
    suppress_end_tokens(model, ends)
    model = model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    log(f"built shape {name} in {out}: {params:,} parameters, {dtype}, tokenizer {source}, end tokens {ends} "
        f"never sampled (margin {end_token_margin(model, tokenizer):.0f} logits)")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out")
    parser.add_argument("--tokenizer", default=None, help="a folder with a tokenizer and chat template")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (quick checks)")
    args = parser.parse_args(argv)
    build_shape(args.shape, args.out, args.tokenizer, args.dtype, args.layers)
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
