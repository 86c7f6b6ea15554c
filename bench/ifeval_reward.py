"""The real-model bench's reward: IFEval compliance with guards against answers that game it.

    python step3_rlhf_finetuning/main.py ... --reward_fn bench/ifeval_reward.py:ifeval_guarded
    python step2_reward_model_finetuning/collect_comparisons.py ... --label_fn bench/ifeval_reward.py:ifeval_guarded

A reward function of the ``path/to/file.py:function`` kind (:func:`utils.reward_functions.load_reward_fn`), tuned
on SmolLM2-135M-Instruct (docs/real-model.md)::

    reward = compliance × substance × variety + 0.5 × F1(answer, the row's reference_output)

:func:`utils.ifeval.compliance` (``--reward_fn ifeval``) is the share of the row's constraints kept;
:func:`substance` pays an answer that is more than the constraint's own text, :func:`variety` one that does not
repeat itself, and the F1 term (:func:`unigram_f1`) the content of alpaca's answer (the data builder's rows,
``bench/ifeval_data.py``, carry it). The bench's held-out evaluation (``bench/bench_real_rl.py``) measures with the
same pieces: :func:`unigram_f1`, and a "bare" answer is one of fewer than :data:`BARE_WORDS` words besides the
required text (:func:`other_words`). Pure Python: no torch import.
"""
from __future__ import annotations

import re
from typing import Iterable, List, Optional

from utils.ifeval import compliance, count_words, instructions_of

# kwargs whose values an answer must write out: what a "bare" answer consists of
_REQUIRED_TEXT = ("end_phrase", "keywords", "postscript_marker", "prompt_to_repeat", "keyword")
GUARD_WORDS = 10  # an answer with this many words besides the required text counts as an answer
BARE_WORDS = 5  # the held-out evaluation's "bare" answer: fewer words than this besides the required text


def other_words(row: dict, answer: str) -> int:
    """Words of ``answer`` besides the text its instructions require it to write (end phrase, keywords,
    postscript marker, repeated prompt): what is left of an answer once the constraint's own words are gone."""
    text = answer or ""
    for _, args in instructions_of(row):
        for name in _REQUIRED_TEXT:
            values = args.get(name)
            for value in (values if isinstance(values, list) else [values] if values else []):
                text = re.sub(re.escape(str(value)), " ", text, flags=re.IGNORECASE)
    return count_words(text)


def word_limit(row: dict) -> Optional[int]:
    """The strictest "less than N words" of a row's instructions, or None."""
    limits = [args["num_words"] for i, args in instructions_of(row)
              if i == "length_constraints:number_words" and args.get("relation") == "less than"]
    return min(limits) if limits else None


def substance(row: dict, answer: str) -> float:
    """In [0, 1]: 1 when the answer has at least :data:`GUARD_WORDS` words besides the required text (half the word
    limit under "less than N words", if that is fewer), proportionally less below. Compliance alone pays an
    answer that is only the constraint ("That is all.", the keyword alone): a 135M model learns that in 20
    steps of GRPO (see docs/real-model.md)."""
    limit = word_limit(row)
    needed = GUARD_WORDS if limit is None else max(1, min(GUARD_WORDS, limit // 2))
    return min(1.0, other_words(row, answer) / needed)


def lower_words(text: str) -> List[str]:
    """The lower-cased words of ``text`` (letters, digits, apostrophes) that :func:`variety` and :func:`unigram_f1`
    compare."""
    return re.findall(r"[a-z0-9']+", (text or "").lower())


def variety(answer: str, n: int = 3) -> float:
    """In [0, 1]: the share of the answer's word ``n``-grams (lower-cased) that are distinct; 1 for an answer of
    fewer than ``n + 1`` words. A checker counts a postscript marker, a title or a bullet however often it is
    repeated: at twice the learning rate, GRPO turned answers into "P.S. … P.S. P.S. P.S." and a list of one title
    five times (docs/real-model.md), which a repetition-blind guard pays in full."""
    words = lower_words(answer)
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if len(grams) > 1 else 1.0


CONTENT_WEIGHT = 0.5  # weight of the content term (unigram F1 against the row's reference answer)


def unigram_f1(answer: str, reference: str, leave_out: Iterable[str] = ()) -> float:
    """Unigram F1 of the answer's words against the reference's (bags of lower-cased words); the words of
    ``leave_out`` are taken out of the reference (an answer that writes them matches nothing with them)."""
    from collections import Counter

    dropped = {w for text in leave_out for w in lower_words(text)}
    a, r = Counter(lower_words(answer)), Counter(w for w in lower_words(reference) if w not in dropped)
    overlap = sum((a & r).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / sum(a.values()), overlap / sum(r.values())
    return 2 * precision * recall / (precision + recall)


def forbidden_words(row: dict) -> List[str]:
    """The words a row's ``keywords:forbidden_words`` instructions forbid (none: ``[]``)."""
    return [w for i, args in instructions_of(row) if i == "keywords:forbidden_words" for w in args["forbidden_words"]]


def guarded_compliance(row: dict, answer: str) -> float:
    """:func:`compliance` × :func:`substance` × :func:`variety` (the share of the instructions kept, by an answer
    that answers without repeating itself), plus
    :data:`CONTENT_WEIGHT` × :func:`unigram_f1` against the row's ``reference_output`` where it has one (the
    builder's rows carry alpaca's answer; IFEval's own rows do not, and the term is 0): keeping the constraints
    must not cost the answer its content. The row's forbidden words are left out of that reference: the builder
    draws them from it, and a term that counted them paid for writing them."""
    reference = row.get("reference_output") if isinstance(row, dict) else None
    content = 0.0
    if isinstance(reference, str) and reference:  # the forbidden words are drawn from that answer: not paid for
        content = CONTENT_WEIGHT * unigram_f1(answer, reference, leave_out=forbidden_words(row))
    return compliance(row, answer) * substance(row, answer) * variety(answer) + content


VARIETY_KEPT = 0.9  # :func:`ifeval_kept`'s guard: an answer with fewer distinct word trigrams than this repeats itself


def kept(row: dict, answer: str) -> float:
    """:func:`compliance` of an answer that answers (:func:`substance` 1) without repeating itself (:func:`variety`
    ≥ :data:`VARIETY_KEPT`), else 0: a few levels (0, ½, 1 for rows of one or two constraints)."""
    guarded = substance(row, answer) >= 1.0 and variety(answer) >= VARIETY_KEPT
    return compliance(row, answer) if guarded else 0.0


def ifeval_kept(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """A labeller for comparisons (``collect_comparisons.py --label_fn bench/ifeval_reward.py:ifeval_kept``): the
    constraints kept, by an answer that passes the guards (:func:`kept`). Unlike :func:`ifeval_guarded` it has no
    content term and no graded guards, so two answers differ only where a constraint or a guard does, and equals
    tie (left out): on SmolLM2's own answers half of the guarded label's pairs differed by less than 0.1, mostly by
    the F1 against an alpaca answer the reward model never sees (docs/real-model.md)."""
    return [kept(row, answer) for answer, row in zip(answers, rows)]


def ifeval_guarded(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """The ``ifeval`` share times the content guard (:func:`substance`: at least 10 words besides the constraint's
    own text), so an answer that is only the required phrase or keyword earns nothing, times its share of distinct
    word trigrams (:func:`variety`), plus the content term (:func:`guarded_compliance`)."""
    return [guarded_compliance(row, answer) for answer, row in zip(answers, rows)]
