#!/usr/bin/env python
"""Multi-turn chat with a trained actor (an HF folder from step 1 or step 3).

    python inference/chatbot.py --path output/step3-models/tiny-opt/actor
    echo "Describe the lamp." | python chat.py --path output/step3-models/tiny-opt

A model with a chat template (today's instruct models; ``tiny-llama``) is prompted with it by default
(:mod:`utils.data.chat_template`: the conversation's messages and the generation prompt; an answer ends at
the template's end-of-turn token); ``--no-apply_chat_template`` chooses DeepSpeed-Chat's training format
instead, the only one for a model without a template: every turn appends ``" Human: {input} Assistant:"``
and then the model's answer. Either way the model sees the whole history (oldest turns are dropped when it
would not fit), and the format used is said once on stderr. Type ``clear`` to forget the history and
``quit`` (or end the input) to leave. When stdin is not a terminal there is no prompt text: one
``Assistant: ...`` line is printed per question, so the chatbot can be scripted through a pipe.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import os
import sys

TURN = " Human: {text} Assistant:"


def parse_args(argv=None):
    from utils.arguments import DTYPES, HelpFormatter, add_chat_template_arg, add_sampling_args, seed_int

    p = argparse.ArgumentParser(description="Chat with a trained actor model (Human/Assistant turns).",
                                formatter_class=HelpFormatter)
    p.add_argument("--path", required=True,
                   help="Actor folder: step 1's output, step 3's output (its actor/ is used) or any causal-LM folder.")
    p.add_argument("--max_new_tokens", type=int, default=128, help="Maximum new tokens per answer.")
    add_chat_template_arg(p, auto=True)
    add_sampling_args(p, do_sample_help="Sample instead of greedy decoding.")
    p.add_argument("--seed", type=seed_int, default=42, help="Random seed (sampling).")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu).")
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES,
                   help="Weights' precision; auto = as saved on a GPU (a bf16-trained actor stays bf16: fp16 can "
                        "overflow it), fp32 on a CPU.")
    return p.parse_args(argv)


def load_dtype(requested: str, device_type: str):
    """``from_pretrained``'s ``dtype`` for ``--dtype``: "auto" (the saved one) on a GPU, fp32 on a CPU, else as asked."""
    import torch

    if requested == "auto":
        return "auto" if device_type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]


def actor_folder(path: str) -> str:
    """Where the output folder ``path`` holds its model (itself, or step 3's ``actor/``:
    :meth:`~utils.run_folder.RunFolder.model_dir`), else ``path`` as given (a hub or built-in model's name)."""
    from utils.run_folder import RunFolder

    return RunFolder(path).model_dir() or path


class Chatbot:
    """Keeps the conversation history and generates answers with a causal LM."""

    def __init__(self, path: str, max_new_tokens: int = 128, device: str | None = None, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, dtype: str = "auto",
                 apply_chat_template: bool | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        from utils.data.chat_template import chat_format, has_chat_template, trained_with_template
        from utils.generation import generate_kwargs  # sampling by the inverse CDF, as step 3 samples
        from utils.model.model_utils import load_hf_tokenizer, resolve_model_name_or_path

        folder = resolve_model_name_or_path(actor_folder(path))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_hf_tokenizer(folder)
        self.name, self.asked_for_template = path, apply_chat_template
        self.trained_format = trained_with_template(folder)  # recorded by the step that saved it, or None
        if apply_chat_template is None:  # the format it was trained in; else the template when the model has one
            apply_chat_template = has_chat_template(self.tokenizer) if self.trained_format is None else \
                self.trained_format and has_chat_template(self.tokenizer)
        self.chat = chat_format(self.tokenizer, path) if apply_chat_template else None  # None: DeepSpeed-Chat's text
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=load_dtype(dtype, self.device.type),
                                                          local_files_only=os.path.isdir(folder))
        self.model.to(self.device).eval()
        stop = list(self.chat.stop_ids) if self.chat else self.tokenizer.eos_token_id
        self.generate_kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=stop,
                                    pad_token_id=self.tokenizer.pad_token_id,
                                    **generate_kwargs(do_sample, temperature, top_k, top_p))
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.history = ""  # DeepSpeed-Chat's text
        self.messages = []  # the chat template's conversation

    def describe_format(self) -> str:
        """Which prompt format the bot uses, in a line (chat.py says it on stderr)."""
        if self.chat is not None:
            return f"format: the model's chat template (answers end with {self.chat.eot!r})"
        why = ("--no-apply_chat_template" if self.asked_for_template is False
               else "the format it was trained in" if self.trained_format is False
               else f"{self.name} has no chat template")
        return f"format: DeepSpeed-Chat's ' Human: … Assistant:' text ({why})"

    def clear(self) -> None:
        self.history = ""
        self.messages = []

    def _prompt_ids(self, prompt: str):
        """Token ids of ``prompt``; whole oldest turns are dropped until answer room remains."""
        budget = max(self.max_positions - self.generate_kwargs["max_new_tokens"], 1)  # validate(): room for one
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        while ids.shape[1] > budget and prompt.find(" Human:", 1) > 0:
            prompt = prompt[prompt.find(" Human:", 1):]
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        return prompt, ids[:, -budget:]

    def _template_ids(self, messages: list):
        """``(messages, ids)`` of the chat-template prompt; the oldest user turn (and its answer) are dropped
        until answer room remains."""
        import torch

        budget = max(self.max_positions - self.generate_kwargs["max_new_tokens"], 1)  # validate(): room for one
        ids = self.chat.prompt_ids(messages)
        while len(ids) > budget:
            first = next(i for i, m in enumerate(messages) if m["role"] == "user")
            later = [i for i, m in enumerate(messages) if m["role"] == "user" and i > first]
            if not later:
                break
            messages = messages[:first] + messages[later[0]:]
            ids = self.chat.prompt_ids(messages)
        return messages, torch.tensor([ids[-budget:]])

    def reply(self, text: str) -> str:
        """Answer ``text`` given the history; the turn and the answer join the history."""
        import torch

        if self.chat is not None:
            messages, ids = self._template_ids(self.messages + [{"role": "user", "content": text}])
        else:
            prompt, ids = self._prompt_ids(self.history + TURN.format(text=text))
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=torch.ones_like(ids).to(self.device),
                                      **self.generate_kwargs)
        answer = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if self.chat is not None:  # generation stopped at the end of the turn
            answer = answer.strip()
            self.messages = messages + [{"role": "assistant", "content": answer}]
            return answer
        answer = answer.split("Human:")[0].rstrip()  # the model may start the next turn itself
        self.history = prompt + answer
        return answer.strip()


def read_lines(stream, interactive: bool):
    """User inputs, one per line; a terminal gets a ``Human: `` prompt, a pipe none."""
    while True:
        if interactive:
            try:
                line = input("Human: ")
            except EOFError:
                return
        else:
            line = stream.readline()
            if not line:
                return
        yield line.strip()


def chat(bot: Chatbot, stream=None, interactive: bool | None = None) -> None:
    stream = stream or sys.stdin
    interactive = stream.isatty() if interactive is None else interactive
    if interactive:
        print("Type 'clear' to forget the conversation, 'quit' to leave.", flush=True)
    for text in read_lines(stream, interactive):
        if text == "quit":
            break
        if text == "clear":
            bot.clear()
            print("[history cleared]", flush=True)
            continue
        if text:
            print(f"Assistant: {bot.reply(text)}", flush=True)


def validate(args) -> None:
    """Bad flags and model folders as one clear error, before the model is loaded."""
    from utils.arguments import check_sampling_args
    from utils.errors import UserInputError
    from utils.preflight import check_causal_lm_path, model_positions

    if args.max_new_tokens < 1:
        raise UserInputError(f"--max_new_tokens must be ≥ 1, got {args.max_new_tokens}")
    check_sampling_args(args)
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError) as e:
            raise UserInputError(f"--device {args.device}: {e}") from None
        if device.type not in ("cpu", "cuda"):
            raise UserInputError(f"--device {args.device}: chat runs on cpu or cuda[:N]")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= gpus:
            raise UserInputError(f"--device {args.device}: this machine has {gpus} CUDA GPU(s); "
                                 "leave --device out to use what there is")
        if device.type == "cpu" and device.index not in (None, 0):
            raise UserInputError(f"--device {args.device}: a CPU has no index; use --device cpu")
    if not args.path.strip():
        raise UserInputError("--path is empty: give the model folder to chat with")
    folder = check_causal_lm_path("--path", actor_folder(args.path))
    positions = model_positions(folder)
    if positions is not None and args.max_new_tokens >= positions:
        raise UserInputError(f"--max_new_tokens {args.max_new_tokens} leaves no room for the question: the model at "
                             f"--path has {positions} positions; use at most {positions - 1} (fewer for long "
                             "conversations)")


def main(args) -> None:
    try:
        validate(args)
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        transformers.set_seed(args.seed)
        bot = Chatbot(args.path, args.max_new_tokens, args.device, args.do_sample, args.temperature, args.top_p,
                      args.top_k, args.dtype, args.apply_chat_template)
        print(bot.describe_format(), file=sys.stderr, flush=True)
        from utils.runtime import cpu_bf16_warning

        slow = cpu_bf16_warning(args, bot.device)  # --dtype bf16 on a CPU without bf16 instructions
        if slow:
            print(f"warning: {slow}", file=sys.stderr, flush=True)
        chat(bot)
    except KeyboardInterrupt:  # Ctrl-C leaves the chat: no traceback (and no training-run message)
        print("\n[interrupted]", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    from utils.entrypoint import run_main

    run_main(main, parse_args())
