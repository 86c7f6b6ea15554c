"""The built-in procedural preference dataset (no download, fixed seed).

``builtin/preference`` rows look like::

    prompt   " Human: Describe the lamp. Assistant:"
    chosen   " The lamp is bright and kind and calm."
    rejected " The lamp is dull and bright and rude."

Every answer names the prompt's object and lists three different adjectives,
each drawn from a GOOD or a BAD word list. An answer's quality is its number of
good words, with penalties for talking about the wrong object (15% of the
rejected answers) and for a broken answer — too many words or text after the full
stop (another 10%: these stop PPO from "hacking" the reward by piling up good words). In every pair the chosen answer has strictly higher
quality than the rejected one. So:

* step 1 learns the answer template (chosen answers are good on average, not
  always perfect: the number of good words varies);
* step 2 can learn the preference exactly (count good words, check the object),
  so held-out accuracy near 1 is reachable by a tiny model;
* step 3 has room to improve: sampling from the SFT policy gives answers of mixed
  quality, and PPO can push it towards all-good answers that score higher.

``builtin/preference-small`` is the same generator with fewer rows (tests).
The tokenizer corpus (:func:`tokenizer_corpus`) is drawn from the same generator.
"""
from __future__ import annotations

import random
from typing import Dict, List

VERSION = 3  # bump when the generator changes: it is part of every cache key

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
SIZES = {"builtin/preference": (4000, 400), "builtin/preference-small": (400, 80)}
BUILTIN_DATASETS = tuple(SIZES)
N_ADJECTIVES = 3


def _answer(rng: random.Random, noun: str, n_good: int) -> str:
    words = rng.sample(GOOD, n_good) + rng.sample(BAD, N_ADJECTIVES - n_good)  # no word twice
    rng.shuffle(words)
    return f" The {noun} is " + " and ".join(words) + "."


def _malformed(rng: random.Random, noun: str) -> str:
    """All-good words but a broken answer: too many words, or rambling on past the full stop."""
    words = rng.sample(GOOD, N_ADJECTIVES)
    if rng.random() < 0.5:
        words += rng.sample([w for w in GOOD if w not in words], rng.randint(1, 3))
        return f" The {noun} is " + " and ".join(words) + "."
    return f" The {noun} is " + " and ".join(words) + "." + "".join(
        f" and {w}." for w in rng.sample(GOOD, rng.randint(1, 3)))


def quality(answer: str, noun: str) -> int:
    """Good words; −2 for another object; −6 for a broken answer (repeats, ≠ 3 words, text after '.')."""
    adjectives = [w for w in answer.replace(".", " ").split() if w in GOOD or w in BAD]
    score = sum(w in GOOD for w in adjectives)
    if noun not in answer.replace(".", " ").split():
        score -= 2
    broken = (len(adjectives) != N_ADJECTIVES or len(set(adjectives)) != len(adjectives)
              or not answer.endswith(".") or answer.count(".") != 1)
    return score - (6 if broken else 0)


def _row(rng: random.Random) -> Dict[str, str]:
    noun = rng.choice(NOUNS)
    prompt = " Human: " + rng.choice(TEMPLATES).format(noun=noun) + " Assistant:"
    good_chosen = rng.randint(1, N_ADJECTIVES)
    good_rejected = rng.randint(0, good_chosen - 1)
    chosen = _answer(rng, noun, good_chosen)
    kind = rng.random()
    if kind < 0.15:  # off-topic rejected answers: the reward must also check the object
        other = rng.choice([n for n in NOUNS if n != noun])
        rejected = _answer(rng, other, rng.randint(0, min(N_ADJECTIVES, good_chosen + 1)))
    elif kind < 0.25:  # broken rejected answers: repeating good words must not pay
        rejected = _malformed(rng, noun)
    else:
        rejected = _answer(rng, noun, good_rejected)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def generate(n_rows: int, seed: int) -> List[Dict[str, str]]:
    rng = random.Random(seed)
    return [_row(rng) for _ in range(n_rows)]


def load_builtin(name: str) -> Dict[str, List[Dict[str, str]]]:
    """``{"train": rows, "eval": rows}`` for a built-in dataset name."""
    if name not in SIZES:
        raise KeyError(f"unknown built-in dataset {name!r}; known: {', '.join(BUILTIN_DATASETS)}")
    n_train, n_eval = SIZES[name]
    return {"train": generate(n_train, seed=1000 + VERSION), "eval": generate(n_eval, seed=2000 + VERSION)}


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
