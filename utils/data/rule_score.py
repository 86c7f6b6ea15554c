"""A rule-based score of answers to built-in prompts: a held-out check that does not use the reward model.

PPO maximises the reward model's score, so that score going up does not show that
the answers got better: the policy may have found what the reward model gets wrong
(a reward hack: "The lamp is clear and gentle and gentle."). For the built-in data
(:mod:`utils.data.builtin`) what a good answer is can be written down exactly, so
this module scores an answer with four checks, each passed or not:

* ``names_object``  the answer mentions the object asked about and no other built-in object;
* ``only_good``     it has at least one adjective, and all of its adjectives are GOOD ones;
* ``no_repeat``     no word occurs twice (the connective "and" aside);
* ``well_formed``   it is one sentence of the template, ``The <object> is A and B and C.``:
                    three adjectives, and it ends at its single full stop.

An answer's rule score is the fraction of checks it passes (0 to 1). Pure Python:
no torch, no model; :func:`summarize` condenses a list of answers.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

from utils.data.builtin import BAD, GOOD, N_ADJECTIVES, NOUNS

CHECKS = ("names_object", "only_good", "no_repeat", "well_formed")
_ASKED = re.compile(r"the (\w+)[.?]\s*Assistant:\s*$")
_TEMPLATE = re.compile(r"^The (\w+) is (\w+(?: and \w+)*)\.$")


def asked_object(prompt: str) -> Optional[str]:
    """The object a built-in prompt asks about (``" Human: Describe the lamp. Assistant:"`` -> ``"lamp"``)."""
    match = _ASKED.search(prompt)
    return match.group(1) if match else None


def words(answer: str) -> List[str]:
    """The answer's words, lower case, punctuation removed."""
    return re.findall(r"[a-z]+", answer.lower())


def rule_checks(answer: str, noun: str) -> Dict[str, bool]:
    """The four checks of the module docstring for ``answer`` to a prompt about ``noun``."""
    ws = words(answer)
    adjectives = [w for w in ws if w in GOOD or w in BAD]
    content = [w for w in ws if w != "and"]
    template = _TEMPLATE.match(answer.strip())
    return {
        "names_object": noun in ws and not any(w in NOUNS and w != noun for w in ws),
        "only_good": bool(adjectives) and all(w in GOOD for w in adjectives),
        "no_repeat": len(set(content)) == len(content),
        "well_formed": bool(template) and len(template.group(2).split(" and ")) == N_ADJECTIVES,
    }


def rule_score(answer: str, noun: str) -> float:
    """Fraction of the four checks ``answer`` passes: 1.0 for ``" The lamp is bright and kind and calm."``."""
    checks = rule_checks(answer, noun)
    return sum(checks.values()) / len(checks)


def summarize(prompts: List[str], answers: List[str]) -> Dict[str, object]:
    """Mean rule score, pass rate of each check, share passing all four, mean length in words.

    Prompts whose object cannot be read (not built-in ones) are skipped; ``n`` counts the rest.
    """
    scored = [(asked_object(p), a) for p, a in zip(prompts, answers)]
    scored = [(noun, a) for noun, a in scored if noun is not None]
    if not scored:
        return {"n": 0}
    checks = [rule_checks(a, noun) for noun, a in scored]
    n = len(scored)
    return {
        "n": n,
        "rule_score": sum(sum(c.values()) / len(CHECKS) for c in checks) / n,
        "checks": {name: sum(c[name] for c in checks) / n for name in CHECKS},
        "all_four": sum(all(c.values()) for c in checks) / n,
        "mean_words": sum(len(words(a)) for _, a in scored) / n,
    }
