"""Reward (and labelling) functions: a score for each answer computed by code instead of a reward model.

Step 3 takes one with ``--reward_fn SPEC`` (instead of the reward model, or added to it with
``--reward_fn_weight``); the comparison collector (:mod:`utils.data.comparisons`) ranks sampled
answers with one, playing the human labeller. ``SPEC`` is a built-in name or ``path/to/file.py:function``.

A reward function is called with three lists of the same length and returns one float per answer::

    def my_reward(prompts: list[str], answers: list[str], rows: list[dict]) -> list[float]: ...

``prompts`` are the prompts as the model saw them (decoded), ``answers`` the generated answers
(decoded, up to the end token), ``rows`` the dataset rows the prompts came from: the row's own
fields plus ``"reference_answer"``, the answer the data loader reads from the row (a phase-1/2
``chosen`` answer, gsm8k's worked solution), or None. Built in:

* ``builtin_rule``: the built-in task's rule score (:func:`utils.data.rule_score.rule_score`, the
  held-out check's four rules), in [0, 1];
* ``builtin_preference``: the built-in task's preference (:func:`utils.data.builtin.quality`: good words,
  −2 for another object, −6 for a broken answer), the order ``builtin/preference``'s pairs are drawn
  in: finer than the rule score (it tells two good words from one), the demo's labeller;
* ``gsm8k``: 1.0 if the last number in the answer equals the reference's number after ``####``,
  else 0.0;
* ``ifeval``: the share of the row's IFEval instructions (``instruction_id_list`` and ``kwargs``) the
  answer keeps (:func:`utils.ifeval.compliance`), in [0, 1]; data: ``python -m utils.data.ifeval_data``;
* ``ifeval_guarded``: that share times a content guard (:func:`utils.ifeval.substance`: 10 words besides the
  constraint's own text), so an answer that is only the end phrase or the keyword earns nothing.

:func:`call_reward_fn` checks what a function returns: a function that raises, returns the wrong
number of scores, or a non-finite or non-numeric score is a :class:`~utils.errors.UserInputError`
naming the function and the row. Pure Python: no torch import.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Callable, List, Optional, Sequence

from utils.errors import UserInputError

REFERENCE = "reference_answer"  # the key under which a row carries the loader's answer text

RewardFn = Callable[[List[str], List[str], List[dict]], Sequence[float]]


# --------------------------------------------------------------------------- built-in functions

def _score_builtin(score, prompts: List[str], answers: List[str]) -> List[float]:
    """``score(answer, object asked about)`` for each answer to a built-in prompt (another prompt: ValueError)."""
    from utils.data.rule_score import asked_object

    scores = []
    for prompt, answer in zip(prompts, answers):
        noun = asked_object(prompt)
        if noun is None:
            raise ValueError(f"not a built-in prompt (no object to describe): {prompt.strip()[:80]!r}")
        scores.append(float(score(answer, noun)))
    return scores


def builtin_rule(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """The built-in task's rule score of each answer (fraction of the four checks it passes)."""
    from utils.data.rule_score import rule_score

    return _score_builtin(rule_score, prompts, answers)


def builtin_preference(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """The built-in task's preference score of each answer (good words, −2 another object, −6 broken)."""
    from utils.data.builtin import quality

    return _score_builtin(quality, prompts, answers)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> Optional[float]:
    """The last number written in ``text`` ("1,234.5" -> 1234.5), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def gsm8k_reference(row: dict) -> Optional[float]:
    """The number after ``####`` in a gsm8k row's reference answer, or None."""
    reference = row.get(REFERENCE)
    if not isinstance(reference, str) or "####" not in reference:
        return None
    return last_number(reference.split("####")[-1])


def gsm8k(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """1.0 where the answer's last number equals the reference's (after ``####``), else 0.0."""
    scores = []
    for answer, row in zip(answers, rows):
        expected = gsm8k_reference(row)
        if expected is None:
            raise ValueError("the row has no reference answer ending in '#### <number>'")
        got = last_number(answer)
        scores.append(float(got is not None and math.isclose(got, expected, rel_tol=0.0, abs_tol=1e-6)))
    return scores


def _check_gsm8k_rows(prompts: List[str], rows: List[dict]) -> Optional[str]:
    missing = sum(gsm8k_reference(row) is None for row in rows)
    if missing:
        return (f"{missing} of {len(rows)} prompts have no reference answer ending in '#### <number>' (gsm8k's "
                "`answer` field); use data with reference answers, e.g. ../shared/data/gsm8k/train.jsonl")
    return None


def _check_builtin_rows(prompts: List[str], rows: List[dict]) -> Optional[str]:
    from utils.data.rule_score import asked_object

    missing = sum(asked_object(prompt) is None for prompt in prompts)
    if missing:
        return (f"{missing} of {len(prompts)} prompts are not built-in prompts (\"... the <object>. Assistant:\"): "
                "the built-in functions score answers to builtin/... prompts only")
    return None


def ifeval(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """The share of its row's IFEval instructions each answer keeps (IFEval's strict checks), in [0, 1]."""
    from utils.ifeval import compliance

    return [compliance(row, answer) for answer, row in zip(answers, rows)]


def ifeval_guarded(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """The ``ifeval`` share times the content guard (:func:`utils.ifeval.substance`: at least 10 words besides the
    constraint's own text), so an answer that is only the required phrase or keyword earns nothing."""
    from utils.ifeval import guarded_compliance

    return [guarded_compliance(row, answer) for answer, row in zip(answers, rows)]


def _check_ifeval_rows(prompts: List[str], rows: List[dict]) -> Optional[str]:
    """Rows without ``instruction_id_list``, with an unknown instruction id or unusable kwargs: counted, in one
    line."""
    from utils.ifeval import INSTRUCTIONS, instructions_of

    missing, unknown_rows, unknown, bad, first_bad = 0, 0, set(), 0, None
    for row in rows:
        ids = row.get("instruction_id_list")
        if not isinstance(ids, list) or not ids:
            missing += 1
            continue
        strange = {str(i) for i in ids if i not in INSTRUCTIONS}
        if strange:
            unknown_rows += 1
            unknown |= strange
            continue
        try:
            instructions_of(row)
        except UserInputError as e:
            bad += 1
            first_bad = first_bad or str(e)
    n = len(rows)
    problems = []
    if missing:
        problems.append(f"{missing} of {n} prompts have no instruction_id_list")
    if unknown_rows:
        shown = ", ".join(sorted(unknown)[:5]) + (", …" if len(unknown) > 5 else "")
        problems.append(f"{unknown_rows} of {n} use unknown instruction ids ({shown})")
    if bad:
        problems.append(f"{bad} of {n} have unusable kwargs (first: {first_bad})")
    if not problems:
        return None
    return ("; ".join(problems) + f"; ifeval scores IFEval-format rows (prompt, instruction_id_list, kwargs) with "
            f"the {len(INSTRUCTIONS)} instruction ids of utils/ifeval.py, e.g. from python -m utils.data.ifeval_data")


BUILTIN = {"builtin_rule": builtin_rule, "builtin_preference": builtin_preference, "gsm8k": gsm8k, "ifeval": ifeval,
           "ifeval_guarded": ifeval_guarded}
# Checks of the data a built-in function needs, run before any model is built: (prompts, rows) -> problem or None.
ROW_CHECKS = {"builtin_rule": _check_builtin_rows, "builtin_preference": _check_builtin_rows,
              "gsm8k": _check_gsm8k_rows, "ifeval": _check_ifeval_rows, "ifeval_guarded": _check_ifeval_rows}


# --------------------------------------------------------------------------- loading

def load_reward_fn(spec: str, flag: str = "--reward_fn") -> RewardFn:
    """A built-in name (:data:`BUILTIN`) or ``path/to/file.py:function`` -> the function.

    Raises :class:`UserInputError` for an unknown name, a file that does not exist or does not
    import, and a name the file does not define (or that is not callable).
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise UserInputError(f"{flag} {spec}: unknown reward function; give a built-in one "
                             f"({', '.join(BUILTIN)}) or path/to/file.py:function")
    if not os.path.isfile(path):
        raise UserInputError(f"{flag} {spec}: no such file {path}")
    module_name = "dschat_reward_fn_" + re.sub(r"\W", "_", os.path.abspath(path))
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: report it in one line
        raise UserInputError(f"{flag} {spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise UserInputError(f"{flag} {spec}: {path} defines no {name!r}")
    if not callable(fn):
        raise UserInputError(f"{flag} {spec}: {name!r} in {path} is not a function")
    return fn


def check_rows(spec: str, prompts: List[str], rows: List[dict], flag: str = "--reward_fn") -> None:
    """Before training: the data a built-in function needs is there (gsm8k: reference answers; builtin_rule:
    built-in prompts; ifeval: IFEval instructions it knows)."""
    check = ROW_CHECKS.get(spec)
    problem = check(prompts, rows) if check is not None else None
    if problem:
        raise UserInputError(f"{flag} {spec}: {problem}")


def _describe(prompts: List[str], i: int) -> str:
    prompt = str(prompts[i]).strip().replace("\n", " ")
    return f"row {i} (prompt {prompt[:60]!r}{'…' if len(prompt) > 60 else ''})"


def call_reward_fn(fn: RewardFn, spec: str, prompts: List[str], answers: List[str], rows: List[dict],
                   flag: str = "--reward_fn") -> List[float]:
    """``fn(prompts, answers, rows)`` as a list of finite floats, one per answer; anything else is a
    :class:`UserInputError` naming the function and the offending row."""
    where = f"{flag} {spec}"
    try:
        scores = fn(list(prompts), list(answers), list(rows))
    except Exception as e:  # noqa: BLE001 - find the row it fails on, then one line
        for i in range(len(answers)):
            try:
                fn([prompts[i]], [answers[i]], [rows[i]])
            except Exception as row_error:  # noqa: BLE001
                raise UserInputError(f"{where} raised {type(row_error).__name__}: {row_error} on "
                                     f"{_describe(prompts, i)}") from None
        raise UserInputError(f"{where} raised {type(e).__name__}: {e} (on a batch of {len(answers)} answers; "
                             "no single row raises)") from None
    try:
        scores = list(scores)
    except TypeError:
        raise UserInputError(f"{where} returned {type(scores).__name__}, not a list of {len(answers)} "
                             "scores") from None
    if len(scores) != len(answers):
        raise UserInputError(f"{where} returned {len(scores)} scores for {len(answers)} answers")
    out = []
    for i, score in enumerate(scores):
        try:
            value = float(score)
        except (TypeError, ValueError):
            raise UserInputError(f"{where} returned {score!r} (not a number) for {_describe(prompts, i)}") \
                from None
        if not math.isfinite(value):
            raise UserInputError(f"{where} returned {value} for {_describe(prompts, i)}; scores must be "
                                 "finite")
        out.append(value)
    return out
