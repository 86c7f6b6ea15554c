"""The held-out check of a built-in run: what the actors answer, judged without the reward model.

``train.py`` calls :func:`heldout_check` after the steps when the run used built-in
data. It takes the first distinct prompts of the built-in *eval* split, lets the
step-1 actor and the step-3 actor answer them greedily (plain Hugging Face
``model.generate`` on the saved folders) and scores the answers with the rules of
:mod:`utils.data.rule_score`. When step 3 sampled its answers (``--do_sample``), both actors
also answer each prompt :data:`PER_PROMPT` times with step 3's sampling settings (seeded):
PPO improves the distribution it samples from, and the greedy answer (that distribution's
most likely token at each position) can move differently, e.g. repeat a word where most of
the samples do not. It also scores every held-out pair with the step-2
reward model to give its accuracy per rejected kind (``fewer_good``,
``wrong_object``, ``repeated_word``, …: :mod:`utils.data.builtin`), and answers of known rank
drawn independently for the same prompts (three, two or one good word, or a repeat) to show
whether it puts different answers on one scale, which is what PPO relies on. A few hundred
short texts on a tiny model: seconds on a CPU.

The result (a dict, stored in ``summary.json`` under ``"heldout"``)::

    {"prompts": 40, "max_new_tokens": 32,
     "sampling": {"temperature": 1.0, "top_k": 5, "top_p": 1.0, "per_prompt": 8, "seed": 1234},  # or absent
     "actors": {"1": {"dir", "rule_score", "checks": {...}, "all_four", "mean_words", "n", "samples",
                      "sampled": {"rule_score", "checks", "all_four", "mean_words", "n"}},  # with "sampling"
                "3": {...}},
     "reward_model": {"dir", "pairs", "accuracy": {"overall": 0.95, "repeated_word": 0.92, ...},
                      "scale": {"prompts": 40, "per_class": 8,
                                "ranked": {"three_good>two_good": 0.74, ..., "one_good>repeat": 0.18}}}}
"""
from __future__ import annotations

import random
from typing import Dict, List, Optional, Tuple

from utils.data import rule_score
from utils.data.builtin import SCALE_CLASSES, load_builtin, scale_answer
from utils.run_folder import RunFolder

N_PROMPTS = 40
MAX_NEW_TOKENS = 32
N_SAMPLES = 3
PER_PROMPT = 8  # sampled answers per prompt (with step 3's sampling settings)
SEED = 1234
PER_CLASS = 8  # independent answers per class and prompt in the reward model's scale check
PAIRS = "builtin/preference"  # the held-out pairs, labelled by kind, the reward model's accuracy is measured on
# class pairs of the scale check, better first: the rules' order, where one good word still beats a repeat
SCALE_PAIRS = (("three_good", "two_good"), ("two_good", "one_good"), ("three_good", "repeat"), ("one_good", "repeat"))


def heldout_prompts(dataset: str = "builtin/preference", n: int = N_PROMPTS) -> List[str]:
    """The first ``n`` distinct prompts of the built-in dataset's eval split, in order."""
    prompts = []
    for row in load_builtin(dataset)["eval"]:
        if row["prompt"] not in prompts:
            prompts.append(row["prompt"])
        if len(prompts) == n:
            break
    return prompts


def actor_answers(model_dir: str, prompts: List[str], max_new_tokens: int = MAX_NEW_TOKENS,
                  sampling: Optional[dict] = None, per_prompt: int = 1, seed: int = SEED) -> List[str]:
    """Answers of the causal LM in ``model_dir`` to ``prompts`` (decoded, cut at a new "Human:" turn), on the CPU.

    Greedy by default: one answer per prompt, in order. With ``sampling`` (``{"temperature",
    "top_k", "top_p"}``, as step 3's flags) ``per_prompt`` sampled answers per prompt, prompt by
    prompt, seeded (:func:`utils.answers.generate_answers`).
    """
    from utils.answers import generate_answers, load_for_answers

    model, tokenizer = load_for_answers(model_dir)
    return generate_answers(model, tokenizer, prompts, max_new_tokens, sampling, per_prompt, seed)


def actor_report(model_dir: str, prompts: List[str], sampling: Optional[dict] = None) -> dict:
    """Rule-score summary of the greedy answers of the actor in ``model_dir`` (+ its first answers as samples).

    With ``sampling``, also ``"sampled"``: the summary of :data:`PER_PROMPT` sampled answers per prompt.
    """
    answers = actor_answers(model_dir, prompts)
    report = {"dir": model_dir, **rule_score.summarize(prompts, answers)}
    report["samples"] = [{"prompt": p.strip(), "answer": a} for p, a in zip(prompts[:N_SAMPLES], answers)]
    if sampling is not None:
        sampled = actor_answers(model_dir, prompts, sampling=sampling, per_prompt=PER_PROMPT)
        report["sampled"] = rule_score.summarize([p for p in prompts for _ in range(PER_PROMPT)], sampled)
    return report


def scale_answers(prompts: List[str], per_class: int = PER_CLASS, seed: int = SEED) -> List[Tuple[str, str, str]]:
    """``(prompt, class, answer)`` rows: ``per_class`` answers of each of :data:`SCALE_CLASSES` per prompt, each
    drawn independently of the others (prompts without an object to describe are skipped)."""
    rng = random.Random(seed)
    rows = []
    for prompt in prompts:
        noun = rule_score.asked_object(prompt)
        if noun is None:
            continue
        rows += [(prompt, cls, scale_answer(rng, noun, cls)) for cls in SCALE_CLASSES for _ in range(per_class)]
    return rows


def ranked_shares(rows: List[Tuple[str, str, str]], scores: List[float]) -> Dict[str, float]:
    """For each pair of classes in :data:`SCALE_PAIRS` (better first), the share of same-prompt answer pairs
    the scores rank as the rules do (better > worse; a tie counts half), keyed ``"better>worse"``."""
    by = {}
    for (prompt, cls, _), score in zip(rows, scores):
        by.setdefault((prompt, cls), []).append(score)
    prompts = {prompt for prompt, _, _ in rows}
    shares = {}
    for better, worse in SCALE_PAIRS:
        pairs = [(x, y) for p in prompts for x in by.get((p, better), []) for y in by.get((p, worse), [])]
        if pairs:
            shares[f"{better}>{worse}"] = sum((x > y) + 0.5 * (x == y) for x, y in pairs) / len(pairs)
    return shares


def reward_model_report(rm_dir: str, prompts: List[str], dataset: str = "builtin/preference") -> dict:
    """The step-2 model in ``rm_dir`` on held-out data: accuracy (chosen > rejected) on every held-out pair,
    overall and per kind, and under ``"scale"`` how it ranks answers drawn independently for each of ``prompts``
    (:func:`scale_answers`, :func:`ranked_shares`; the pairs are mostly small edits of each other, which a
    reward model can rank right without putting different answers on one scale, and PPO exploits that)."""
    from utils.model.scoring import accuracy_by_kind, score_pair_sides, score_texts
    from utils.model.critic import load_reward_model

    rows = load_builtin(dataset)["eval"]
    model, tokenizer = load_reward_model(rm_dir)
    chosen, rejected = score_pair_sides(model, tokenizer, rows, max_seq_len=128, eot=tokenizer.eos_token,
                                        batch_size=64)
    accuracy = accuracy_by_kind([r.get("kind") for r in rows], chosen, rejected)
    scale_rows = scale_answers(prompts)
    scale_scores = score_texts(model, tokenizer, [(p, a) for p, _, a in scale_rows], max_seq_len=128,
                               eot=tokenizer.eos_token, batch_size=64)
    scale = {"prompts": len({p for p, _, _ in scale_rows}), "per_class": PER_CLASS,
             "ranked": ranked_shares(scale_rows, scale_scores)}
    return {"dir": rm_dir, "pairs": len(rows), "accuracy": accuracy, "scale": scale}


def heldout_check(actor_dirs: Dict[int, str], rm_dir: str | None, dataset: str = "builtin/preference",
                  sampling: Optional[dict] = None) -> dict:
    """Rule scores of the actors in ``actor_dirs`` (step -> output folder: its model, step 3's ``actor/``, is
    found by :meth:`~utils.run_folder.RunFolder.model_dir`) and the reward model's accuracy per kind.

    ``sampling``: step 3's ``{"temperature", "top_k", "top_p"}`` when it sampled, to score sampled
    answers too. Folders without a model are skipped; the result's layout is in the module docstring.
    """
    prompts = heldout_prompts(dataset)
    result = {"prompts": len(prompts), "max_new_tokens": MAX_NEW_TOKENS, "actors": {}}
    if sampling is not None:
        result["sampling"] = {**sampling, "per_prompt": PER_PROMPT, "seed": SEED}
    for step, folder in sorted(actor_dirs.items()):
        model = RunFolder(folder).model_dir()
        if model:
            result["actors"][str(step)] = actor_report(model, prompts, sampling)
    if rm_dir and RunFolder(rm_dir).model_dir():  # the labelled pairs of builtin/preference (demonstrations have none)
        result["reward_model"] = reward_model_report(rm_dir, prompts, PAIRS)
    return result
