#!/usr/bin/env python
"""Score prompt/answer pairs with a trained step-2 reward model.

    python rw_eval.py --model_name_or_path out/reward \\
        --prompt " Human: Describe the lamp. Assistant:" --answer " The lamp is bright and kind and calm." \\
        --prompt " Human: Describe the lamp. Assistant:" --answer " The lamp is dull and rude and cold."
    python rw_eval.py --model_name_or_path out/reward --input_file pairs.jsonl [--output_file scores.jsonl]

``--input_file`` rows are ``{"prompt", "answer"}`` (one score) or ``{"prompt", "chosen",
"rejected"}`` (both scored; the pair is correct when chosen scores higher; rows with a
``"kind"``, as the built-in data's, also get the accuracy per kind). Each text is
scored as ``prompt + answer + --eot_token`` with ``forward_value``'s end score (the value
at the last answer token, :mod:`utils.model.reward_model`). Write prompts in the format
the model was trained on (e.g. ``" Human: … Assistant:"``, answers starting with a space).
A reward model trained with ``--apply_chat_template`` scores with it too: each prompt (plain text or
DeepSpeed-Chat's ``" Human: … Assistant:"``, read back as messages) and answer are formatted with the
folder's chat template, and the score is read at the end-of-turn token (:mod:`utils.data.chat_template`).
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import os

from utils.arguments import add_chat_template_arg, non_negative_int, positive_int
from utils.entrypoint import run_main
from utils.errors import UserInputError
from utils.files import atomic_write
from utils.model.scoring import accuracy_by_kind, score_texts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Score prompt/answer pairs with a step-2 reward model.")
    parser.add_argument("--model_name_or_path", required=True, help="A step-2 output folder.")
    parser.add_argument("--prompt", action="append", default=[], help="A prompt (repeat, paired with --answer).")
    parser.add_argument("--answer", action="append", default=[],
                        help="An answer (repeat; one per --prompt, or several for a single --prompt).")
    parser.add_argument("--input_file", help="JSON lines of {prompt, answer} or {prompt, chosen, rejected}.")
    parser.add_argument("--output_file", help="Write one JSON line per row with the scores.")
    parser.add_argument("--num_padding_at_beginning", type=non_negative_int, default=None,
                        help="Override the value stored in the model folder.")
    parser.add_argument("--max_seq_len", type=int, default=512,
                        help="Texts are truncated to this many tokens (how many were, and by how much, is said; an "
                             "answer cut away whole is refused).")
    parser.add_argument("--eot_token", default="<|endoftext|>", help="End-of-text token appended to every answer.")
    parser.add_argument("--batch_size", type=positive_int, default=16)
    add_chat_template_arg(parser)
    return parser.parse_args(argv)


def rows_from_args(args) -> list:
    """``[{"prompt", "answer"} or {"prompt", "chosen", "rejected"}]`` from the flags / the input file."""
    if args.input_file:
        if args.prompt or args.answer:
            raise UserInputError("give either --input_file or --prompt/--answer pairs, not both")
        return read_rows(args.input_file)
    prompts, answers = args.prompt, args.answer
    if not prompts or not answers:
        raise UserInputError("nothing to score: give --prompt P --answer A (repeatable) or --input_file")
    if len(prompts) == 1:
        prompts = prompts * len(answers)
    if len(prompts) != len(answers):
        raise UserInputError(f"{len(args.prompt)} --prompt but {len(answers)} --answer: give one answer per prompt "
                             "(or one prompt and several answers)")
    return [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]


def validate(args) -> str:
    """Every flag checked before the model is loaded: one clear line each; returns the reward model's folder."""
    from utils.preflight import check_reward_model_path, check_sequence_fits

    if args.max_seq_len < 2:
        raise UserInputError(f"--max_seq_len must be ≥ 2 (a prompt token and an answer token), got {args.max_seq_len}")
    folder = check_reward_model_path("--model_name_or_path", args.model_name_or_path)
    check_sequence_fits("--model_name_or_path", folder, args.max_seq_len, "--max_seq_len")
    if args.input_file is not None and os.path.isdir(args.input_file):
        raise UserInputError(f"--input_file {args.input_file}: is a folder, not a JSON-lines file")
    if args.output_file is not None:
        out = os.path.abspath(args.output_file)
        if os.path.isdir(out):
            raise UserInputError(f"--output_file {args.output_file}: is a folder; give a file name")
        if not os.path.isdir(os.path.dirname(out)):
            raise UserInputError(f"--output_file {args.output_file}: no folder {os.path.dirname(out)} to write it in")
        if args.input_file is not None and os.path.exists(out) and os.path.samefile(out, args.input_file):
            raise UserInputError(f"--output_file {args.output_file} is the --input_file: give another file name")
    return folder


def read_rows(path: str) -> list:
    if not os.path.isfile(path):
        raise UserInputError(f"--input_file {path}: no such file")
    rows = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError as e:
            raise UserInputError(f"--input_file {path}: not UTF-8 text (byte {e.start}: {e.reason}); give JSON "
                                 "lines") from None
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserInputError(f"--input_file {path} line {line_no}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise UserInputError(f"--input_file {path} line {line_no}: a JSON {type(row).__name__}, not an object "
                                     "(rows need prompt+answer or prompt+chosen+rejected)")
            fields = ("prompt", "chosen", "rejected") if "chosen" in row else ("prompt", "answer")
            for field in fields:
                if not isinstance(row.get(field), str):
                    raise UserInputError(f"--input_file {path} line {line_no}: field {field!r} missing or not text "
                                         f"(rows need prompt+answer or prompt+chosen+rejected)")
            rows.append({k: row[k] for k in fields + (("kind",) if "kind" in row else ())})
    if not rows:
        raise UserInputError(f"--input_file {path}: no rows")
    return rows


def text_lengths(tokenizer, pairs, eot: str, chat=None) -> list:
    """``(prompt tokens, whole text tokens)`` of each (prompt, answer) as it would be scored, before truncation."""
    from utils.data.chat_template import dschat_messages

    lengths = []
    for prompt, answer in pairs:
        if chat is not None:
            prompt_ids, answer_ids = chat.conversation_ids(dschat_messages(prompt), answer)
            lengths.append((len(prompt_ids), len(prompt_ids) + len(answer_ids)))
        else:
            lengths.append((len(tokenizer(prompt)["input_ids"]), len(tokenizer(prompt + answer + eot)["input_ids"])))
    return lengths


def report_truncation(lengths: list, where: list, max_seq_len: int) -> None:
    """Texts longer than ``--max_seq_len`` are scored at the cut: said with the numbers; an answer that lies wholly
    beyond it (its score would be the prompt's) is refused."""
    import sys

    cut_away = [(w, p) for w, (p, _) in zip(where, lengths) if p >= max_seq_len]
    if cut_away:
        (row, key), prompt_len = cut_away[0]
        raise UserInputError(f"--max_seq_len {max_seq_len}: {len(cut_away)} of {len(lengths)} answers lie wholly "
                             f"beyond it (first: row {row}'s {key}, after a prompt of {prompt_len} tokens), so their "
                             "score would be the prompt's; raise --max_seq_len or shorten the prompts")
    cut = [total for _, total in lengths if total > max_seq_len]
    if cut:
        print(f"warning: {len(cut)} of {len(lengths)} texts are longer than --max_seq_len {max_seq_len} (up to "
              f"{max(cut)} tokens): they are scored at the cut, not at the answer's end", file=sys.stderr, flush=True)


def check_leading_pads(model, tokenizer, pair, eot: str, chat=None) -> None:
    """The reward model's ``num_padding_at_beginning`` (the folder's, or the flag's) must match what the tokenizer
    puts before a text, or every score is read in the wrong place (as step 2 refuses)."""
    import torch

    from utils.data.chat_template import dschat_messages
    from utils.model.reward_model import count_leading_pads

    prompt, answer = pair
    if chat is not None:
        prompt_ids, answer_ids = chat.conversation_ids(dschat_messages(prompt), answer)
        ids = prompt_ids + answer_ids
    else:
        ids = tokenizer(prompt + answer + eot)["input_ids"]
    found = count_leading_pads(torch.tensor(ids), tokenizer.pad_token_id)
    expected = model.num_padding_at_beginning
    if found != expected:
        raise UserInputError(f"--num_padding_at_beginning {expected}, but this tokenizer starts every text with {found} "
                             f"pad token(s): pass --num_padding_at_beginning {found} (or leave it out: the folder's "
                             "own value)")


def _short(text: str, n: int = 60) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[:n - 1] + "…"


def main(args):
    import torch

    from utils.data.chat_template import chat_format
    from utils.model.critic import load_reward_model

    folder = validate(args)
    rows = rows_from_args(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_reward_model(folder, device, args.num_padding_at_beginning,
                                         apply_chat_template=args.apply_chat_template)
    chat = chat_format(tokenizer, args.model_name_or_path) if args.apply_chat_template else None
    pairs, where = [], []  # (prompt, answer) and (row, field) of each text scored
    for i, row in enumerate(rows):
        for key in ("answer", "chosen", "rejected"):
            if key in row:
                pairs.append((row["prompt"], row[key]))
                where.append((i, key))
    check_leading_pads(model, tokenizer, pairs[0], args.eot_token, chat)
    report_truncation(text_lengths(tokenizer, pairs, args.eot_token, chat), where, args.max_seq_len)
    scores = iter(score_texts(model, tokenizer, pairs, args.max_seq_len, args.eot_token, args.batch_size, device,
                              chat))
    results, correct, compared = [], 0, 0
    for i, row in enumerate(rows):
        out = dict(row)
        if "answer" in row:
            out["score"] = next(scores)
            print(f"[{i}] score {out['score']:+.6f}  prompt: {_short(row['prompt'])!r}  "
                  f"answer: {_short(row['answer'])!r}")
        else:
            out["chosen_score"], out["rejected_score"] = next(scores), next(scores)
            compared += 1
            correct += out["chosen_score"] > out["rejected_score"]
            print(f"[{i}] chosen {out['chosen_score']:+.6f}  rejected {out['rejected_score']:+.6f}  "
                  f"{'ok' if out['chosen_score'] > out['rejected_score'] else 'WRONG'}  "
                  f"prompt: {_short(row['prompt'])!r}")
        results.append(out)
    if compared:
        print(f"accuracy (chosen > rejected): {correct}/{compared} = {correct / compared:.4f}")
        pairs_out = [r for r in results if "chosen_score" in r]
        if any("kind" in r for r in pairs_out):
            by_kind = accuracy_by_kind([r.get("kind") for r in pairs_out], [r["chosen_score"] for r in pairs_out],
                                       [r["rejected_score"] for r in pairs_out])
            print("accuracy per kind: " + ", ".join(f"{k} {v:.4f}" for k, v in by_kind.items() if k != "overall"))
    if args.output_file:
        def write(tmp):
            with open(tmp, "w") as f:
                f.writelines(json.dumps(out) + "\n" for out in results)
        atomic_write(args.output_file, write, "--output_file")
    return {"scores": results, "accuracy": correct / compared if compared else None}


if __name__ == "__main__":
    run_main(main, parse_args())
