"""Built-in tiny models: a project-trained tokenizer + random-initialised configs.

Nothing is downloaded. ``--model_name_or_path tiny-opt`` (or ``tiny-llama``,
``small-opt``) resolves to a normal Hugging Face folder that is built once, on
first use, under ``$DSCHAT_HOME`` (default ``~/.cache/dschat``) and reused:

==============  =====================================  ==========
name            architecture                           parameters
==============  =====================================  ==========
``tiny-opt``    OPT, 4 layers, hidden 128, pad = eos    ~0.9 M
``tiny-llama``  Llama, 4 layers, hidden 128, own pad    ~0.9 M
``small-opt``   OPT, 10 layers, hidden 640 (benchmarks) ~50 M
==============  =====================================  ==========

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the built-in dataset's
text (:mod:`utils.data.builtin`), so any text encodes. ``VOCAB_SIZE`` (1000) is the
trainer's upper bound; the small corpus yields 669 tokens (``tiny-opt``, ``small-opt``)
and 673 with ``tiny-llama``'s own special tokens (tests/test_readme.py checks both).
``tiny-opt`` mimics OPT: BOS = EOS = ``<|endoftext|>`` prepended to every text, no pad
token (the loader sets pad = eos, as DeepSpeed-Chat does), so
``--num_padding_at_beginning 1``, and no chat template. ``tiny-llama`` mimics Llama: BOS ``<s>``, its
own ``<pad>``, ``--num_padding_at_beginning 0``, and mimics today's instruct models with a ChatML chat
template (SmolLM2's and Qwen's: ``<|im_start|>user\n…<|im_end|>\n``, two special tokens appended after
the trained vocabulary) whose end-of-turn token ``<|im_end|>`` is not its EOS, so ``--apply_chat_template``
is tested offline.

``python -m utils.model.tiny OUT_DIR --name tiny-opt`` writes a copy to a folder.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import os
import shutil
import tempfile

VERSION = 5  # bump when a config or the tokenizer recipe (incl. the built-in corpus) changes (5: tiny-llama's template)
# The seed of the random weights (it was VERSION up to 4): a recipe change of one model leaves the others' weights
WEIGHT_SEED = 4
VOCAB_SIZE = 1000

CONFIGS = {
    "tiny-opt": dict(arch="opt", hidden=128, layers=4, heads=4, ffn=512),
    "tiny-llama": dict(arch="llama", hidden=128, layers=4, heads=4, ffn=344),
    "small-opt": dict(arch="opt", hidden=640, layers=10, heads=10, ffn=2560),
}
TINY_MODELS = tuple(CONFIGS)
MAX_POSITIONS = 512
# EOS is spelled like DeepSpeed-Chat's default --eot_token, so the default end-of-text
# token appended to every training text IS the tokenizer's EOS (one special token).
EOS = "<|endoftext|>"
PAD = "<pad>"
# tiny-llama's chat template: ChatML as SmolLM2-Instruct and Qwen write it, after the BOS (tokenised without
# special tokens, a template text carries its own)
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '" + TURN_START + "' + message['role'] + '\n' + "
                 "message['content'] + '" + TURN_END + "' + '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '" + TURN_START + "assistant\n' }}{% endif %}")


def home() -> str:
    return os.environ.get("DSCHAT_HOME", os.path.join(os.path.expanduser("~"), ".cache", "dschat"))


def resolve_model_path(name_or_path: str) -> str:
    """A built-in name -> its (built on demand) folder; anything else unchanged."""
    if name_or_path not in CONFIGS:
        return name_or_path
    target = os.path.join(home(), f"{name_or_path}-v{VERSION}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    from filelock import FileLock

    os.makedirs(home(), exist_ok=True)
    with FileLock(target + ".lock"):  # several ranks / processes: one builds, the others wait
        if not os.path.isfile(os.path.join(target, "config.json")):
            tmp = tempfile.mkdtemp(prefix=f".{name_or_path}-", dir=home())
            build(name_or_path, tmp)
            os.replace(tmp, target)
    return target


def build_tokenizer(arch: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from utils.data.builtin import tokenizer_corpus

    special = [PAD, "<s>", EOS, "<unk>"] if arch == "llama" else [EOS, "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    bos = "<s>" if arch == "llama" else EOS
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    kwargs = dict(bos_token=bos, eos_token=EOS, unk_token="<unk>")
    if arch == "llama":
        kwargs["pad_token"] = PAD
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAX_POSITIONS, **kwargs)
    if arch == "llama":  # after the trained vocabulary: every other token keeps its id
        tokenizer.add_special_tokens({"additional_special_tokens": [TURN_START, TURN_END]})
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_config(name: str, tokenizer):
    from transformers import LlamaConfig, OPTConfig

    c = CONFIGS[name]
    vocab = ((len(tokenizer) + 7) // 8) * 8
    if c["arch"] == "opt":
        return OPTConfig(vocab_size=vocab, hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                         num_attention_heads=c["heads"], ffn_dim=c["ffn"], word_embed_proj_dim=c["hidden"],
                         max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         dropout=0.1, attention_dropout=0.0, do_layer_norm_before=True)
    return LlamaConfig(vocab_size=vocab, hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                       num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                       intermediate_size=c["ffn"], max_position_embeddings=MAX_POSITIONS,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)


def build(name: str, out_dir: str) -> str:
    """Write tokenizer + random-initialised model ``name`` into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(CONFIGS[name]["arch"])
    config = build_config(name, tokenizer)
    torch.manual_seed(WEIGHT_SEED)
    model = AutoModelForCausalLM.from_config(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main():
    parser = argparse.ArgumentParser(description="Write a built-in tiny model (tokenizer + config + weights) to a folder.")
    parser.add_argument("out_dir")
    parser.add_argument("--name", default="tiny-opt", choices=TINY_MODELS)
    args = parser.parse_args()
    src = resolve_model_path(args.name)
    try:
        shutil.copytree(src, args.out_dir, dirs_exist_ok=True)
    except (OSError, shutil.Error) as e:  # OUT_DIR a file, not writable, a full disk: one line
        from utils.errors import UserInputError

        raise UserInputError(f"{args.out_dir}: cannot write the model there ({e})") from None
    print(f"wrote {args.name} to {args.out_dir}")


if __name__ == "__main__":  # run_main's rules by hand: utils.entrypoint reaches this module (an import cycle)
    import sys

    from utils.errors import BAD_INPUT, INTERRUPTED, UserInputError

    try:
        main()
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    except KeyboardInterrupt:
        print("\ninterrupted; the folder may hold a partial copy (rerun to complete it)", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
