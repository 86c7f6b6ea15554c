"""Scoring texts with a step-2 reward model, shared by ``rw_eval.py`` and the held-out check (:mod:`utils.heldout`).

* :func:`score_texts`: the end score (``forward_value``'s, :mod:`utils.model.reward_model`) of each
  ``prompt + answer + eot``;
* :func:`score_pair_sides`: the chosen and the rejected answers' scores of comparison pairs;
* :func:`accuracy_by_kind`: the share of pairs whose chosen answer scores higher, overall and per kind;
* :func:`score_answers`: N answers to each of P prompts scored in batches, ``[P, N]``;
* :func:`best_of_n`: each prompt's best-scored answer (best-of-n selection by a reward model);
* :func:`regularized_best_of_n`: the same, pulled toward the prompt's typical answer (against reward hacking);
* :func:`pair_accuracy_by_group`: pair accuracy per group (e.g. per constraint type), with the counts.
"""
from __future__ import annotations


def _template_batch(tokenizer, chat, chunk, max_seq_len: int):
    """``(ids, mask, prompt lengths)`` of ``(prompt, answer)`` pairs in the chat template's format, right-padded."""
    import torch

    from utils.data.chat_template import dschat_messages
    from utils.data.data_utils import _right_pad

    seqs, prompt_lengths = [], []
    for prompt, answer in chunk:
        prompt_ids, answer_ids = chat.conversation_ids(dschat_messages(prompt), answer)
        seqs.append(torch.tensor((prompt_ids + answer_ids)[:max_seq_len]))
        prompt_lengths.append(min(len(prompt_ids), max_seq_len))
    ids, mask = _right_pad(seqs, max(len(s) for s in seqs), tokenizer.pad_token_id)
    return ids, mask, torch.tensor(prompt_lengths)


def score_texts(model, tokenizer, pairs, max_seq_len: int, eot: str, batch_size: int = 16, device="cpu",
                chat=None) -> list:
    """End scores of ``prompt + answer + eot`` for ``pairs`` of (prompt, answer), or, with ``chat`` (a
    :class:`~utils.data.chat_template.ChatFormat`), of the pair in its chat template's format; list of floats,
    one a pair, in their order.

    Each distinct pair is scored once (a comparison set names an answer in up to K−1 pairs), and the batches
    take them longest first, so a batch pads to lengths near its own (equal pairs get equal scores)."""
    import torch

    pairs = [tuple(pair) for pair in pairs]
    # each distinct pair once, longest first (characters ~ tokens; equal lengths in first-seen order)
    longest_first = sorted(dict.fromkeys(pairs), key=lambda pair: -len(pair[0] + pair[1]))
    scored = {}  # pair -> its end score
    for i in range(0, len(longest_first), batch_size):
        chunk = longest_first[i:i + batch_size]
        if chat is not None:
            ids, mask, prompt_lengths = _template_batch(tokenizer, chat, chunk, max_seq_len)
        else:
            batch = tokenizer([p + a + eot for p, a in chunk], truncation=True, max_length=max_seq_len,
                              padding=True, return_tensors="pt")  # right padding (load_hf_tokenizer)
            prompt_lengths = torch.tensor([len(tokenizer(p, truncation=True, max_length=max_seq_len)["input_ids"])
                                           for p, _ in chunk])
            ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            out = model.forward_value(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      prompt_length=prompt_lengths.to(device))
        scored.update(zip(chunk, out["chosen_end_scores"].float().tolist()))
    return [scored[pair] for pair in pairs]


def score_pair_sides(model, tokenizer, pairs: list, max_seq_len: int, eot: str = "", batch_size: int = 16,
                     device="cpu", chat=None) -> tuple:
    """``(chosen scores, rejected scores)``, two lists of floats, of comparison ``pairs`` (dicts with ``prompt``,
    ``chosen``, ``rejected``), both sides in one :func:`score_texts` call, so an answer in several pairs, on
    either side, is scored once."""
    texts = [(p["prompt"], p[side]) for side in ("chosen", "rejected") for p in pairs]
    scores = score_texts(model, tokenizer, texts, max_seq_len, eot, batch_size, device, chat)
    return scores[:len(pairs)], scores[len(pairs):]


def accuracy_by_kind(kinds: list, chosen_scores: list, rejected_scores: list) -> dict:
    """``{"overall": acc, kind: acc, ...}``: share of pairs with chosen > rejected, overall and per kind."""
    groups = {"overall": []}
    for kind, c, r in zip(kinds, chosen_scores, rejected_scores):
        correct = c > r
        groups["overall"].append(correct)
        if kind is not None:
            groups.setdefault(kind, []).append(correct)
    return {kind: sum(v) / len(v) for kind, v in groups.items() if v}


def score_answers(model, tokenizer, prompts: list, answers: list, max_seq_len: int, eot: str, batch_size: int = 16,
                  device="cpu", chat=None):
    """``[P, N]`` float32 end scores (:func:`score_texts`, in batches of ``batch_size`` texts) of ``answers[p][n]``
    to ``prompts[p]``; N = the most answers a prompt has, a prompt with fewer is NaN-padded (which
    :func:`best_of_n` never picks)."""
    import torch

    if len(prompts) != len(answers):
        raise ValueError(f"score_answers: {len(prompts)} prompts but {len(answers)} answer lists")
    flat = [(prompt, answer) for prompt, row in zip(prompts, answers) for answer in row]
    scores = score_texts(model, tokenizer, flat, max_seq_len, eot, batch_size, device, chat) if flat else []
    out = torch.full((len(prompts), max((len(row) for row in answers), default=0)), float("nan"))
    at = 0
    for p, row in enumerate(answers):
        out[p, :len(row)] = torch.tensor(scores[at:at + len(row)], dtype=out.dtype)
        at += len(row)
    return out


def best_of_n(scores):
    """Each row's best answer: ``[P]`` long, the index of the row's largest score, the first of equal ones.

    A NaN score is never chosen (a reward model that returns NaN for an answer has not ranked it; ``argmax``
    would pick the NaN), unless the whole row is NaN: then index 0, the first answer, as if unranked. ``±inf``
    are ordinary scores.

    Args:
        scores: ``[P, N]`` float, N ≥ 1 answers per prompt (e.g. :func:`score_answers`).

    Returns:
        ``[P]`` long indices into each row.
    """
    import torch

    if scores.dim() != 2 or scores.shape[1] < 1:
        raise ValueError(f"best_of_n needs [P, N ≥ 1] scores, got shape {tuple(scores.shape)}")
    valid = ~torch.isnan(scores)  # [P, N]
    best = scores.masked_fill(~valid, float("-inf")).max(dim=1, keepdim=True).values  # [P, 1]
    hit = valid & (scores == best)  # NaN == x is False
    columns = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
    first = torch.where(hit, columns, torch.full_like(columns, scores.shape[1])).min(dim=1).values
    return torch.where(valid.any(dim=1), first, torch.zeros_like(first))


def _row_z(values):
    """``values`` ``[P, N]`` standardised within each row over its non-NaN entries (population std); a row whose
    entries are all equal gives 0s, NaN stays NaN."""
    import torch

    valid = ~torch.isnan(values)
    count = valid.sum(dim=1, keepdim=True).clamp(min=1)
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = filled.sum(dim=1, keepdim=True) / count
    spread = (torch.where(valid, values - mean, torch.zeros_like(values)) ** 2).sum(dim=1, keepdim=True) / count
    std = spread.sqrt()
    return torch.where(std > 0, (values - mean) / torch.where(std > 0, std, torch.ones_like(std)),
                       torch.zeros_like(values))


def regularized_best_of_n(scores, consensus, beta: float):
    """Best-of-n pulled toward each prompt's typical answer: the index of the largest
    ``z(score) + beta · z(consensus)``, ``z`` standardising over the row's answers (so ``beta`` does not depend on
    the reward model's scale). ``consensus`` says how much an answer agrees with the prompt's other answers (e.g.
    its mean similarity to them): the minimum-Bayes-risk regulariser of Jinnai et al. 2024, "Regularized Best-of-N
    Sampling to Mitigate Reward Hacking". A reward model's favourite is often an outlier that games it; the
    consensus term prefers, among answers it scores about as well, the one most like the rest.

    Args:
        scores: ``[P, N]`` float reward-model scores (NaN: unranked, never picked, as :func:`best_of_n`).
        consensus: ``[P, N]`` float, the same shape.
        beta: ≥ 0; 0 is :func:`best_of_n` exactly.

    Returns:
        ``[P]`` long indices into each row (the first of equal totals).
    """
    import torch

    if consensus.shape != scores.shape:
        raise ValueError(f"regularized_best_of_n: scores {tuple(scores.shape)} but consensus {tuple(consensus.shape)}")
    if beta < 0:
        raise ValueError(f"regularized_best_of_n: beta must be ≥ 0, got {beta}")
    if beta == 0:
        return best_of_n(scores)
    total = _row_z(scores) + beta * _row_z(torch.where(torch.isnan(scores), torch.nan, consensus.to(scores.dtype)))
    return best_of_n(total)


def pair_accuracy_by_group(chosen_scores, rejected_scores, groups: list) -> dict:
    """Pair accuracy (chosen scores strictly higher; a tie or a NaN counts as wrong, as step 2's eval) overall and
    per group.

    Args:
        chosen_scores: ``[N]`` (a tensor or a list of floats).
        rejected_scores: ``[N]``.
        groups: N labels, each a str, or a list / tuple of str for a pair of several groups (e.g. an instruction
            with several constraint types: the pair counts in each); None or an empty list: in no group.

    Returns:
        ``{"overall": {"pairs": n, "correct": k, "accuracy": k / n}, "groups": {label: {...}, ...}}``, the
        labels sorted; an empty input gives accuracy NaN overall.
    """
    chosen, rejected = [float(x) for x in chosen_scores], [float(x) for x in rejected_scores]
    if not len(chosen) == len(rejected) == len(groups):
        raise ValueError(f"pair_accuracy_by_group: {len(chosen)} chosen, {len(rejected)} rejected scores, "
                         f"{len(groups)} groups")
    counts = {}  # label -> [pairs, correct]
    total = [0, 0]
    for c, r, labels in zip(chosen, rejected, groups):
        correct = int(c > r)
        total[0], total[1] = total[0] + 1, total[1] + correct
        labels = [labels] if isinstance(labels, str) else list(labels or ())
        for label in dict.fromkeys(labels):  # a label named twice counts once
            entry = counts.setdefault(label, [0, 0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + correct

    def record(n, k):
        return {"pairs": n, "correct": k, "accuracy": k / n if n else float("nan")}

    return {"overall": record(*total), "groups": {label: record(*counts[label]) for label in sorted(counts)}}
