"""The built-in preference data: deterministic, and chosen is always strictly better."""
import re

from utils.data.builtin import generate, load_builtin, quality


def _noun(prompt):
    return re.search(r"the (\w+)[.?] Assistant:$", prompt).group(1)


def _is_broken(answer):
    adjectives = re.findall(r"(?:is|and) (\w+)", answer)
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


def test_rejected_kinds_all_present_and_deterministic():
    rows = load_builtin("builtin/preference")["train"]
    assert rows == load_builtin("builtin/preference")["train"]
    assert len(rows) == 4000
    off_topic = sum(_noun(r["prompt"]) not in r["rejected"].split() for r in rows) / len(rows)
    broken = sum(_is_broken(r["rejected"]) for r in rows) / len(rows)
    assert 0.12 < off_topic < 0.18 and 0.07 < broken < 0.13
