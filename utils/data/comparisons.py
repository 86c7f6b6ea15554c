"""Comparisons of a policy's own answers (InstructGPT's K-wise rankings), as a preference dataset.

For each prompt the collector samples K answers from the step-1 actor and a labelling function
scores them (:mod:`utils.reward_functions`: it plays the human labeller). Every two answers the
labeller scores differently make one pair, the better one chosen: up to K·(K−1)/2 pairs per
prompt. Unlike pairs that differ by one edit, these compare answers drawn independently of each
other, the way the answers PPO will score are drawn, so a reward model trained on them learns one
scale for all of them. Pure Python: no torch.

Step 2's ``--kwise`` (InstructGPT's K-wise batching) trains on a prompt's pairs together:
:func:`group_pairs` finds them again in the tokenised pairs, :func:`dedup_answers` numbers a batch's distinct
answers so each is forwarded once.

A row of the written dataset (``train.jsonl`` / ``eval.jsonl``, the layout every step reads)::

    {"prompt": " Human: Describe the lamp. Assistant:", "chosen": " The lamp is kind and calm and warm.",
     "rejected": " The lamp is kind and calm and kind.", "chosen_score": 3.0, "rejected_score": -3.0}
"""
from __future__ import annotations

import re
from typing import Dict, Hashable, List, Sequence, Tuple


def ranked_pairs(prompt: str, answers: Sequence[str], scores: Sequence[float],
                 min_gap: float = 0.0) -> List[Dict[str, object]]:
    """Every pair of differently scored answers to ``prompt``, the better one ``chosen``.

    Answers that are the same text count once (with their first score); ties give no pair, and with ``min_gap``
    two scores closer than it are a tie. Pairs come in the order of the answers (``i < j``), so the result is the
    same for the same input. The answers in some pair stay one connected group (each is paired with the lowest or
    the highest score), which :func:`group_pairs` relies on.
    """
    first = {}
    for answer, score in zip(answers, scores):
        if answer.strip() and answer not in first:
            first[answer] = float(score)
    unique = list(first.items())
    pairs = []
    for i, (a, score_a) in enumerate(unique):
        for b, score_b in unique[i + 1:]:
            if score_a == score_b or abs(score_a - score_b) < min_gap:
                continue
            (chosen, c), (rejected, r) = ((a, score_a), (b, score_b)) if score_a > score_b else \
                ((b, score_b), (a, score_a))
            pairs.append({"prompt": prompt, "chosen": " " + chosen.lstrip(), "rejected": " " + rejected.lstrip(),
                          "chosen_score": c, "rejected_score": r})
    return pairs


def short_cuts(answers: Sequence[str], m: int) -> List[str]:
    """Up to ``m`` short answers cut from a prompt's sampled ``answers`` (no sampling): answer 0's last line, answer
    1's first sentence, answer 2's last line, … — the shapes of the short answers PPO finds first against a reward
    model that never saw one ("P.S. I'm glad I could help."). A cut that is the whole answer, empty, or already
    among the answers or the cuts adds nothing, so fewer than ``m`` may come back. The labeller scores them like
    any answer; with a guard on substance they lose to every full answer that keeps a constraint.
    """
    cuts: List[str] = []
    for j, answer in enumerate(answers[:m]):
        if j % 2 == 0:
            lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
            cut = lines[-1] if lines else ""
        else:
            cut = re.split(r"(?<=[.!?])\s+", answer.strip(), maxsplit=1)[0]
        if cut and cut != answer.strip() and cut not in answers and cut not in cuts:
            cuts.append(cut)
    return cuts


def summarize(pairs_per_prompt: List[int], answers: int, scores: Sequence[float]) -> Dict[str, object]:
    """Counts for the log and ``comparisons.json``: prompts, answers, pairs, prompts with no pair (all tied)."""
    return {"prompts": len(pairs_per_prompt), "answers": answers, "pairs": sum(pairs_per_prompt),
            "prompts_without_pairs": sum(n == 0 for n in pairs_per_prompt),
            "mean_score": sum(scores) / max(len(scores), 1)}


# --------------------------------------------------------------------------- K-wise batching (step 2 --kwise)

def group_pairs(pairs: Sequence[Tuple[Hashable, Hashable]]) -> List[List[int]]:
    """Indices of ``pairs`` (``(chosen, rejected)`` keys, e.g. token-id tuples of ``prompt + answer``), grouped by
    prompt: two pairs go together when they share a text, directly or through other pairs (the connected
    components of the graph whose nodes are the texts and whose edges are the pairs).

    Why that is the prompt: a text begins with its prompt, so texts of different prompts never meet; and
    :func:`ranked_pairs` pairs every two differently scored answers of a prompt, so all of a prompt's paired
    answers are connected (each is paired with every answer of another score). A subset of a prompt's pairs (a
    ``--data_split`` share of them) may fall into several groups, each still of one prompt; a dataset of
    unrelated pairs (hh-rlhf) gives one group per pair.

    Groups come in the order of their first pair, each group's indices ascending: the same input gives the same
    groups. Pure Python.
    """
    parent: Dict[Hashable, Hashable] = {}

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]  # path halving
            x = parent[x]
        return x

    for chosen, rejected in pairs:
        for key in (chosen, rejected):
            parent.setdefault(key, key)
        a, b = root(chosen), root(rejected)
        if a != b:
            parent[b] = a
    groups: Dict[Hashable, List[int]] = {}
    for i, (chosen, _) in enumerate(pairs):
        groups.setdefault(root(chosen), []).append(i)
    return list(groups.values())


def dedup_answers(pairs: Sequence[Tuple[Hashable, Hashable]]) -> Tuple[List[Hashable], List[int], List[int]]:
    """``(texts, chosen_index, rejected_index)``: the distinct texts of ``pairs`` in first-seen order (chosen before
    rejected within a pair), and for pair ``i`` the positions of its chosen and rejected text in ``texts``. A batch
    forwards ``texts`` once each; pair ``i`` reads rows ``chosen_index[i]`` and ``rejected_index[i]``."""
    position: Dict[Hashable, int] = {}
    chosen_index, rejected_index = [], []
    for chosen, rejected in pairs:
        chosen_index.append(position.setdefault(chosen, len(position)))
        rejected_index.append(position.setdefault(rejected, len(position)))
    return list(position), chosen_index, rejected_index
