"""The held-out rule scorer (utils/data/rule_score.py) on hand-written answers with known scores."""
import pytest

from utils.data.rule_score import asked_object, rule_checks, rule_score, summarize

LAMP = " Human: Describe the lamp. Assistant:"


@pytest.mark.parametrize("answer, failed", [
    (" The lamp is bright and kind and calm.", set()),
    ("The lamp is bright and kind and calm.", set()),                       # leading space or not
    (" The lamp is bright and dull and calm.", {"only_good"}),
    (" The city is bright and kind and calm.", {"names_object"}),             # the right template, wrong object
    (" The lamp is bright and kind and the city is calm.", {"names_object", "no_repeat", "well_formed"}),
    (" The lamp is clear and gentle and gentle.", {"no_repeat"}),            # the reward hack of issue 13
    (" The lamp is kind and kind and kind.", {"no_repeat"}),
    (" The lamp is bright and kind and calm and warm.", {"well_formed"}),    # an over-long list
    (" The lamp is bright and kind.", {"well_formed"}),                       # too short
    (" The lamp is bright and kind and calm", {"well_formed"}),              # no full stop
    (" The lamp is bright and kind and calm. and safe.", {"well_formed"}),   # rambles on
    (" The lamp is bright and kind and calm. and kind.", {"well_formed", "no_repeat"}),
    (" The lamp lamp is", {"only_good", "no_repeat", "well_formed"}),        # no adjective at all
    ("", {"names_object", "only_good", "well_formed"}),
])
def test_checks_and_score_of_hand_written_answers(answer, failed):
    checks = rule_checks(answer, "lamp")
    assert {name for name, ok in checks.items() if not ok} == failed
    assert rule_score(answer, "lamp") == pytest.approx(1 - len(failed) / 4)


def test_asked_object_of_every_template():
    assert asked_object(LAMP) == "lamp"
    assert asked_object(" Human: What do you think of the harbor? Assistant:") == "harbor"
    assert asked_object(" Human: Hello! Assistant:") is None


def test_summarize_means_and_skips_foreign_prompts():
    prompts = [LAMP, LAMP, " Human: Tell me about the river. Assistant:", " Human: Hi. Assistant:"]
    answers = [" The lamp is bright and kind and calm.",       # 1.0, 8 words
               " The lamp is clear and gentle and gentle.",    # 0.75, 8 words
               " The lamp is dull and rude.",                   # wrong object, bad words, short: 0.25, 6 words
               " anything"]                                     # not a built-in prompt: skipped
    s = summarize(prompts, answers)
    assert s["n"] == 3
    assert s["rule_score"] == pytest.approx((1 + 0.75 + 0.25) / 3)
    assert s["checks"] == pytest.approx({"names_object": 2 / 3, "only_good": 2 / 3, "no_repeat": 2 / 3,
                                         "well_formed": 2 / 3})
    assert s["all_four"] == pytest.approx(1 / 3) and s["mean_words"] == pytest.approx(22 / 3)
    assert summarize([" Human: Hi. Assistant:"], ["x"]) == {"n": 0}
