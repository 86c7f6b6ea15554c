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
  else 0.0 (numbers read as a grader reads them: :func:`last_number`);
* ``ifeval``: the share of the row's IFEval instructions (``instruction_id_list`` and ``kwargs``) the
  answer keeps (:func:`utils.ifeval.compliance`), in [0, 1]; data: ``python bench/ifeval_data.py``.

The real-model bench's tuned reward, that share with guards against gamed answers, is a file's function:
``--reward_fn bench/ifeval_reward.py:ifeval_guarded`` (once the built-in ``ifeval_guarded``: :data:`MOVED`).

:func:`call_reward_fn` checks what a function returns: a function that raises (``SystemExit`` included: a
``sys.exit()`` in it must not end the run as a success), returns anything but a
sequence of one number per answer (a dict, a string, a set, a scalar, the wrong count), or a score that
is not a finite number (a string, None, a list) is a :class:`~utils.errors.UserInputError` naming the
function and the row; one still running after a minute is named in a warning line. Pure Python: no torch import.
"""
from __future__ import annotations

import importlib.util
import math
import numbers
import os
import re
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import Callable, List, Optional, Sequence

from utils.errors import UserInputError

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


MINUS_SIGNS = "-\u2212\u2013"  # hyphen-minus, the Unicode minus (−) and the en dash (–) written for a minus
# A number as a grader reads it: an optional minus that starts the number (not one between two numbers or words:
# "60-72" is a range, "COVID-19" a name), an optional $ on either side of the minus, thousands separated by commas
# only in groups of three ("1,234"; "7,2" is two numbers, 7 and 2), an optional decimal part.
_NUMBER = re.compile(r"(?<![\w.\d])(?P<sign>[" + MINUS_SIGNS + r"]\s?)?\$?\s?(?(sign)|(?P<sign2>[" + MINUS_SIGNS
                     + r"]))?(?P<digits>\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?P<decimals>\.\d+)?")
_MINUS_AFTER_A_WORD = re.compile(r"[\w)\]][" + MINUS_SIGNS + r"]$")


def last_number(text: str) -> Optional[float]:
    """The last number written in ``text``, as a grader reads it, or None: "1,234.5" -> 1234.5, "−72" and "-$72"
    -> -72, "7,2" -> 2 (two numbers: a comma separates thousands only in groups of three), "60-72" -> 72 (a
    range, not 60 and -72)."""
    text = text or ""
    value = None
    for match in _NUMBER.finditer(text):
        number = float(match.group("digits").replace(",", "") + (match.group("decimals") or ""))
        negative = match.group("sign") or match.group("sign2")
        if negative and match.group("sign") and _MINUS_AFTER_A_WORD.search(text[:match.start() + 1]):
            negative = None  # "60-72": the dash joins two numbers
        value = -number if negative else number
    return value


def gsm8k_reference(row: dict) -> Optional[float]:
    """The number after ``####`` in a gsm8k row's reference answer (the loader's, under
    :data:`utils.data.data_utils.REFERENCE`), or None."""
    from utils.data.data_utils import REFERENCE

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


def _share_missing(missing: int, total: int, what: str) -> Optional[str]:
    """``"<missing> of <total> <what>"``, the refusal of a reward function's data check, or None if none is missing."""
    return f"{missing} of {total} {what}" if missing else None


def _check_gsm8k_rows(prompts: List[str], rows: List[dict]) -> Optional[str]:
    return _share_missing(sum(gsm8k_reference(row) is None for row in rows), len(rows),
                          "prompts have no reference answer ending in '#### <number>' (gsm8k's `answer` field); use "
                          "data with reference answers, e.g. ../shared/data/gsm8k/train.jsonl")


def _check_builtin_rows(prompts: List[str], rows: List[dict]) -> Optional[str]:
    from utils.data.rule_score import asked_object

    return _share_missing(sum(asked_object(prompt) is None for prompt in prompts), len(prompts),
                          "prompts are not built-in prompts (\"... the <object>. Assistant:\"): the built-in "
                          "functions score answers to builtin/... prompts only")


def ifeval(prompts: List[str], answers: List[str], rows: List[dict]) -> List[float]:
    """The share of its row's IFEval instructions each answer keeps (IFEval's strict checks), in [0, 1]."""
    from utils.ifeval import compliance

    return [compliance(row, answer) for answer, row in zip(answers, rows)]


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
            f"the {len(INSTRUCTIONS)} instruction ids of utils/ifeval.py, e.g. from python bench/ifeval_data.py")


BUILTIN = {"builtin_rule": builtin_rule, "builtin_preference": builtin_preference, "gsm8k": gsm8k, "ifeval": ifeval}
# Checks of the data a built-in function needs, run before any model is built: (prompts, rows) -> problem or None.
ROW_CHECKS = {"builtin_rule": _check_builtin_rows, "builtin_preference": _check_builtin_rows,
              "gsm8k": _check_gsm8k_rows, "ifeval": _check_ifeval_rows}
# Built-in names that left for a file of their own: the name given alone is refused with the spec to give instead.
MOVED = {"ifeval_guarded": "bench/ifeval_reward.py:ifeval_guarded"}


# --------------------------------------------------------------------------- loading

def load_reward_fn(spec: str, flag: str = "--reward_fn") -> RewardFn:
    """A built-in name (:data:`BUILTIN`) or ``path/to/file.py:function`` -> the function.

    Raises :class:`UserInputError` for an unknown name (one of :data:`MOVED`: naming the spec to give instead), a
    file that does not exist or does not import, and a name the file does not define (or that is not callable).
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec in MOVED:
        raise UserInputError(f"{flag} {spec}: {spec} moved to {MOVED[spec].rpartition(':')[0]}: use {flag} "
                             f"{MOVED[spec]}")
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
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's file (a top-level sys.exit() too): one line
        raise UserInputError(f"{flag} {spec}: importing {path} failed: {_raised(e)}") from None
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


def _is_sequence(scores) -> bool:
    """A list, a tuple or another ordered sequence, a 1-D array or tensor: not a string, bytes, a mapping, a set, a
    scalar or a one-shot iterator."""
    if isinstance(scores, (str, bytes, bytearray, Mapping)):
        return False
    if hasattr(scores, "ndim") and hasattr(scores, "tolist"):  # numpy arrays, torch tensors
        return scores.ndim == 1
    return isinstance(scores, SequenceABC)


def _number(score) -> Optional[float]:
    """``score`` as a float when it is one number (int, float, bool, a numpy scalar, a 0-d array or tensor), else
    None (a string, even "1.0", None, a list …)."""
    if hasattr(score, "ndim") and hasattr(score, "item"):  # numpy scalars and 0-d arrays, 0-d tensors
        if score.ndim != 0:
            return None
        score = score.item()
    if isinstance(score, numbers.Real):
        return float(score)
    return None


SLOW_REWARD_SECONDS = 60.0  # a reward function still running after this long is named in one line (it may hang)


def _raised(e: BaseException) -> str:
    """What a user's function raised, for the error line: ``SystemExit(0)`` says that it ended the process."""
    if isinstance(e, SystemExit):
        return (f"SystemExit({e.code!r}) (sys.exit()/exit() in a reward function would end the whole run: return "
                "one score per answer instead)")
    return f"{type(e).__name__}: {e}"


def _warn_when_slow(where: str, n: int, seconds: Optional[float]):
    """A started daemon timer that says, once, that the reward function has not returned after ``seconds`` (None
    or ≤ 0: no timer); cancel it when the function returns."""
    import sys
    import threading

    if not seconds or seconds <= 0:
        return None

    def say():
        print(f"warning: {where} has not returned after {seconds:g} s (scoring {n} answers); the run waits for it "
              "(a network call, a lock or input() can hold it for ever: Ctrl-C stops the run)", file=sys.stderr,
              flush=True)

    timer = threading.Timer(seconds, say)
    timer.daemon = True
    timer.start()
    return timer


def call_reward_fn(fn: RewardFn, spec: str, prompts: List[str], answers: List[str], rows: List[dict],
                   flag: str = "--reward_fn", slow_after: Optional[float] = None) -> List[float]:
    """``fn(prompts, answers, rows)`` as a list of finite floats, one per answer; anything else is a
    :class:`UserInputError` naming the function and the offending row: what it raises, ``SystemExit`` included
    (``sys.exit()`` in the function: the run must not end there as a success), but not ``KeyboardInterrupt``
    (Ctrl-C while it runs is the run's). Still running after ``slow_after`` seconds (default
    :data:`SLOW_REWARD_SECONDS`): one warning line saying so."""
    where = f"{flag} {spec}"
    timer = _warn_when_slow(where, len(answers), SLOW_REWARD_SECONDS if slow_after is None else slow_after)
    try:
        scores = fn(list(prompts), list(answers), list(rows))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit too: find the row it fails on, then one line
        for i in range(len(answers)):
            try:
                fn([prompts[i]], [answers[i]], [rows[i]])
            except KeyboardInterrupt:
                raise
            except BaseException as row_error:  # noqa: BLE001
                raise UserInputError(f"{where} raised {_raised(row_error)} on {_describe(prompts, i)}") from None
        raise UserInputError(f"{where} raised {_raised(e)} (on a batch of {len(answers)} answers; "
                             "no single row raises)") from None
    finally:
        if timer is not None:
            timer.cancel()
    if not _is_sequence(scores):  # a dict would give its keys, a string its characters, a set no order
        raise UserInputError(f"{where} returned {type(scores).__name__}, not a list of {len(answers)} "
                             "scores (one number per answer)")
    scores = list(scores)
    if len(scores) != len(answers):
        raise UserInputError(f"{where} returned {len(scores)} scores for {len(answers)} answers")
    out = []
    for i, score in enumerate(scores):
        value = _number(score)
        if value is None:
            raise UserInputError(f"{where} returned {score!r} (not a number) for {_describe(prompts, i)}") \
                from None
        if not math.isfinite(value):
            raise UserInputError(f"{where} returned {value} for {_describe(prompts, i)}; scores must be "
                                 "finite")
        out.append(value)
    return out
