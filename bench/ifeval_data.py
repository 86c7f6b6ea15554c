"""IFEval-style prompts from alpaca instructions: each with one or two verifiable constraints written after it.

    .venv/bin/python bench/ifeval_data.py --alpaca ../shared/data/llama-factory-demo/alpaca_en_demo.json \\
        --out DIR --seed 1234
    python step3_rlhf_finetuning/main.py --data_path DIR/train.jsonl --data_split 0,0,1 --reward_fn ifeval ...

The alpaca rows with an empty ``input`` give the instructions (one row per distinct instruction, the first).
Each instruction gets one constraint, or two (half of them), as IFEval writes them: its text after the
instruction ("Describe a process of making crepes. Answer with less than 40 words."). The types and their
parameters are drawn from :data:`DRAWS` by a generator seeded with ``--seed`` and the instruction's text, so
an instruction's constraints do not depend on the other rows; a second constraint is never one of
:data:`CONFLICTS` with the first. :data:`DRAWS`, one line per type:

===================================================  =============================================================
type (IFEval's id)                                   parameters drawn
===================================================  =============================================================
``change_case:english_lowercase``                    none
``change_case:english_capital``                      none
``punctuation:no_comma``                             none
``startend:end_checker``                             ``end_phrase``: one of :data:`END_PHRASES`
``startend:quotation``                               none
``keywords:existence``                               ``keywords``: 1-2 words of the instruction and alpaca's answer
``keywords:forbidden_words``                         ``forbidden_words``: 1-2 words of alpaca's answer, not in the
                                                     rest of the prompt: a natural answer must avoid them
``length_constraints:number_words``                  "less than" 20/30/40/50, or "at least" 20/40/60 words
``length_constraints:number_sentences``              "less than" 2/3/4, or "at least" 2/3/4/5 sentences
``length_constraints:number_paragraphs``             2-4 paragraphs (``***`` dividers)
``detectable_format:number_bullet_lists``            2-5 bullets
``detectable_format:number_highlighted_sections``    at least 1-3 ``*highlights*``
``detectable_format:json_format``                    none
``detectable_format:title``                          none
``detectable_content:postscript``                    ``postscript_marker``: "P.S." or "P.P.S"
``detectable_content:number_placeholders``           at least 1-3 ``[placeholders]``
``combination:repeat_prompt``                        ``prompt_to_repeat``: the instruction (its text comes last)
===================================================  =============================================================

Output in ``--out``: ``train.jsonl`` and ``heldout.jsonl``, IFEval's rows (``key``: the row's place in the
alpaca file, ``prompt``, ``instruction_id_list``, ``kwargs``) plus ``instruction`` (the bare instruction) and
``reference_output`` (alpaca's ``output``); ``--heldout`` instructions (those first in the order of
``sha256(seed:instruction)``, a split fixed by the seed) go to ``heldout.jsonl`` and never to training; and
``heldout_plain.jsonl``, the same held-out instructions with no constraint (``prompt`` = the instruction), for a
content guard: that answering with constraints did not cost the answers' quality; and ``heldout_reworded.jsonl``,
the held-out rows with each constraint in one of three other wordings of its type (:data:`REWORDINGS`, which no
training row uses), the ids and kwargs unchanged: whether a model learned what a constraint asks for or only the
template's words. ``--train_weights
TYPE=W,...`` draws the named types W times as often in the training rows (more practice on the types a model
finds hard); the held-out rows are drawn as without it. Pure Python: no torch import.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import os
import random
import re
import sys
from typing import Callable, Dict, List, Optional, Tuple

from utils.errors import BAD_INPUT, UserInputError
from utils.files import content_hash
from utils.ifeval import RELATIONS, _quoted, describe  # _quoted: IFEval's way of writing a word list

OUTPUTS = ("train.jsonl", "heldout.jsonl", "heldout_plain.jsonl", "heldout_reworded.jsonl")
END_PHRASES = ("Any other questions?", "Is there anything else I can help with?",
               "Let me know if you have any other questions.")
POSTSCRIPT_MARKERS = ("P.S.", "P.P.S")
TWO_CONSTRAINTS = 0.5  # the share of instructions that get a second constraint

LOWER, CAPITAL = "change_case:english_lowercase", "change_case:english_capital"
NO_COMMA, END, QUOTE = "punctuation:no_comma", "startend:end_checker", "startend:quotation"
KEYWORDS, FORBIDDEN = "keywords:existence", "keywords:forbidden_words"
WORDS, SENTENCES = "length_constraints:number_words", "length_constraints:number_sentences"
PARAGRAPHS, BULLETS = "length_constraints:number_paragraphs", "detectable_format:number_bullet_lists"
HIGHLIGHTS, JSON, TITLE = ("detectable_format:number_highlighted_sections", "detectable_format:json_format",
                           "detectable_format:title")
POSTSCRIPT, PLACEHOLDERS = "detectable_content:postscript", "detectable_content:number_placeholders"
REPEAT = "combination:repeat_prompt"


class Context:
    """What a draw may use: the instruction and the words of alpaca's answer to it."""

    def __init__(self, instruction: str, output: str):
        self.instruction = instruction
        own = content_words(instruction)
        self.output_words = content_words(output)
        self.topic_words = own + [w for w in self.output_words if w not in own]


def _relation(rng: random.Random, name: str, less_than: Tuple[int, ...], at_least: Tuple[int, ...]) -> dict:
    relation = rng.choice(RELATIONS)
    return {"relation": relation, name: rng.choice(less_than if relation == "less than" else at_least)}


def _some(rng: random.Random, words: List[str], fallback: Tuple[str, ...]) -> List[str]:
    """1 or 2 of ``words`` (of ``fallback`` when there are too few), in drawn order."""
    pool = words if len(words) >= 2 else [w for w in fallback if w not in words]
    return rng.sample(pool, rng.randint(1, 2))


FALLBACK_WORDS = ("simple", "clear", "example", "important", "people", "future", "change", "answer", "reason",
                  "world")

# How each type's kwargs are drawn (the module docstring's table); keywords:forbidden_words is drawn last, by
# _forbidden, as it must avoid the rest of the prompt.
DRAWS: Dict[str, Callable[[random.Random, Context], dict]] = {
    LOWER: lambda rng, c: {},
    CAPITAL: lambda rng, c: {},
    NO_COMMA: lambda rng, c: {},
    END: lambda rng, c: {"end_phrase": rng.choice(END_PHRASES)},
    QUOTE: lambda rng, c: {},
    KEYWORDS: lambda rng, c: {"keywords": _some(rng, c.topic_words, FALLBACK_WORDS)},
    FORBIDDEN: lambda rng, c: {},  # see _forbidden
    WORDS: lambda rng, c: _relation(rng, "num_words", (20, 30, 40, 50), (20, 40, 60)),
    SENTENCES: lambda rng, c: _relation(rng, "num_sentences", (2, 3, 4), (2, 3, 4, 5)),
    PARAGRAPHS: lambda rng, c: {"num_paragraphs": rng.randint(2, 4)},
    BULLETS: lambda rng, c: {"num_bullets": rng.randint(2, 5)},
    HIGHLIGHTS: lambda rng, c: {"num_highlights": rng.randint(1, 3)},
    JSON: lambda rng, c: {},
    TITLE: lambda rng, c: {},
    POSTSCRIPT: lambda rng, c: {"postscript_marker": rng.choice(POSTSCRIPT_MARKERS)},
    PLACEHOLDERS: lambda rng, c: {"num_placeholders": rng.randint(1, 3)},
    REPEAT: lambda rng, c: {"prompt_to_repeat": c.instruction},
}
TYPES = tuple(DRAWS)


def _pairs(first: str, others) -> set:
    return {frozenset((first, other)) for other in others if other != first}


# Pairs never given together: IFEval's own conflicts among these types, and ours, each with its reason.
CONFLICTS = frozenset(set().union(
    _pairs(LOWER, [CAPITAL]),  # IFEval: opposite cases
    _pairs(JSON, [t for t in TYPES if t not in (KEYWORDS, FORBIDDEN)]),  # IFEval: JSON leaves no room for layout
    _pairs(REPEAT, [t for t in TYPES if t not in (KEYWORDS, TITLE)]),  # IFEval; and no_comma: the request may have one
    _pairs(QUOTE, [TITLE]),  # IFEval
    _pairs(SENTENCES, [PARAGRAPHS]),  # IFEval
    _pairs(WORDS, [SENTENCES, BULLETS, PARAGRAPHS]),  # ours: a length limit can contradict a set layout
    _pairs(SENTENCES, [BULLETS, END, POSTSCRIPT]),  # ours: a bullet, the end phrase or a postscript is a sentence
    _pairs(BULLETS, [PARAGRAPHS, HIGHLIGHTS]),  # ours: a line opening with *highlight* counts as a bullet
    _pairs(END, [LOWER, CAPITAL, POSTSCRIPT]),  # ours: the exact phrase has its own case; both want the last line
    _pairs(POSTSCRIPT, [LOWER]),  # ours: the marker is written in capitals
))


def compatible(first: str, second: str) -> bool:
    """May ``first`` and ``second`` be given together (two different types, not a pair of :data:`CONFLICTS`)?"""
    return first != second and frozenset((first, second)) not in CONFLICTS


_STOPWORDS = frozenset("""about above after again against along among another around because become before being
below between could doing during either every first further having however itself might other others their
theirs there these thing things those though three through together under until using whether which while would
should where without within yours include including example""".split())


def content_words(text: str) -> List[str]:
    """The distinct words of five letters or more in ``text``, lower-cased, in order, common function words left
    out: what keywords are drawn from."""
    seen = []
    for word in re.findall(r"[A-Za-z]{5,}", text.lower()):
        if word not in _STOPWORDS and word not in seen:
            seen.append(word)
    return seen


def _forbidden(rng: random.Random, context: Context, prompt_so_far: str, keywords: List[str]) -> dict:
    """1-2 words of alpaca's answer that the rest of the prompt does not hold (as a word), nor the keywords."""
    taken = set(content_words(prompt_so_far)) | {k.lower() for k in keywords}
    words = [w for w in context.output_words if w not in taken]
    return {"forbidden_words": _some(rng, words, tuple(w for w in FALLBACK_WORDS if w not in taken))}


def with_period(instruction: str) -> str:
    """The instruction ending in ``.``, ``?``, ``!`` or ``:`` (a period added otherwise), so a constraint's
    text reads as a sentence of its own."""
    text = instruction.strip()
    return text if text[-1:] in ".?!:" else text + "."


def constrain(instruction: str, output: str, seed: int, types: Tuple[str, ...] = TYPES,
              weights: Optional[Dict[str, float]] = None) -> Tuple[str, List[str], List[dict]]:
    """``(prompt, instruction ids, kwargs)``: one or two compatible constraints of ``types`` for ``instruction``,
    drawn with a generator seeded by ``seed`` and the instruction's text, their texts after it (a repeat request's
    last). ``weights``: a type's odds against the others' (1 for a type not named); ``None`` draws uniformly, as
    the held-out rows always are."""
    rng = random.Random(f"{seed}:{instruction}")

    def draw(among: List[str]) -> str:
        if weights is None:
            return rng.choice(among)
        return rng.choices(among, weights=[weights.get(t, 1.0) for t in among])[0]

    ids = [draw(list(types))]
    second = [t for t in types if compatible(ids[0], t)]
    if rng.random() < TWO_CONSTRAINTS and second:
        ids.append(draw(second))
    ids.sort(key=lambda t: t == REPEAT)
    context = Context(instruction, output)
    kwargs = {t: DRAWS[t](rng, context) for t in ids if t != FORBIDDEN}
    if FORBIDDEN in ids:
        rest = " ".join([instruction] + [describe(t, kwargs[t]) for t in kwargs])
        kwargs[FORBIDDEN] = _forbidden(rng, context, rest, kwargs.get(KEYWORDS, {}).get("keywords", []))
    kwargs = [kwargs[t] for t in ids]
    prompt = " ".join([with_period(instruction)] + [describe(t, k) for t, k in zip(ids, kwargs)])
    return prompt, ids, kwargs


# --------------------------------------------------------------------------- the reworded held-out set

# Other wordings of each type, used only for ``heldout_reworded.jsonl`` (never for a training row): a user's
# constraints do not come in IFEval's templates, and a model that learned the templates' words rather than what
# they ask for scores lower here. Each is ``str.format``-ed like IFEval's text (lists as quoted words); a type whose
# kwargs carry a relation has its wordings per relation. The checker's kwargs are the template row's, unchanged, so
# each wording must ask for exactly what the checker checks ("exactly N bullets", "fewer than N words", ...).
REWORDINGS: Dict[str, object] = {
    LOWER: ("Write everything in lowercase letters only, with no capitals anywhere.",
            "Do not use a single uppercase letter; the whole English reply must be lowercase.",
            "Keep every letter of your English answer small: no capital letters at all."),
    CAPITAL: ("Write your whole English reply using uppercase letters only.",
              "Respond in English, every word spelled in capital letters.",
              "Every letter of your English answer must be uppercase."),
    NO_COMMA: ("Do not put a single comma anywhere in your reply.",
               "Write the whole answer without using commas at all.",
               "Commas are not allowed anywhere in this answer."),
    END: ("The very last words of your reply must be: {end_phrase}",
          "Let this sentence close the reply, with nothing written after it: {end_phrase}",
          "Nothing may follow the final sentence of your reply, which must read exactly: {end_phrase}"),
    QUOTE: ("Put your whole reply inside a pair of double quotes.",
            "Open and close the reply with a double quotation mark.",
            "Enclose the complete answer, from first word to last, in double quotes."),
    KEYWORDS: ("Make sure the words {keywords} appear somewhere in your answer.",
               "Your reply should use the words {keywords}.",
               "Work {keywords} into what you write."),
    FORBIDDEN: ("Never use the words {forbidden_words} in your answer.",
                "Avoid writing {forbidden_words} anywhere.",
                "The words {forbidden_words} must not appear in your reply."),
    WORDS: {"less than": ("Keep your reply under {num_words} words.",
                          "Use fewer than {num_words} words in total.",
                          "The reply must be shorter than {num_words} words."),
            "at least": ("Write {num_words} words or more.",
                         "Use no fewer than {num_words} words in total.",
                         "Your answer needs a minimum of {num_words} words.")},
    SENTENCES: {"less than": ("Use fewer than {num_sentences} sentences in total.",
                              "Keep your reply under {num_sentences} sentences.",
                              "The reply must have fewer than {num_sentences} sentences."),
                "at least": ("Write {num_sentences} sentences or more.",
                             "Use no fewer than {num_sentences} sentences in total.",
                             "Your answer needs a minimum of {num_sentences} sentences.")},
    PARAGRAPHS: ("Split your answer into {num_paragraphs} paragraphs, with a line holding only *** between them.",
                 "Write exactly {num_paragraphs} paragraphs and put the markdown divider *** between each two.",
                 "Give {num_paragraphs} paragraphs, divided from each other by ***."),
    BULLETS: ("Format the reply as exactly {num_bullets} markdown bullets, each line starting with * .",
              "Give precisely {num_bullets} points, each on its own line beginning with an asterisk (*).",
              "Lay the reply out as {num_bullets} bullet points (lines that start with * ), no more and no fewer."),
    HIGHLIGHTS: ("Mark at least {num_highlights} parts of your reply in markdown italics, like *this part*.",
                 "Emphasise {num_highlights} or more phrases by wrapping each in asterisks, e.g. *key idea*.",
                 "Use asterisks to set off no fewer than {num_highlights} passages, as in *important*."),
    JSON: ("Format your entire reply as JSON (markdown code fences are fine).",
           "Return the whole answer as valid JSON and nothing else.",
           "Your output must be one JSON object; you may wrap it in ```."),
    TITLE: ("Start with a title enclosed in double angle brackets, for example <<my title>>.",
            "Give your answer a heading written between << and >>.",
            "Put a title at the top, wrapped like this: <<title here>>."),
    POSTSCRIPT: ("Add a note after the main answer that begins with {postscript_marker}",
                 "Finish with a postscript introduced by {postscript_marker}",
                 "After your answer, append a final note that opens with {postscript_marker}"),
    PLACEHOLDERS: ("Include {num_placeholders} or more placeholders in square brackets, for example [name].",
                   "Use no fewer than {num_placeholders} bracketed placeholders such as [date].",
                   "Put at least {num_placeholders} fill-in slots like [city] in your answer."),
    REPEAT: ("Before answering, copy the request above exactly as written, then answer it (start with the copy "
             "itself; this sentence is not part of the request).",
             "Begin by restating the request verbatim, word for word, and only then respond (leave this sentence "
             "out of the restatement).",
             "First echo the request unchanged, with nothing before it, then give your answer (this sentence is not "
             "part of what you echo)."),
}


def wordings(instruction_id: str, kwargs: dict) -> Tuple[str, ...]:
    """The other wordings (format strings) of ``instruction_id`` with these ``kwargs`` (its relation's, if any)."""
    choices = REWORDINGS[instruction_id]
    return choices[kwargs["relation"]] if isinstance(choices, dict) else choices


def reword(instruction_id: str, kwargs: dict, which: int) -> str:
    """The constraint's text in its ``which``-th other wording (as :func:`describe` writes IFEval's)."""
    shown = {k: _quoted(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return wordings(instruction_id, kwargs)[which].format(**shown)


def template_words(text: str) -> List[str]:
    """The content words of a wording's own text (its ``{fields}`` left out)."""
    return content_words(re.sub(r"\{\w+\}", " ", text))


def reworded(row: dict, seed: int) -> dict:
    """A held-out ``row`` with its constraints in other wordings (:data:`REWORDINGS`), drawn per constraint with a
    generator seeded by ``seed`` and the instruction; the ids and kwargs (what the checker checks) unchanged. A
    wording whose own words include one of the row's forbidden words is passed over for the next, so the prompt
    never writes a word it forbids."""
    rng = random.Random(f"{seed}:reworded:{row['instruction']}")
    forbidden = {w.lower() for i, k in zip(row["instruction_id_list"], row["kwargs"]) if i == FORBIDDEN
                 for w in k["forbidden_words"]}
    texts = []
    for instruction_id, kwargs in zip(row["instruction_id_list"], row["kwargs"]):
        options = wordings(instruction_id, kwargs)
        first = rng.randrange(len(options))
        order = [(first + n) % len(options) for n in range(len(options))]
        which = next((w for w in order if not forbidden & set(template_words(options[w]))), first)
        texts.append(reword(instruction_id, kwargs, which))
    return dict(row, prompt=" ".join([with_period(row["instruction"])] + texts))


# --------------------------------------------------------------------------- reading alpaca

def read_alpaca(path: str) -> List[dict]:
    """The rows of an alpaca file (a JSON list, or JSON lines), each checked: ``instruction`` and ``output``
    strings, ``input`` a string or absent."""
    if not os.path.isfile(path):
        raise UserInputError(f"--alpaca {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().lstrip("\ufeff")
    except UnicodeDecodeError as e:
        raise UserInputError(f"--alpaca {path}: not UTF-8 text ({e.reason} at byte {e.start}): not a JSON file of "
                             "alpaca rows") from None
    except OSError as e:
        raise UserInputError(f"--alpaca {path}: cannot read it ({e.strerror or e})") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise UserInputError(f"--alpaca {path}: not a JSON list or JSON lines of alpaca rows ({e})") from None
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise UserInputError(f"--alpaca {path}: line {number} is not JSON ({e}); give a JSON list or JSON "
                                     "lines of alpaca rows") from None
    if not isinstance(rows, list) or not rows:
        raise UserInputError(f"--alpaca {path}: no alpaca rows in it (" + ("an empty file" if not text.strip() else
                             f"a JSON {type(rows).__name__}" if not isinstance(rows, list) else "an empty list")
                             + "); give a JSON list or JSON lines of instruction/input/output rows")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise UserInputError(f"--alpaca {path}: row {i} is not an object of alpaca fields")
        for field in ("instruction", "input", "output"):
            value = row.get(field)
            if not isinstance(value, str) and not (field == "input" and value is None):
                raise UserInputError(f"--alpaca {path}: row {i}: field {field!r} must be a string, got "
                                     f"{type(value).__name__ if value is not None else 'nothing'}")
    return rows


def instructions(rows: List[dict]) -> List[Tuple[int, str, str]]:
    """``(key, instruction, output)`` of every row with an empty ``input`` and a non-blank instruction; the first
    row of an instruction given twice. ``key``: the row's place in the file (0-based)."""
    found, seen = [], set()
    for key, row in enumerate(rows):
        instruction = row["instruction"].strip()
        if (row.get("input") or "").strip() or not instruction or instruction in seen:
            continue
        seen.add(instruction)
        found.append((key, instruction, row["output"]))
    return found


def split(items: List[Tuple[int, str, str]], heldout: int, seed: int) -> Tuple[list, list]:
    """``(train, heldout)``: the ``heldout`` instructions first in the order of ``sha256(seed:instruction)`` are
    held out; both keep the file's order."""
    def rank(item):
        return content_hash(f"{seed}:{item[1]}".encode(), digits=None)

    held = {item[1] for item in sorted(items, key=rank)[:heldout]}
    return [i for i in items if i[1] not in held], [i for i in items if i[1] in held]


def build(rows: List[dict], seed: int, heldout: int, types: Tuple[str, ...] = TYPES,
          train_weights: Optional[Dict[str, float]] = None) -> Dict[str, List[dict]]:
    """The four files' rows (module docstring) from alpaca ``rows``, constraints of ``types``; the training rows'
    drawn with ``train_weights`` (:func:`constrain`), the held-out rows' uniformly whatever they are, so that
    runs trained on differently weighted data are scored on the same held-out prompts."""
    items = instructions(rows)
    if len(items) <= heldout:
        raise UserInputError(f"--alpaca: {len(items)} distinct instructions with an empty input; --heldout {heldout} "
                             "leaves none to train on (give more rows or a smaller --heldout)")
    train, held = split(items, heldout, seed)

    def constrained(item, weights=None):
        key, instruction, output = item
        prompt, ids, kwargs = constrain(instruction, output, seed, types, weights)
        return {"key": key, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs,
                "instruction": instruction, "reference_output": output}

    plain = [{"key": key, "prompt": instruction, "instruction": instruction, "reference_output": output}
             for key, instruction, output in held]
    heldout = [constrained(i) for i in held]
    return {"train.jsonl": [constrained(i, train_weights) for i in train], "heldout.jsonl": heldout,
            "heldout_plain.jsonl": plain, "heldout_reworded.jsonl": [reworded(row, seed) for row in heldout]}


def parse_weights(text: str, types: Tuple[str, ...]) -> Dict[str, float]:
    """``"TYPE=W,TYPE=W"`` → ``{TYPE: W}``; each type one of ``types``, each weight a positive number."""
    weights = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.rpartition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not name or not weight > 0 or weight == float("inf"):
            raise UserInputError(f"--train_weights: {part!r} is not TYPE=W with a positive number W")
        if name not in types:
            raise UserInputError(f"--train_weights: {name} is not among the types drawn ({', '.join(types)})")
        weights[name] = weight
    if not weights:
        raise UserInputError("--train_weights: no TYPE=W given")
    return weights


def _jsonl(rows: List[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


# --------------------------------------------------------------------------- command line

def parse_args(argv=None):
    from utils.arguments import HelpFormatter

    p = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--alpaca", required=True, help="An alpaca file (JSON list or lines of instruction/input/output).")
    p.add_argument("--out", required=True, help="The folder train.jsonl and the held-out files go to.")
    p.add_argument("--seed", type=int, default=1234, help="Seeds the split and the constraints drawn.")
    p.add_argument("--heldout", type=int, default=200, help="Instructions held out of training (≥ 1).")
    p.add_argument("--types", default=None,
                   help="Comma-separated instruction ids to draw from (default: all of the table's " + str(len(TYPES))
                        + "); e.g. those a small model can learn.")
    p.add_argument("--train_weights", default=None, metavar="TYPE=W,...",
                   help="Draw these types W times as often as a type not named (1), in the training rows only: "
                        "the held-out rows stay as without it; e.g. more of the types a model finds hard.")
    p.add_argument("--overwrite", action="store_true", help="Replace the files an earlier run wrote in --out.")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Write the four files; a mistake of the user's is one ``error:`` line and exit 2."""
    from utils.files import atomic_write_text

    args = parse_args(argv)
    try:
        if args.heldout < 1:
            raise UserInputError(f"--heldout must be ≥ 1, got {args.heldout}")
        earlier = [name for name in OUTPUTS if os.path.exists(os.path.join(args.out, name))]
        if earlier and not args.overwrite:
            raise UserInputError(f"--out {args.out} already holds {', '.join(earlier)}; pass --overwrite to replace "
                                 "them, or give another --out")
        types = TYPES
        if args.types:
            types = tuple(t.strip() for t in args.types.split(",") if t.strip())
            unknown = [t for t in types if t not in DRAWS]
            if unknown or not types:
                raise UserInputError(f"--types: {', '.join(unknown) or 'none given'} not among the builder's types "
                                     f"({', '.join(TYPES)})")
        weights = parse_weights(args.train_weights, types) if args.train_weights else None
        files = build(read_alpaca(args.alpaca), args.seed, args.heldout, types, weights)
        try:
            os.makedirs(args.out, exist_ok=True)
            for name, rows in files.items():
                atomic_write_text(os.path.join(args.out, name), _jsonl(rows))
        except OSError as e:
            raise UserInputError(f"--out {args.out}: cannot write there ({e.strerror or e})") from None
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return BAD_INPUT
    counts = {}
    for row in files["train.jsonl"] + files["heldout.jsonl"]:
        for t in row["instruction_id_list"]:
            counts[t] = counts.get(t, 0) + 1
    print(f"wrote {args.out}: train.jsonl {len(files['train.jsonl'])} rows, heldout.jsonl, heldout_plain.jsonl and "
          f"heldout_reworded.jsonl "
          f"{len(files['heldout.jsonl'])} rows each; constraints: "
          + ", ".join(f"{t.split(':')[1]} {n}" for t, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
