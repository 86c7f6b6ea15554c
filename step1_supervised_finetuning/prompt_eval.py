#!/usr/bin/env python
"""Compare a baseline and a fine-tuned model on a few prompts (greedy decoding), as DeepSpeed-Chat's prompt_eval.

    python prompt_eval.py --model_name_or_path_baseline facebook/opt-1.3b \\
                          --model_name_or_path_finetune output/actor
    python prompt_eval.py --model_name_or_path_baseline tiny-opt --model_name_or_path_finetune out/actor \\
                          --prompts " Human: Describe the lamp. Assistant:"

For every prompt it prints the baseline's greedy continuation, then the fine-tuned
model's (and, with ``--num_beams > 1``, the fine-tuned model's beam search). Each
model is loaded with its own tokenizer (local folders never touch the hub). With
``--apply_chat_template`` each model's own chat template formats the prompts (DeepSpeed-Chat's
``"Human: … Assistant:"`` prompts are read back as messages, :mod:`utils.data.chat_template`), and a
model's answer ends at the template's end-of-turn token.
``--num_beam_groups``, ``--top_k`` and ``--penalty_alpha`` are accepted for
compatibility with the reference's scripts, whose diverse-beam and contrastive
searches are commented out (transformers >= 4.56 moved both out of the library).
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse

from utils.answers import check_room, prompt_ids
from utils.arguments import add_chat_template_arg
from utils.entrypoint import run_main

# Prompts end with ":" (the reference's observation: a trailing space often makes an
# untuned model produce nothing).
PROMPTS = {
    "English": [
        "Human: Please tell me about Microsoft in a few sentence? Assistant:",
        "Human: Explain the moon landing to a 6 year old in a few sentences. Assistant:",
        "Human: Write a short poem about a wise frog. Assistant:",
        "Human: Who was president of the United States in 1955? Assistant:",
        "Human: How does a telescope work? Assistant:",
        "Human: Why do birds migrate south for the winter? Assistant:",
    ],
    "Chinese": [
        "Human: 请用几句话介绍一下微软? Assistant:",
        "Human: 用几句话向6岁的孩子解释登月。 Assistant:",
        "Human: 写一首关于一只聪明的青蛙的短诗。 Assistant:",
        "Human: 谁是1955年的美国总统? Assistant:",
        "Human: 望远镜是如何工作的? Assistant:",
        "Human: 鸟类为什么要南迁过冬? Assistant:",
    ],
    "Japanese": [
        "Human: マイクロソフトについて簡単に教えてください。 Assistant:",
        "Human: 6歳児に月面着陸を短い文で説明する。 Assistant:",
        "Human: 賢いカエルについて短い詩を書いてください。 Assistant:",
        "Human: 1955年のアメリカ合衆国大統領は誰? Assistant:",
        "Human: 望遠鏡はどのように機能しますか? Assistant:",
        "Human: 鳥が冬に南に移動するのはなぜですか? Assistant:",
    ],
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Compare a baseline and a fine-tuned (SFT) model on prompts.")
    parser.add_argument("--model_name_or_path_baseline", type=str, required=True,
                        help="Baseline model: hub name, local HF folder or built-in tiny-opt/tiny-llama.")
    parser.add_argument("--model_name_or_path_finetune", type=str, required=True,
                        help="Fine-tuned model (e.g. step 1's --output_dir).")
    parser.add_argument("--num_beams", type=int, default=1,
                        help="> 1 also shows the fine-tuned model's beam search.")
    for flag, kind in (("--num_beam_groups", int), ("--top_k", int), ("--penalty_alpha", float)):
        parser.add_argument(flag, type=kind, default=None,
                            help="Accepted for compatibility; not used (said on stderr when given).")
    parser.add_argument("--num_return_sequences", type=int, default=1,
                        help="Sequences returned by the beam search (≤ --num_beams; greedy returns one).")
    parser.add_argument("--max_new_tokens", type=int, default=100, help="Tokens generated per prompt.")
    parser.add_argument("--language", type=str, default=None, choices=sorted(PROMPTS),
                        help="Language of the built-in prompts (default: English; not with --prompts).")
    parser.add_argument("--prompts", type=str, nargs="+", default=None,
                        help="Prompts to use instead of the built-in ones.")
    parser.add_argument("--add_eot_token", action="store_true",
                        help="Add --eot_token to both tokenizers as a special token.")
    parser.add_argument("--eot_token", type=str, default="<|endoftext|>", help="End-of-text token.")
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow model folders to run their own code.")
    add_chat_template_arg(parser)
    return parser.parse_args(argv)


UNUSED_FLAGS = ("num_beam_groups", "top_k", "penalty_alpha")  # DeepSpeed-Chat's: its searches that used them are
# commented out in its prompt_eval.py (transformers ≥ 4.56 moved both out of the library)


def validate(args):
    import sys

    from utils.errors import UserInputError

    for name in ("num_beams", "num_return_sequences", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise UserInputError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    if args.prompts is not None and args.language is not None:
        raise UserInputError(f"--language {args.language} would not be used: it chooses the built-in prompts, and "
                             "--prompts replaces them; give one of them")
    if args.add_eot_token and not args.eot_token.strip():
        raise UserInputError("--add_eot_token needs a non-empty --eot_token")
    if args.num_return_sequences > args.num_beams:
        raise UserInputError(f"--num_return_sequences {args.num_return_sequences} needs --num_beams ≥ that "
                             f"(got --num_beams {args.num_beams}); greedy decoding returns one sequence")
    if args.prompts is not None and not all(p.strip() for p in args.prompts):
        raise UserInputError("--prompts: empty prompt")
    from utils.preflight import check_causal_lm_path

    for flag in ("--model_name_or_path_baseline", "--model_name_or_path_finetune"):  # one line, not a traceback
        check_causal_lm_path(flag, getattr(args, flag[2:]))
    given = [f"--{name} {getattr(args, name)}" for name in UNUSED_FLAGS if getattr(args, name) is not None]
    if given:  # accepted for DeepSpeed-Chat's scripts, never silently: named
        print(f"note: {', '.join(given)} not used: this prompt_eval runs greedy and beam search only (DeepSpeed-Chat's "
              "diverse-beam and contrastive searches are commented out in its own)", file=sys.stderr, flush=True)


def load(name_or_path, args, device):
    """(model in eval mode on ``device``, its tokenizer, its :class:`~utils.data.chat_template.ChatFormat` with
    ``--apply_chat_template`` else None)."""
    from transformers import AutoModelForCausalLM

    from utils.data.chat_template import chat_format
    from utils.model.model_utils import create_hf_model, load_hf_tokenizer

    tokenizer = load_hf_tokenizer(name_or_path, add_special_tokens=args.eot_token if args.add_eot_token else None,
                                  trust_remote_code=args.trust_remote_code,
                                  apply_chat_template=args.apply_chat_template)
    chat = chat_format(tokenizer, name_or_path) if args.apply_chat_template else None
    model = create_hf_model(AutoModelForCausalLM, name_or_path, tokenizer, None,
                            trust_remote_code=args.trust_remote_code)
    return model.to(device).eval(), tokenizer, chat


def generate(model, tokenizer, prompt, device, max_new_tokens, num_beams=1, num_return_sequences=1, chat=None):
    """Decoded texts (prompt included, special tokens dropped) of a deterministic search; ``chat``: the prompt
    in that chat template's format (a :class:`~utils.data.chat_template.ChatFormat`)."""
    import torch

    input_ids = torch.tensor([prompt_ids(tokenizer, prompt, chat)], device=device)
    stop = list(chat.stop_ids) if chat is not None else tokenizer.eos_token_id
    with torch.no_grad():
        ids = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             num_beams=num_beams, num_return_sequences=num_return_sequences,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop)
    return tokenizer.batch_decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def print_block(title, texts):
    print(f"=========={title}=========")
    for text in texts:
        print()
        print(text)
        print()


def main(args):
    import torch

    validate(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    baseline, baseline_tok, baseline_chat = load(args.model_name_or_path_baseline, args, device)
    finetune, finetune_tok, finetune_chat = load(args.model_name_or_path_finetune, args, device)
    prompts = args.prompts or PROMPTS[args.language or "English"]
    for flag, model, tok, chat in (("--model_name_or_path_baseline", baseline, baseline_tok, baseline_chat),
                                   ("--model_name_or_path_finetune", finetune, finetune_tok, finetune_chat)):
        check_room(flag, getattr(model.config, "max_position_embeddings", None), tok, chat, prompts,
                   args.max_new_tokens)
    outputs = []
    for prompt in prompts:
        base = generate(baseline, baseline_tok, prompt, device, args.max_new_tokens, chat=baseline_chat)
        tuned = generate(finetune, finetune_tok, prompt, device, args.max_new_tokens, chat=finetune_chat)
        print_block("Baseline: Greedy", base)
        print_block("finetune: Greedy", tuned)
        if args.num_beams > 1:
            print_block(f"finetune: Beam Search (num_beams={args.num_beams})",
                        generate(finetune, finetune_tok, prompt, device, args.max_new_tokens, args.num_beams,
                                 args.num_return_sequences, chat=finetune_chat))
        print("====================prompt end=============================")
        print()
        outputs.append({"prompt": prompt, "baseline": base[0], "finetune": tuned[0]})
    return outputs


if __name__ == "__main__":
    run_main(main, parse_args())
