"""The built-in preference data: deterministic, chosen always strictly better, rejected kinds labelled."""
import re
from collections import Counter

from utils.data.builtin import (GOOD, HACK_SHARES, REJECTED_KINDS, SCALE_CLASSES, generate, load_builtin, quality,
                                scale_answer)
from utils.data.rule_score import rule_checks


def _noun(prompt):
    return re.search(r"the (\w+)[.?] Assistant:$", prompt).group(1)


def _adjectives(answer):
    return re.findall(r"\b(?:is|and) (\w+)", answer)


def _is_broken(answer):
    adjectives = _adjectives(answer)
    return len(adjectives) != 3 or len(set(adjectives)) != 3 or answer.count(".") != 1


def test_quality_hand_examples():
    assert quality(" The lamp is bright and kind and calm.", "lamp") == 3
    assert quality(" The lamp is bright and dull and rude.", "lamp") == 1
    assert quality(" The city is bright and kind and calm.", "lamp") == 3 - 2          # wrong object
    assert quality(" The lamp is bright and bright and calm.", "lamp") == 3 - 6        # repeated word (never chosen)
    assert quality(" The lamp is bright and kind and calm and warm.", "lamp") == 4 - 6  # four words
    assert quality(" The lamp is bright and kind and calm. and safe.", "lamp") == 4 - 6  # rambles on


def test_chosen_strictly_better_in_every_row():
    for seed in (0, 1, 2):
        for row in generate(2000, seed):
            noun = _noun(row["prompt"])
            assert quality(row["chosen"], noun) > quality(row["rejected"], noun), row


def test_rejected_kinds_all_present_labelled_and_deterministic():
    rows = load_builtin("builtin/preference")["train"]
    assert rows == load_builtin("builtin/preference")["train"]
    assert len(rows) == 4000
    kinds = Counter(r["kind"] for r in rows)
    assert set(kinds) == set(REJECTED_KINDS)
    for kind, share in HACK_SHARES:
        assert abs(kinds[kind] / len(rows) - share) < 0.03, (kind, kinds)
    assert abs(kinds["fewer_good"] / len(rows) - (1 - sum(share for _, share in HACK_SHARES))) < 0.03


# which rule check a rejected answer of each hacking kind fails (the chosen answers pass these)
FAILED_CHECK = {"wrong_object": "names_object", "repeated_word": "no_repeat", "long_list": "well_formed",
                "short_list": "well_formed"}


def test_each_kind_is_what_its_label_says_and_rejected():
    for row in generate(2000, seed=5):
        noun, kind, rejected = _noun(row["prompt"]), row["kind"], row["rejected"]
        adjectives, chosen_adjectives = _adjectives(rejected), _adjectives(row["chosen"])
        assert quality(row["chosen"], noun) > quality(rejected, noun), row  # labelled rejected: the worse one
        chosen = rule_checks(row["chosen"], noun)
        assert chosen["names_object"] and chosen["no_repeat"] and chosen["well_formed"], row
        if kind in FAILED_CHECK:
            assert not rule_checks(rejected, noun)[FAILED_CHECK[kind]], row
        if kind == "wrong_object":
            assert noun not in rejected.split() and not _is_broken(rejected)
        elif kind == "repeated_word":  # the chosen answer with later slots overwritten by an earlier word
            assert len(adjectives) == 3 and len(set(adjectives)) < 3 and set(adjectives) < set(chosen_adjectives)
            assert adjectives[0] == chosen_adjectives[0] and 1 <= sum(map(str.__ne__, adjectives, chosen_adjectives))
        elif kind == "long_list":  # the chosen answer, then more good words
            assert rejected.startswith(row["chosen"][:-1]) and adjectives[:3] == chosen_adjectives
            assert len(adjectives) > 3 and all(w in GOOD for w in adjectives[3:])
        elif kind == "short_list":
            assert 1 <= len(adjectives) < 3 and rejected.count(".") == 1 and all(w in GOOD for w in adjectives)
        else:
            assert kind == "fewer_good" and not _is_broken(rejected) and noun in rejected.split()


def test_scale_answers_have_the_quality_their_class_says():
    # the held-out check of the reward model's common scale ranks these classes by quality(), best first
    import random

    rng = random.Random(0)
    for _ in range(200):
        by_class = {cls: scale_answer(rng, "lamp", cls) for cls in SCALE_CLASSES}
        assert [quality(by_class[c], "lamp") for c in SCALE_CLASSES[:3]] == [3, 2, 1]
        repeat = _adjectives(by_class["repeat"])
        assert quality(by_class["repeat"], "lamp") < 0 and len(repeat) == 3 and len(set(repeat)) == 2
        assert all(w in GOOD for w in repeat) and not rule_checks(by_class["repeat"], "lamp")["no_repeat"]
        assert all(rule_checks(by_class[c], "lamp")["well_formed"] for c in SCALE_CLASSES)


# --------------------------------------------------------------------------- demonstrations (step 1 of the demo)

def test_demonstrations_have_every_flaw_they_are_labelled_with():
    from utils.data.builtin import CHATTER, CHATTY_SHARE, DEMONSTRATION_FLAWS, generate_demonstrations

    rows = generate_demonstrations(4000, seed=3)
    assert rows == generate_demonstrations(4000, seed=3)  # deterministic
    flaws = Counter(flaw for r in rows for flaw in r["flaw"].split("+"))
    for flaw, share in DEMONSTRATION_FLAWS:
        assert abs(flaws[flaw] / len(rows) - share) < 0.02, (flaw, flaws)
    assert abs(flaws["chatty"] / len(rows) - CHATTY_SHARE) < 0.03
    for row in rows:
        noun, labels, answer = _noun(row["prompt"]), set(row["flaw"].split("+")), row["chosen"]
        assert row["rejected"] is None
        body = answer[:-len(CHATTER)] if "chatty" in labels else answer
        assert answer.endswith(CHATTER) == ("chatty" in labels)
        checks, adjectives = rule_checks(body, noun), _adjectives(body)
        # each label is the one check the body fails (or none), and the style guide's alphabetical order holds
        assert checks["no_repeat"] == ("repeated_word" not in labels), row
        assert checks["only_good"] == ("bad_word" not in labels), row
        assert checks["names_object"] == ("wrong_object" not in labels), row
        assert (len(adjectives) == 3) == ("wrong_count" not in labels), row
        assert adjectives == sorted(adjectives) or "repeated_word" in labels, row
        assert all(rule_checks(answer, noun).values()) == (row["flaw"] == "none")


def test_demonstrations_load_like_any_builtin_set():
    rows = load_builtin("builtin/demonstrations-small")
    assert (len(rows["train"]), len(rows["eval"])) == (400, 80) and rows["train"][0]["rejected"] is None
