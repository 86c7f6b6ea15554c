"""Comparisons of a policy's own answers (InstructGPT's K-wise rankings), as a preference dataset.

For each prompt the collector samples K answers from the step-1 actor and a labelling function
scores them (:mod:`utils.reward_functions`: it plays the human labeller). Every two answers the
labeller scores differently make one pair, the better one chosen: up to K·(K−1)/2 pairs per
prompt. Unlike pairs that differ by one edit, these compare answers drawn independently of each
other, the way the answers PPO will score are drawn, so a reward model trained on them learns one
scale for all of them. Pure Python: no torch.

A row of the written dataset (``train.jsonl`` / ``eval.jsonl``, the layout every step reads)::

    {"prompt": " Human: Describe the lamp. Assistant:", "chosen": " The lamp is kind and calm and warm.",
     "rejected": " The lamp is kind and calm and kind.", "chosen_score": 3.0, "rejected_score": -3.0}
"""
from __future__ import annotations

from typing import Dict, List, Sequence


def ranked_pairs(prompt: str, answers: Sequence[str], scores: Sequence[float]) -> List[Dict[str, object]]:
    """Every pair of differently scored answers to ``prompt``, the better one ``chosen``.

    Answers that are the same text count once (with their first score); ties give no pair. Pairs come
    in the order of the answers (``i < j``), so the result is the same for the same input.
    """
    first = {}
    for answer, score in zip(answers, scores):
        if answer.strip() and answer not in first:
            first[answer] = float(score)
    unique = list(first.items())
    pairs = []
    for i, (a, score_a) in enumerate(unique):
        for b, score_b in unique[i + 1:]:
            if score_a == score_b:
                continue
            (chosen, c), (rejected, r) = ((a, score_a), (b, score_b)) if score_a > score_b else \
                ((b, score_b), (a, score_a))
            pairs.append({"prompt": prompt, "chosen": " " + chosen.lstrip(), "rejected": " " + rejected.lstrip(),
                          "chosen_score": c, "rejected_score": r})
    return pairs


def summarize(pairs_per_prompt: List[int], answers: int, scores: Sequence[float]) -> Dict[str, object]:
    """Counts for the log and ``comparisons.json``: prompts, answers, pairs, prompts with no pair (all tied)."""
    return {"prompts": len(pairs_per_prompt), "answers": answers, "pairs": sum(pairs_per_prompt),
            "prompts_without_pairs": sum(n == 0 for n in pairs_per_prompt),
            "mean_score": sum(scores) / max(len(scores), 1)}
