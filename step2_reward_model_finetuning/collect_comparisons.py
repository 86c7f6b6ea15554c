#!/usr/bin/env python
"""Collect comparisons for step 2 from the step-1 actor's own answers, ranked by a labelling function.

    python step2_reward_model_finetuning/collect_comparisons.py --actor_model_name_or_path out/actor \\
        --data_path builtin/demonstrations --label_fn builtin_preference --num_answers 4 --output_dir out/comparisons
    python step2_reward_model_finetuning/main.py --data_path out/comparisons --data_split 0,1,0 ...

parse → prompts of the ``--phase`` share (the reward model's, 2, by default) of ``--data_path`` →
the actor samples ``--num_answers`` answers per prompt → ``--label_fn`` scores them (the human
labeller: a built-in name or ``path/to/file.py:function``, as step 3's ``--reward_fn``) → every pair of
differently scored answers, better first (:mod:`utils.data.comparisons`) → ``train.jsonl`` and
``eval.jsonl`` (from the dataset's train and eval splits; no eval file when the eval prompts gave no pair),
``answers.jsonl`` (each prompt's row, its answers and their scores) and ``comparisons.json`` (counts, settings)
in ``--output_dir``, written atomically: a failed run leaves the folder as it was (none, if it made it). The
folder is the run's :class:`~utils.run_folder.RunFolder`: locked, and ``--overwrite`` replaces exactly what an
earlier collection wrote (an old ``eval.jsonl`` included), nothing else.

Sampling is the collection's cost; labelling is cheap. ``--from_answers DIR`` labels the answers an earlier
collection kept in ``DIR/answers.jsonl`` with another ``--label_fn`` (or ``--min_gap``) and writes their pairs,
no actor loaded::

    python step2_reward_model_finetuning/collect_comparisons.py --from_answers out/comparisons \
        --label_fn my_labels.py:label --min_gap 0.1 --output_dir out/comparisons-relabelled
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import math
import os
import time

from utils.arguments import HelpFormatter, add_trust_remote_code_arg, seed_int
from utils.data.comparisons import ranked_pairs, short_cuts, summarize
from utils.entrypoint import run_main
from utils.errors import UserInputError
from utils.files import atomic_directory
from utils.preflight import check_causal_lm_path, check_output_dir_writable
from utils.run_folder import RunFolder
from utils.reward_functions import BUILTIN, call_reward_fn, check_rows, load_reward_fn


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--actor_model_name_or_path", help="The step-1 actor (or any causal LM); not with --from_answers.")
    p.add_argument("--from_answers", default=None, metavar="DIR",
                   help="Label the answers an earlier collection kept (DIR/answers.jsonl) instead of sampling new "
                        "ones: another --label_fn or --min_gap without the sampling's cost (the data and sampling "
                        "flags are then the earlier run's).")
    p.add_argument("--data_path", nargs="+", default=["builtin/demonstrations"],
                   help="Datasets whose prompts are answered (the forms every step takes).")
    p.add_argument("--data_split", default="2,4,4", help="Phase shares, as the steps' flag.")
    p.add_argument("--phase", type=int, default=2, choices=(1, 2, 3),
                   help="Whose prompts: the reward model's share (2) keeps them apart from steps 1 and 3.")
    p.add_argument("--data_output_path", default="/tmp/data_files/", help="Where split indices are cached.")
    p.add_argument("--label_fn", required=True,
                   help=f"Scores the answers: built in {', '.join(BUILTIN)}, or path/to/file.py:function (called with "
                        "the prompts, the answers and the dataset rows; returns one float per answer).")
    p.add_argument("--num_answers", type=int, default=4, help="Answers sampled per prompt (K): up to K·(K−1)/2 pairs.")
    p.add_argument("--min_gap", type=float, default=0.0,
                   help="Two answers whose scores differ by less than this are a tie and give no pair (0: only equal "
                        "scores tie). A labeller's small differences are often noise the reward model cannot learn.")
    p.add_argument("--short_answers", type=int, default=0, metavar="M",
                   help="Add to each train prompt up to M short answers cut from its sampled ones (a last line, a "
                        "first sentence; no sampling), scored by the labeller like the rest: pairs that show the "
                        "reward model a short answer losing to a full one, the reward hack PPO finds first against "
                        "a reward model that never saw one (docs/real-model.md). The eval pairs stay the sampled "
                        "answers' alone. 0: none.")
    p.add_argument("--max_prompts", type=int, default=0, help="Prompts of the train split to answer (0 = all).")
    p.add_argument("--max_eval_prompts", type=int, default=0, help="Prompts of the eval split to answer (0 = all).")
    p.add_argument("--max_new_tokens", type=int, default=32, help="Tokens generated per answer (at most).")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    p.add_argument("--top_k", type=int, default=0, help="Top-k sampling (0 = off).")
    p.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling (1 = off).")
    p.add_argument("--batch_size", type=int, default=64, help="Prompts generated together.")
    p.add_argument("--seed", type=seed_int, default=1234, help="Seed of the split and of the sampling.")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one).")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="The actor's weights while it samples (default: fp32 on a CPU, the folder's own on a GPU); "
                        "bf16 samples about twice as fast on a CPU with bf16 instructions, from a slightly different "
                        "distribution (as step 3's --generation_dtype).")
    p.add_argument("--apply_chat_template", action="store_true",
                   help="Answer in the actor's chat template (as the steps' flag); the pairs keep the prompts' text, "
                        "so step 2 reads them with --apply_chat_template too.")
    p.add_argument("--output_dir", required=True, help="Where train.jsonl, eval.jsonl, answers.jsonl and comparisons.json go.")
    p.add_argument("--overwrite", action="store_true", help="Replace the comparisons an earlier run wrote there.")
    add_trust_remote_code_arg(p)
    return p.parse_args(argv)


OUTPUTS = ("train.jsonl", "eval.jsonl", "answers.jsonl", "comparisons.json")
ANSWERS = "answers.jsonl"  # a line a prompt: {"split", "prompt", "row", "answers", "scores"}


def validate(args) -> None:
    if (args.actor_model_name_or_path is None) == (args.from_answers is None):
        raise UserInputError("give --actor_model_name_or_path (sample answers and label them) or --from_answers DIR "
                             "(label the answers an earlier collection kept), one of the two")
    if not (math.isfinite(args.min_gap) and args.min_gap >= 0):
        raise UserInputError(f"--min_gap must be a number ≥ 0, got {args.min_gap}")
    if args.from_answers is not None and not os.path.isfile(os.path.join(args.from_answers, ANSWERS)):
        raise UserInputError(f"--from_answers {args.from_answers}: no {ANSWERS} there (a collection keeps its answers "
                             "in it; one made before it did must be collected again)")
    if args.from_answers is not None and os.path.realpath(args.from_answers) == os.path.realpath(args.output_dir):
        raise UserInputError(f"--from_answers {args.from_answers} is the --output_dir: write the relabelled pairs to "
                             "another folder (the answers are read from this one)")
    for name in ("num_answers", "max_new_tokens", "batch_size"):
        if getattr(args, name) < (2 if name == "num_answers" else 1):
            raise UserInputError(f"--{name} must be ≥ {2 if name == 'num_answers' else 1}, got {getattr(args, name)}")
    if args.short_answers < 0:
        raise UserInputError(f"--short_answers must be ≥ 0 (0 = none), got {args.short_answers}")
    for name in ("max_prompts", "max_eval_prompts"):
        if getattr(args, name) < 0:
            raise UserInputError(f"--{name} must be ≥ 0 (0 = all), got {getattr(args, name)}")
    if not (math.isfinite(args.temperature) and args.temperature > 0 and 0 < args.top_p <= 1 and args.top_k >= 0):
        raise UserInputError("sampling needs --temperature > 0, 0 < --top_p ≤ 1 and --top_k ≥ 0")
    earlier = [name for name in OUTPUTS if os.path.exists(os.path.join(args.output_dir, name))]
    if earlier and not args.overwrite:
        raise UserInputError(f"--output_dir {args.output_dir} already holds comparisons ({', '.join(earlier)}); pass "
                             "--overwrite to replace them, or give another --output_dir")


def sample(model, tokenizer, args, prompts_rows: list, split: str) -> list:
    """``[P][K]``: ``--num_answers`` answers the actor samples for each prompt of one split's ``(prompt, row)``
    list (the eval split's seed is the train split's + 1)."""
    from tqdm import tqdm

    from utils.data.chat_template import chat_format
    from utils.answers import generate_answers

    prompts = [p for p, _ in prompts_rows]
    K = args.num_answers
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    with tqdm(total=len(prompts), desc=f"answering {split} prompts ({K} each)", unit="prompt") as bar:
        answers = generate_answers(model, tokenizer, prompts, args.max_new_tokens, sampling, per_prompt=K,
                                   seed=args.seed + (split == "eval"), batch_size=args.batch_size,
                                   progress=bar.update, chat=chat_format(tokenizer) if args.apply_chat_template else None)
    return [answers[i * K:(i + 1) * K] for i in range(len(prompts))]


def label(label_fn, args, prompts_rows: list, answers: list, split: str) -> tuple:
    """``(pairs, pairs per prompt, scores, kept)`` for one split: ``answers`` ``[P][K]`` (K may differ per prompt)
    scored by ``--label_fn`` in one call, every pair of answers whose scores differ by at least ``--min_gap`` (ties
    left out), and ``kept``, each prompt's line of ``answers.jsonl``."""
    prompts = [p for (p, _), group in zip(prompts_rows, answers) for _ in group]
    rows = [r for (_, r), group in zip(prompts_rows, answers) for _ in group]
    flat = [a for group in answers for a in group]
    scores = call_reward_fn(label_fn, args.label_fn, prompts, flat, rows, flag="--label_fn") if flat else []
    pairs, counts, kept, start = [], [], [], 0
    for (prompt, row), group in zip(prompts_rows, answers):
        own = [float(x) for x in scores[start:start + len(group)]]
        start += len(group)
        found = ranked_pairs(prompt, group, own, min_gap=args.min_gap)
        kinds = row.get("instruction_id_list")  # IFEval rows: a pair's constraint types, for a per-type accuracy
        pairs += [dict(pair, instruction_id_list=kinds) for pair in found] if kinds else found
        counts.append(len(found))
        kept.append({"split": split, "prompt": prompt, "row": row, "answers": list(group), "scores": own})
    return pairs, counts, scores, kept


def earlier_settings(folder: str) -> dict:
    """The ``settings`` of the collection that wrote ``folder`` (its ``comparisons.json``), ``{}`` without one."""
    try:
        with open(os.path.join(folder, "comparisons.json")) as f:
            return json.load(f).get("settings", {})
    except (OSError, ValueError):
        return {}


def earlier_answers(folder: str) -> dict:
    """``{"train": [line], "eval": [line]}``: the ``answers.jsonl`` lines an earlier collection kept in ``folder``."""
    found = {"train": [], "eval": []}
    with open(os.path.join(folder, ANSWERS)) as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                found[record["split"]].append(record)
                assert isinstance(record["answers"], list) and isinstance(record["prompt"], str)
            except (ValueError, KeyError, AssertionError, TypeError):
                raise UserInputError(f"--from_answers {folder}: line {n} of {ANSWERS} is not a line a collection "
                                     "writes ({\"split\": \"train\" or \"eval\", \"prompt\", \"row\", \"answers\"})") from None
    return found


def check_answers_fit(args, prompts: list) -> None:
    """The longest prompt (in the chat template with ``--apply_chat_template``) and ``--max_new_tokens`` fit the
    actor's positions: refused with the numbers before the model loads or the folder is touched."""
    from utils.data.chat_template import chat_format
    from utils.answers import check_room
    from utils.model.model_utils import load_hf_tokenizer, resolve_model_name_or_path
    from utils.preflight import model_positions

    path = resolve_model_name_or_path(args.actor_model_name_or_path)
    positions = model_positions(path)
    if positions is None:
        return
    tokenizer = load_hf_tokenizer(path, apply_chat_template=args.apply_chat_template)
    check_room("--actor_model_name_or_path", positions, tokenizer,
               chat_format(tokenizer) if args.apply_chat_template else None, prompts, args.max_new_tokens)


def check_data(args) -> dict:
    """``{"train": [(prompt, row)], "eval": [...]}``: the prompts the collector answers, each split cut to its limit;
    refused when the train split has none or a built-in ``--label_fn`` lacks the columns it reads. Needs no model, so
    train.py runs it before step 1."""
    from utils.data.data_utils import phase_prompts

    if args.from_answers is not None:
        data = {split: [(r["prompt"], r.get("row") or {}) for r in lines]
                for split, lines in earlier_answers(args.from_answers).items()}
    else:
        data = phase_prompts(args.data_path, args.data_split, args.data_output_path, args.phase, args.seed)
    limits = {"train": args.max_prompts, "eval": args.max_eval_prompts}
    data = {split: rows[:limits[split]] if limits[split] else rows for split, rows in data.items()}
    if not data["train"]:
        raise UserInputError(f"--data_path {' '.join(args.data_path)}: no prompts in phase {args.phase}'s share of "
                             f"the train split (--data_split {args.data_split})")
    for split, rows in data.items():
        check_rows(args.label_fn, [p for p, _ in rows], [r for _, r in rows], flag="--label_fn")
    return data


def main(args):
    # ---- fail fast: flags, the actor, the output folder, the labelling function and the data
    validate(args)
    if args.from_answers is None:
        check_causal_lm_path("--actor_model_name_or_path", args.actor_model_name_or_path)
    check_output_dir_writable(args.output_dir)
    label_fn = load_reward_fn(args.label_fn, flag="--label_fn")
    data = check_data(args)
    if args.from_answers is None:
        check_answers_fit(args, [p for rows in data.values() for p, _ in rows])
    folder = RunFolder(args.output_dir).claim(args.overwrite)  # last: nothing is moved when a check fails
    with folder:
        return run(args, folder, data, label_fn)


def run(args, folder, data: dict, label_fn) -> dict:
    """Answer ``data``'s prompts with the actor (or take an earlier collection's answers), label and pair the
    answers, write them into ``folder``."""
    start, written, kept, report = time.time(), {}, [], {}
    settings = {k: getattr(args, k) for k in ("actor_model_name_or_path", "data_path", "data_split", "phase",
                                              "label_fn", "num_answers", "min_gap", "temperature", "top_k", "top_p",
                                              "seed", "dtype", "short_answers")}
    if args.from_answers is not None:  # the answers (and how they were sampled) are the earlier run's
        earlier = earlier_answers(args.from_answers)
        answers = {split: [r["answers"] for r in earlier[split][:len(rows)]] for split, rows in data.items()}
        sampled = earlier_settings(args.from_answers)
        relabelled = ("label_fn", "min_gap", "short_answers")  # this run's; the rest the sampling's
        settings.update({k: sampled.get(k) for k in settings if k not in relabelled},
                        from_answers=args.from_answers)
    else:  # ---- the actor samples
        import torch

        from utils.answers import load_for_answers
        from utils.model.model_utils import resolve_model_name_or_path

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = load_for_answers(resolve_model_name_or_path(args.actor_model_name_or_path), device,
                                            apply_chat_template=args.apply_chat_template,
                                            trust_remote_code=args.trust_remote_code,
                                            dtype={"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype))
        answers = {split: sample(model, tokenizer, args, rows, split) if rows else [] for split, rows in data.items()}

    if args.short_answers:  # the train split's only: the eval pairs stay the sampled answers' (pair accuracy)
        k = settings["num_answers"] or args.num_answers  # the sampling's (an earlier collection's with --from_answers)
        answers["train"] = [group + short_cuts(group[:k], args.short_answers) for group in answers["train"]]

    # ---- label, pair; then write everything at once
    for split, rows in data.items():
        pairs, counts, scores, lines = label(label_fn, args, rows, answers[split], split)
        written[split], kept = pairs, kept + lines
        report[split] = summarize(counts, len(scores), scores)
        print(f"{split}: {report[split]['prompts']} prompts, {report[split]['answers']} answers -> "
              f"{report[split]['pairs']} pairs ({report[split]['prompts_without_pairs']} prompts all tied); mean "
              f"{args.label_fn} score {report[split]['mean_score']:.3f}", flush=True)
    if not written["train"]:
        raise UserInputError(f"--label_fn {args.label_fn} gave every answer of every prompt the same score: no pair "
                             "to train on")
    if not written["eval"]:
        print("no eval pairs (every eval prompt's answers tied, or none asked for): eval.jsonl is left out, so step 2 "
              "splits the train pairs 9:1 for its evaluation", flush=True)

    def write(path):
        with atomic_directory(path) as tmp:
            for split, pairs in written.items():
                if not pairs:
                    continue
                with open(os.path.join(tmp, f"{split}.jsonl"), "w") as f:
                    f.writelines(json.dumps(pair) + "\n" for pair in pairs)
            with open(os.path.join(tmp, ANSWERS), "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in kept)
            with open(os.path.join(tmp, "comparisons.json"), "w") as f:
                json.dump({"settings": settings, **report, "seconds": time.time() - start}, f, indent=1)

    folder.save_final([(None, write)])
    print(f"wrote {len(written['train'])} train and {len(written['eval'])} eval comparisons to {args.output_dir} "
          f"({time.time() - start:.1f}s); train a reward model on them with: --data_path {args.output_dir} "
          "--data_split 0,1,0", flush=True)
    return report


if __name__ == "__main__":
    run_main(main, parse_args())
