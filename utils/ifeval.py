"""IFEval's verifiable instructions: a checker and a prompt text for each, and a row's compliance share.

IFEval (Zhou et al. 2023, google-research ``instruction_following_eval``) writes constraints a program can
verify into the prompt ("Your entire response should be in English, and in all lowercase letters. ...") and
scores an answer by the share of them it keeps. A row is in IFEval's format::

    {"prompt": "...", "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
     "kwargs": [{}, {"relation": "less than", "num_words": 40}]}

:func:`check` tells whether one answer keeps one instruction (IFEval's *strict* rules: the answer as written,
and a blank answer keeps nothing); :func:`compliance` is the share of a row's instructions kept, the reward
``--reward_fn ifeval`` gives (:mod:`utils.reward_functions`); :func:`describe` writes an instruction's text for a
prompt (the data builder, ``bench/ifeval_data.py``). Ids and kwargs names are IFEval's, so its own data work as
they are; a kwargs value of None counts as absent (the hub copy, google/IFEval, fills every row's kwargs with
nulls). The real-model bench's tuned reward, compliance with guards against gamed answers, is
``bench/ifeval_reward.py`` (``--reward_fn bench/ifeval_reward.py:ifeval_guarded``).

Our own code, not the PyPI package ``if-verifiable`` (IFEval's code, Apache-2.0): it installs, but counting
sentences calls NLTK's punkt tokenizer, whose data NLTK downloads at run time (offline: ``LookupError:
Resource 'punkt_tab' not found``), and it pulls in nltk, langdetect, datasets and pandas. These checkers are
plain Python (``re``, ``json``), written from IFEval's rules, and differ from them only where IFEval needs such
data:

* ``change_case:english_lowercase`` / ``english_capital`` check the case only; IFEval also asks langdetect
  whether the answer is English;
* ``length_constraints:number_sentences`` counts sentences with a rule (:func:`count_sentences`) close to
  punkt's, not punkt itself;
* ``change_case:capital_word_frequency`` splits words with a rule close to ``nltk.word_tokenize``;
* keywords are matched as written (IFEval passes them to ``re.search`` as patterns: the same for words).

``language:response_language`` (langdetect) is the one IFEval instruction left out: 24 of its 25 are here.
Pure Python: no torch import.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from utils.errors import UserInputError

RELATIONS = ("less than", "at least")  # IFEval's two comparisons: count < N, count >= N


# --------------------------------------------------------------------------- counting

def count_words(text: str) -> int:
    """Words as IFEval counts them (NLTK's ``RegexpTokenizer(r"\\w+")``): runs of letters, digits and ``_``."""
    return len(re.findall(r"\w+", text))


# A sentence ends at . ! or ? (repeated, then closing quotes or brackets) followed by white space or the end.
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s|$)")
_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "inc", "ltd", "co", "no", "fig",
                  "approx", "dept", "est", "mt"}


def _not_an_end(text: str, end: re.Match) -> bool:
    """A single period after an abbreviation ("Dr."), an initial ("J."), a dotted word ("e.g.", "U.S.") or a
    number that opens its line (a "1." list marker) ends no sentence, as punkt decides for these."""
    if end.group().rstrip("\"'”’)]") != ".":
        return False
    before = re.search(r"(\S+)$", text[:end.start()])
    if before is None:
        return True
    word = before.group(1).lstrip("(\"'“‘[")
    line_start = text.rfind("\n", 0, before.start()) + 1
    return (word.lower() in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()) or "." in word
            or (word.isdigit() and not text[line_start:before.start()].strip()))


def count_sentences(text: str) -> int:
    """Sentences in ``text``: pieces ending at ``.``/``!``/``?`` before white space (not after an abbreviation,
    an initial or a list number), each with a letter or digit; text after the last end is a sentence too.

    Close to NLTK's punkt (which IFEval uses) on ordinary prose; like punkt, a line break alone ends nothing."""
    count, start = 0, 0
    for end in _SENTENCE_END.finditer(text):
        if _not_an_end(text, end):
            continue
        count += bool(re.search(r"\w", text[start:end.end()]))
        start = end.end()
    return count + bool(re.search(r"\w", text[start:]))


def _compare(count: int, relation: str, threshold: int) -> bool:
    """IFEval's comparison: "less than" is ``count < threshold``, "at least" is ``count >= threshold``."""
    return count < threshold if relation == RELATIONS[0] else count >= threshold


# --------------------------------------------------------------------------- the checkers (answer, kwargs) -> bool

def _lowercase(answer: str) -> bool:
    return answer.islower()


def _capital(answer: str) -> bool:
    return answer.isupper()


def _capital_word_frequency(answer: str, capital_frequency: int, capital_relation: str) -> bool:
    words = re.findall(r"\w+(?:[-'.]\w+)*", answer)  # hyphenated words count as one, as IFEval says
    return _compare(sum(w.isupper() for w in words), capital_relation, capital_frequency)


def _number_words(answer: str, num_words: int, relation: str) -> bool:
    return _compare(count_words(answer), relation, num_words)


def _number_sentences(answer: str, num_sentences: int, relation: str) -> bool:
    return _compare(count_sentences(answer), relation, num_sentences)


def _number_paragraphs(answer: str, num_paragraphs: int) -> bool:
    """Paragraphs split by ``***``; an empty one is allowed only before the first divider or after the last."""
    paragraphs = re.split(r"\s?\*\*\*\s?", answer)
    count = len(paragraphs)
    for i, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if i not in (0, len(paragraphs) - 1):
                return False
            count -= 1
    return count == num_paragraphs


def _nth_paragraph_first_word(answer: str, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    """Paragraphs split by blank lines; the nth's first word (lower-cased, up to punctuation) is ``first_word``."""
    paragraphs = answer.split("\n\n")
    count = sum(bool(p.strip()) for p in paragraphs)
    if nth_paragraph > count or not paragraphs[nth_paragraph - 1].strip():
        return False
    word = paragraphs[nth_paragraph - 1].split()[0].lstrip("'").lstrip('"')
    word = re.split(r"[.,?!'\"]", word)[0].lower()
    return count == num_paragraphs and word == first_word.lower()


def _no_comma(answer: str) -> bool:
    return "," not in answer


def _end_checker(answer: str, end_phrase: str) -> bool:
    """The answer (stripped of white space, then of double quotes) ends with the phrase, ignoring case."""
    return answer.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def _quotation(answer: str) -> bool:
    text = answer.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def _existence(answer: str, keywords: List[str]) -> bool:
    """Every keyword occurs, anywhere (inside a longer word too), ignoring case."""
    return all(re.search(re.escape(k), answer, flags=re.IGNORECASE) for k in keywords)


def _frequency(answer: str, keyword: str, frequency: int, relation: str) -> bool:
    found = len(re.findall(re.escape(keyword.strip()), answer, flags=re.IGNORECASE))
    return _compare(found, relation, frequency)


def _forbidden_words(answer: str, forbidden_words: List[str]) -> bool:
    """No forbidden word occurs as a whole word, ignoring case."""
    return not any(re.search(r"\b" + re.escape(w) + r"\b", answer, flags=re.IGNORECASE) for w in forbidden_words)


def _letter_frequency(answer: str, letter: str, let_frequency: int, let_relation: str) -> bool:
    return _compare(answer.lower().count(letter.lower()), let_relation, let_frequency)


def _number_bullet_lists(answer: str, num_bullets: int) -> bool:
    """Exactly ``num_bullets`` lines that start (after white space) with ``* `` (not ``**``) or ``-``."""
    stars = re.findall(r"^\s*\*[^*].*$", answer, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", answer, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def _json_format(answer: str) -> bool:
    """The whole answer parses as JSON, once a markdown fence (```json ... ```) around it is taken off."""
    text = answer.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        if text.startswith(fence):
            text = text[len(fence):]
            break
    text = text[:-3] if text.endswith("```") else text
    try:
        json.loads(text.strip())
    except ValueError:
        return False
    return True


def _title(answer: str) -> bool:
    """A title in double angular brackets, on one line, with something in it: <<poem of joy>>."""
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", answer))


def _number_highlighted_sections(answer: str, num_highlights: int) -> bool:
    """At least ``num_highlights`` non-empty ``*highlighted*`` spans (a ``**bold**`` span counts as well)."""
    single = [h for h in re.findall(r"\*[^\n*]*\*", answer) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n*]*\*\*", answer) if h[2:-2].strip()]
    return len(single) + len(double) >= num_highlights


def _multiple_sections(answer: str, section_spliter: str, num_sections: int) -> bool:
    """At least ``num_sections`` sections, each opened by the splitter and a number ("SECTION 1")."""
    pattern = r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?"
    return len(re.split(pattern, answer)) - 1 >= num_sections


CONSTRAINED_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _constrained_response(answer: str) -> bool:
    return any(option in answer.strip() for option in CONSTRAINED_OPTIONS)


def _postscript(answer: str, postscript_marker: str) -> bool:
    """A postscript: the marker (any case; "P.S." and "P.P.S" also with a space after each period), then the
    rest of its line."""
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker.lower()) + r".*$"
    return bool(re.findall(pattern, answer.lower(), flags=re.MULTILINE))


def _number_placeholders(answer: str, num_placeholders: int) -> bool:
    return len(re.findall(r"\[.*?\]", answer)) >= num_placeholders


def _repeat_prompt(answer: str, prompt_to_repeat: str) -> bool:
    """The answer starts with the request, word for word (case ignored)."""
    return answer.strip().lower().startswith(prompt_to_repeat.strip().lower())


def _two_responses(answer: str) -> bool:
    """Two different answers separated by ``******`` (and nothing else separated so)."""
    parts = answer.split("******")
    kept = []
    for i, part in enumerate(parts):
        if part.strip():
            kept.append(part.strip())
        elif i not in (0, len(parts) - 1):
            return False
    return len(kept) == 2 and kept[0] != kept[1]


# --------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Instruction:
    """One IFEval instruction: its checker ``check(answer, **kwargs)``, its prompt ``text`` (``str.format``-ed with
    the kwargs, lists written as quoted words) and the kwargs it takes (all of them needed)."""
    check: Callable[..., bool]
    text: str
    args: Tuple[str, ...] = ()


_BULLETS = "Your answer must contain exactly {num_bullets} bullet points. Use the markdown bullet points such as:\n" \
           "* This is point 1. \n* This is point 2"
_SECTIONS = "Your response must have {num_sections} sections. Mark the beginning of each section with " \
            "{section_spliter} X, such as:\n{section_spliter} 1\n[content of section 1]\n{section_spliter} 2\n" \
            "[content of section 2]"

INSTRUCTIONS: Dict[str, Instruction] = {
    "change_case:english_lowercase": Instruction(
        _lowercase, "Your entire response should be in English, and in all lowercase letters. No capital letters "
                    "are allowed."),
    "change_case:english_capital": Instruction(
        _capital, "Your entire response should be in English, and in all capital letters."),
    "change_case:capital_word_frequency": Instruction(
        _capital_word_frequency, "In your response, words with all capital letters should appear "
                                 "{capital_relation} {capital_frequency} times.",
        ("capital_frequency", "capital_relation")),
    "length_constraints:number_words": Instruction(
        _number_words, "Answer with {relation} {num_words} words.", ("num_words", "relation")),
    "length_constraints:number_sentences": Instruction(
        _number_sentences, "Your response should contain {relation} {num_sentences} sentences.",
        ("num_sentences", "relation")),
    "length_constraints:number_paragraphs": Instruction(
        _number_paragraphs, "There should be {num_paragraphs} paragraphs. Paragraphs are separated with the "
                            "markdown divider: ***", ("num_paragraphs",)),
    "length_constraints:nth_paragraph_first_word": Instruction(
        _nth_paragraph_first_word, "There should be {num_paragraphs} paragraphs. Paragraphs and only paragraphs "
                                   "are separated with each other by two new lines as if it was '\\n\\n' in python. "
                                   "Paragraph {nth_paragraph} must start with word {first_word}.",
        ("num_paragraphs", "nth_paragraph", "first_word")),
    "punctuation:no_comma": Instruction(
        _no_comma, "In your entire response, refrain from the use of any commas."),
    "startend:end_checker": Instruction(
        _end_checker, "Finish your response with this exact phrase {end_phrase}. No other words should follow "
                      "this phrase.", ("end_phrase",)),
    "startend:quotation": Instruction(_quotation, "Wrap your entire response with double quotation marks."),
    "keywords:existence": Instruction(_existence, "Include keywords {keywords} in the response.", ("keywords",)),
    "keywords:frequency": Instruction(
        _frequency, "In your response, the word {keyword} should appear {relation} {frequency} times.",
        ("keyword", "frequency", "relation")),
    "keywords:forbidden_words": Instruction(
        _forbidden_words, "Do not include keywords {forbidden_words} in the response.", ("forbidden_words",)),
    "keywords:letter_frequency": Instruction(
        _letter_frequency, "In your response, the letter {letter} should appear {let_relation} {let_frequency} "
                           "times.", ("letter", "let_frequency", "let_relation")),
    "detectable_format:number_bullet_lists": Instruction(_number_bullet_lists, _BULLETS, ("num_bullets",)),
    "detectable_format:json_format": Instruction(
        _json_format, "Entire output should be wrapped in JSON format. You can use markdown ticks such as ```."),
    "detectable_format:title": Instruction(
        _title, "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."),
    "detectable_format:number_highlighted_sections": Instruction(
        _number_highlighted_sections, "Highlight at least {num_highlights} sections in your answer with markdown, "
                                      "i.e. *highlighted section*.", ("num_highlights",)),
    "detectable_format:multiple_sections": Instruction(
        _multiple_sections, _SECTIONS, ("section_spliter", "num_sections")),
    "detectable_format:constrained_response": Instruction(
        _constrained_response, "Answer with one of the following options: {options}"),
    "detectable_content:postscript": Instruction(
        _postscript, "At the end of your response, please explicitly add a postscript starting with "
                     "{postscript_marker}", ("postscript_marker",)),
    "detectable_content:number_placeholders": Instruction(
        _number_placeholders, "The response must contain at least {num_placeholders} placeholders represented by "
                              "square brackets, such as [address].", ("num_placeholders",)),
    "combination:repeat_prompt": Instruction(
        _repeat_prompt, "First repeat the request word for word without change, then give your answer (1. do not "
                        "say any words or characters before repeating the request; 2. the request you need to "
                        "repeat does not include this sentence)", ("prompt_to_repeat",)),
    "combination:two_responses": Instruction(
        _two_responses, "Give two different responses. Responses and only responses should be separated by 6 "
                        "asterisk symbols: ******."),
}

# What each kwargs name holds: a whole number ≥ 1 (≥ 0 for the frequencies), a relation, a list of words, one
# letter, or (any other name) text.
_COUNTS = {"num_words", "num_sentences", "num_paragraphs", "nth_paragraph", "num_bullets", "num_highlights",
           "num_sections", "num_placeholders", "frequency", "let_frequency", "capital_frequency"}
_RELATIONS = {"relation", "let_relation", "capital_relation"}
_WORD_LISTS = {"keywords", "forbidden_words"}


# --------------------------------------------------------------------------- checking kwargs

def _where(instruction_id: str) -> str:
    return f"IFEval instruction {instruction_id!r}"


def arguments(instruction_id: str, kwargs: Optional[dict]) -> dict:
    """The kwargs ``instruction_id`` is checked with: None values dropped, every name it needs there, nothing
    else, each of the right kind. An unknown id or bad kwargs: :class:`UserInputError` naming both."""
    spec = INSTRUCTIONS.get(instruction_id)
    if spec is None:
        raise UserInputError(f"unknown IFEval instruction id {instruction_id!r} (known: "
                             f"{', '.join(sorted(INSTRUCTIONS))})")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise UserInputError(f"{_where(instruction_id)}: kwargs must be an object, got {type(kwargs).__name__}")
    given = {k: v for k, v in (kwargs or {}).items() if v is not None}
    extra = sorted(set(given) - set(spec.args))
    missing = [a for a in spec.args if a not in given]
    if extra or missing:
        raise UserInputError(f"{_where(instruction_id)} takes kwargs {list(spec.args)}; "
                             + "; ".join(([f"unexpected {extra}"] if extra else [])
                                         + ([f"missing {missing}"] if missing else [])))
    for name, value in given.items():
        problem = _kind_problem(name, value)
        if problem:
            raise UserInputError(f"{_where(instruction_id)}: kwargs {name!r} {problem}, got {value!r}")
    return given


def _kind_problem(name: str, value) -> Optional[str]:
    """Why ``value`` cannot be the kwargs ``name`` (None when it can)."""
    if name in _COUNTS:
        low = 0 if name in ("frequency", "let_frequency", "capital_frequency") else 1
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        return None if ok else f"must be a whole number ≥ {low}"
    if name in _RELATIONS:
        return None if value in RELATIONS else f"must be one of {list(RELATIONS)}"
    if name in _WORD_LISTS:
        ok = isinstance(value, list) and value and all(isinstance(w, str) and w.strip() for w in value)
        return None if ok else "must be a non-empty list of words"
    if name == "letter":
        ok = isinstance(value, str) and len(value.strip()) == 1 and value.strip().isascii() and value.strip().isalpha()
        return None if ok else "must be one letter a-z"
    return None if isinstance(value, str) and value.strip() else "must be a non-empty string"


# --------------------------------------------------------------------------- the public functions

def check(instruction_id: str, kwargs: Optional[dict], answer: str) -> bool:
    """Does ``answer`` keep the instruction (IFEval's strict rules; a blank answer keeps none)?"""
    args = arguments(instruction_id, kwargs)
    if not isinstance(answer, str) or not answer.strip():
        return False
    return bool(INSTRUCTIONS[instruction_id].check(answer, **args))


def _quoted(words: List[str]) -> str:
    quoted = [f'"{w}"' for w in words]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def describe(instruction_id: str, kwargs: Optional[dict] = None) -> str:
    """The instruction as written into a prompt, IFEval's wording with the kwargs filled in."""
    args = arguments(instruction_id, kwargs)
    shown = {k: _quoted(v) if isinstance(v, list) else v for k, v in args.items()}
    shown["options"] = _quoted(list(CONSTRAINED_OPTIONS)).replace('" and "', '" or "')
    return INSTRUCTIONS[instruction_id].text.format(**shown)


def _row_name(row) -> str:
    if isinstance(row, dict) and row.get("key") is not None:
        return f"row with key {row['key']!r}"
    prompt = str(row.get("prompt", "")) if isinstance(row, dict) else ""
    prompt = " ".join(prompt.split())
    return f"row (prompt {prompt[:60]!r}{'…' if len(prompt) > 60 else ''})" if prompt else "row"


def instructions_of(row: dict) -> List[Tuple[str, dict]]:
    """``(instruction id, kwargs)`` for each of an IFEval-format row's instructions, the kwargs checked
    (:func:`arguments`); a None or missing ``kwargs`` entry is ``{}``. A row without a non-empty
    ``instruction_id_list``, a ``kwargs`` list of another length, an unknown id or bad kwargs:
    :class:`UserInputError` naming the row."""
    ids = row.get("instruction_id_list") if isinstance(row, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise UserInputError(f"{_row_name(row)} has no instruction_id_list (a non-empty list of IFEval "
                             "instruction ids)")
    kwargs = row.get("kwargs")
    kwargs = [None] * len(ids) if kwargs is None else kwargs
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise UserInputError(f"{_row_name(row)}: kwargs must be a list of {len(ids)} objects, one per "
                             "instruction id")
    try:
        return [(i, arguments(i, k)) for i, k in zip(ids, kwargs)]
    except UserInputError as e:
        raise UserInputError(f"{_row_name(row)}: {e}") from None


def compliance(row: dict, answer: str) -> float:
    """The share of the row's instructions ``answer`` keeps, in [0, 1] (IFEval's strict per-instruction score)."""
    pairs = instructions_of(row)
    return sum(check(i, k, answer) for i, k in pairs) / len(pairs)
