"""The built-in procedural preference dataset (no download, fixed seed).

``builtin/preference`` rows look like::

    prompt   " Human: Describe the lamp. Assistant:"
    chosen   " The lamp is bright and kind and calm."
    rejected " The lamp is dull and bright and rude."
    kind     "fewer_good"

A well-formed answer names the prompt's object and lists three different
adjectives, each drawn from a GOOD or a BAD word list. An answer's quality
(:func:`quality`) is its number of good words, with penalties for talking about
the wrong object and for a broken answer (a repeated adjective, more or fewer
than three adjectives, text after the full stop). In every pair the chosen
answer has strictly higher quality than the rejected one.

``kind`` says how the rejected answer is worse (:data:`REJECTED_KINDS`):

* ``fewer_good``     the right template with fewer good words (40%; half of them are the
                     chosen answer with good words swapped for bad ones);
* ``wrong_object``   the right template about another object (20%; three in four with
                     the chosen answer's adjectives);
* ``repeated_word``  the chosen answer with one or both later slots overwritten by an earlier
                     (good) word: "clear and gentle and gentle", "safe and safe and safe" (25%);
* ``long_list``      the chosen answer plus more good words, in the list or after the full stop (10%);
* ``short_list``     only one or two good words (5%).

The last four are the ways a policy can game a reward model that only counts good
words; showing them to the reward model as rejected answers keeps PPO honest.
So:

* step 1 learns the answer template (chosen answers are good on average, not
  always perfect: the number of good words varies);
* step 2 can learn the preference exactly (count good words, check the object,
  the list's length and repeats), so held-out accuracy above 0.9 is reachable by
  a tiny model, on every kind;
* step 3 has room to improve: sampling from the SFT policy gives answers of mixed
  quality, and PPO can push it towards all-good answers that score higher.

``builtin/preference-small`` is the same generator with fewer rows (tests).
The tokenizer corpus (:func:`tokenizer_corpus`) is drawn from the same generator.
"""
from __future__ import annotations

import random
from typing import Dict, List

VERSION = 4  # bump when the generator changes: it is part of every cache key

NOUNS = (
    "lamp", "river", "garden", "city", "song", "book", "window", "forest", "teacher", "robot",
    "bridge", "kitchen", "market", "ocean", "mountain", "letter", "train", "school", "painting", "village",
    "engine", "museum", "island", "camera", "bicycle", "castle", "library", "festival", "desert", "harbor",
)
GOOD = ("bright", "kind", "calm", "clean", "warm", "gentle", "helpful", "clear", "safe", "lovely", "honest", "useful")
BAD = ("dull", "rude", "broken", "dirty", "cold", "noisy", "useless", "unsafe", "ugly", "boring", "harsh", "wrong")
TEMPLATES = (
    "Describe the {noun}.",
    "Tell me about the {noun}.",
    "What do you think of the {noun}?",
    "How would you describe the {noun}?",
)
SIZES = {"builtin/preference": (4000, 400), "builtin/preference-small": (400, 80),
         "builtin/demonstrations": (4000, 400), "builtin/demonstrations-small": (400, 80)}
BUILTIN_DATASETS = tuple(SIZES)
DEMONSTRATIONS_VERSION = 4  # bump when the demonstrations' generator changes (part of their cache key)
N_ADJECTIVES = 3
# How a rejected answer is worse, with its share of the rows (the rest are "fewer_good").
HACK_SHARES = (("wrong_object", 0.20), ("repeated_word", 0.25), ("long_list", 0.10), ("short_list", 0.05))
REJECTED_KINDS = ("fewer_good",) + tuple(kind for kind, _ in HACK_SHARES)


def _words(rng: random.Random, n_good: int) -> List[str]:
    """Three different adjectives, ``n_good`` of them good, in random order."""
    words = rng.sample(GOOD, n_good) + rng.sample(BAD, N_ADJECTIVES - n_good)
    rng.shuffle(words)
    return words


def _sentence(noun: str, words: List[str]) -> str:
    return f" The {noun} is " + " and ".join(words) + "."


def _long_list(rng: random.Random, noun: str, words: List[str]) -> str:
    """The chosen words plus more good ones: a longer list, or rambling on past the full stop."""
    extra = rng.sample([w for w in GOOD if w not in words], rng.randint(1, 3))
    if rng.random() < 0.5:
        return _sentence(noun, words + extra)
    return _sentence(noun, words) + "".join(f" and {w}." for w in extra)


def _repeated_word(rng: random.Random, words: List[str]) -> List[str]:
    """The chosen words with one slot (two in three rows) or both later slots overwritten by an earlier word.

    The copied word is a good one when the chosen answer has one before the slot.
    """
    slots = rng.choice(((1,), (2,), (1, 2)))
    earlier = [w for w in words[:slots[0]] if w in GOOD] or words[:slots[0]]
    copy = rng.choice(earlier)
    return [copy if i in slots else w for i, w in enumerate(words)]


def _fewer_good(rng: random.Random, words: List[str]) -> List[str]:
    """The chosen words with one or more good ones replaced by bad ones (in place)."""
    good_slots = [i for i, w in enumerate(words) if w in GOOD]
    swap = set(rng.sample(good_slots, rng.randint(1, len(good_slots))))
    bad = iter(rng.sample([w for w in BAD if w not in words], len(swap)))
    return [next(bad) if i in swap else w for i, w in enumerate(words)]


def _rejected(rng: random.Random, kind: str, noun: str, words: List[str]) -> str:
    """A rejected answer of ``kind`` (see the module docstring) for a chosen answer listing ``words``.

    The hacking kinds are mostly small edits of the chosen answer, so that the pair differs
    just where the hack is (the reward model's pairwise loss compares the two from there on).
    """
    good_chosen = sum(w in GOOD for w in words)
    if kind == "wrong_object":  # the reward must also check the object
        other = rng.choice([n for n in NOUNS if n != noun])
        if rng.random() < 0.75:
            return _sentence(other, words)
        return _sentence(other, _words(rng, rng.randint(0, min(N_ADJECTIVES, good_chosen + 1))))
    if kind == "repeated_word":
        return _sentence(noun, _repeated_word(rng, words))
    if kind == "long_list":
        return _long_list(rng, noun, words)
    if kind == "short_list":
        return _sentence(noun, rng.sample(GOOD, rng.randint(1, N_ADJECTIVES - 1)))
    if rng.random() < 0.5:
        return _sentence(noun, _fewer_good(rng, words))
    return _sentence(noun, _words(rng, rng.randint(0, good_chosen - 1)))


def _pick_kind(rng: random.Random) -> str:
    u, edge = rng.random(), 0.0
    for kind, share in HACK_SHARES:
        edge += share
        if u < edge:
            return kind
    return "fewer_good"


def quality(answer: str, noun: str) -> int:
    """Good words; −2 for another object; −6 for a broken answer (repeats, ≠ 3 words, text after '.')."""
    adjectives = [w for w in answer.replace(".", " ").split() if w in GOOD or w in BAD]
    score = sum(w in GOOD for w in adjectives)
    if noun not in answer.replace(".", " ").split():
        score -= 2
    broken = (len(adjectives) != N_ADJECTIVES or len(set(adjectives)) != len(adjectives)
              or not answer.endswith(".") or answer.count(".") != 1)
    return score - (6 if broken else 0)


# Answers of a known rank drawn independently of each other, for the held-out check of the reward model's
# common scale (utils/heldout.py): best first by quality() (3, 2, 1, and -3 or -4 for the repeat).
SCALE_CLASSES = ("three_good", "two_good", "one_good", "repeat")


def scale_answer(rng: random.Random, noun: str, cls: str) -> str:
    """A well-formed answer about ``noun`` of class ``cls`` (:data:`SCALE_CLASSES`): three different adjectives
    with 3, 2 or 1 good ones, or two different good ones of which one is repeated ("clear and safe and safe")."""
    if cls == "repeat":
        a, b = rng.sample(GOOD, 2)
        return _sentence(noun, list(rng.choice(((a, b, b), (a, b, a), (a, a, b)))))
    n_good = {"three_good": 3, "two_good": 2, "one_good": 1}[cls]
    return _sentence(noun, _words(rng, n_good))


def _row(rng: random.Random) -> Dict[str, str]:
    noun = rng.choice(NOUNS)
    prompt = " Human: " + rng.choice(TEMPLATES).format(noun=noun) + " Assistant:"
    words = _words(rng, rng.randint(1, N_ADJECTIVES))
    kind = _pick_kind(rng)
    return {"prompt": prompt, "chosen": _sentence(noun, words), "rejected": _rejected(rng, kind, noun, words),
            "kind": kind}


def generate(n_rows: int, seed: int) -> List[Dict[str, str]]:
    """``n_rows`` rows ``{"prompt", "chosen", "rejected", "kind"}``, the same for the same seed."""
    rng = random.Random(seed)
    return [_row(rng) for _ in range(n_rows)]


# ----------------------------------------------------------------------------- demonstrations
#
# ``builtin/demonstrations`` is what a team of human demonstrators would write for the same prompts: answers of
# mixed quality, as real demonstrations are. Their style guide asks for three different good adjectives in
# alphabetical order, and most answers follow it, but the demonstrators have habits:
# most of them chat on after the answer (" Hope this helps!"), and some slip in a bad word, list two or four
# adjectives, describe another object or repeat the first adjective at the end ("bright and kind and bright").
# Step 1 imitates all of it, so the SFT actor is imperfect at its plateau and step 3 has room to make it better
# (InstructGPT's premise). Rows:
#
#     prompt   " Human: Describe the lamp. Assistant:"
#     chosen   " The lamp is bright and calm and dull. Hope this helps!"   (the demonstration)
#     rejected None                                                     (no comparison: an SFT set)
#     flaw     "bad_word+chatty"                                        (the flaws, or "none")

# The flaws of the body of the answer, each with its share of the rows (the rest have none) ...
DEMONSTRATION_FLAWS = (("bad_word", 0.15), ("wrong_count", 0.10), ("wrong_object", 0.05), ("repeated_word", 0.05))
# ... and, independently of them, the share of answers that chat on after the full stop
CHATTY_SHARE = 0.55
CHATTER = " Hope this helps!"


def demonstration(rng: random.Random, noun: str, flaw: str) -> str:
    """The body of a demonstration about ``noun`` with ``flaw`` (:data:`DEMONSTRATION_FLAWS`, or "none"); the
    adjectives in alphabetical order (the style guide; a repeat breaks it)."""
    if flaw == "repeated_word":  # the first word again at the end
        first, second = sorted(rng.sample(GOOD, 2))
        return _sentence(noun, [first, second, first])
    if flaw == "bad_word":
        return _sentence(noun, sorted(_words(rng, rng.choice((1, 2)))))
    if flaw == "wrong_count":
        return _sentence(noun, sorted(rng.sample(GOOD, rng.choice((2, 4)))))
    if flaw == "wrong_object":
        return _sentence(rng.choice([n for n in NOUNS if n != noun]), sorted(rng.sample(GOOD, N_ADJECTIVES)))
    if flaw != "none":
        raise ValueError(f"unknown demonstration flaw {flaw!r}")
    return _sentence(noun, sorted(rng.sample(GOOD, N_ADJECTIVES)))


def _demonstration_row(rng: random.Random) -> Dict[str, str]:
    noun = rng.choice(NOUNS)
    u, edge, flaw = rng.random(), 0.0, "none"
    for kind, share in DEMONSTRATION_FLAWS:
        edge += share
        if u < edge:
            flaw = kind
            break
    prompt = " Human: " + rng.choice(TEMPLATES).format(noun=noun) + " Assistant:"
    answer = demonstration(rng, noun, flaw)
    if rng.random() < CHATTY_SHARE:
        answer += CHATTER
        flaw = "chatty" if flaw == "none" else f"{flaw}+chatty"
    return {"prompt": prompt, "chosen": answer, "rejected": None, "flaw": flaw}


def generate_demonstrations(n_rows: int, seed: int) -> List[Dict[str, str]]:
    """``n_rows`` rows ``{"prompt", "chosen", "rejected": None, "flaw"}``, the same for the same seed."""
    rng = random.Random(seed)
    return [_demonstration_row(rng) for _ in range(n_rows)]


def dataset_version(name: str) -> int:
    """The generator version of a built-in dataset (part of its cache key)."""
    return DEMONSTRATIONS_VERSION if name.startswith("builtin/demonstrations") else VERSION


def load_builtin(name: str) -> Dict[str, List[Dict[str, str]]]:
    """``{"train": rows, "eval": rows}`` for a built-in dataset name."""
    if name not in SIZES:
        raise KeyError(f"unknown built-in dataset {name!r}; known: {', '.join(BUILTIN_DATASETS)}")
    n_train, n_eval = SIZES[name]
    make = generate_demonstrations if name.startswith("builtin/demonstrations") else generate
    version = dataset_version(name)
    return {"train": make(n_train, seed=1000 + version), "eval": make(n_eval, seed=2000 + version)}


def tokenizer_corpus() -> List[str]:
    """Texts the built-in tokenizer is trained on: the dataset's own text plus common English."""
    rows = generate(2000, seed=3000 + VERSION)
    texts = [r["prompt"] + r["chosen"] + r["rejected"] for r in rows]
    texts.append(ENGLISH)
    return texts


# A little general English so that the tokenizer has merges for everyday words
# (the byte-level alphabet already covers any text).
ENGLISH = """
Human: Hello! How are you today? Assistant: I am well, thank you. How can I help you?
Human: What is the capital of France? Assistant: The capital of France is Paris.
Human: Can you write a short poem about the sea? Assistant: The sea is wide, the sea is deep,
its waves will sing the world to sleep. Please tell me if you would like another one.
The quick brown fox jumps over the lazy dog. A good answer is short, clear, honest and useful.
Thank you for your question. I do not know the answer, but I can try to help you find it.
We should be kind to each other, and we should always tell the truth. What else would you like to know?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Days: Monday Tuesday Wednesday Thursday Friday Saturday Sunday.
"""
