"""The held-out check's answers (utils/heldout.py): greedy and sampled, in prompt order, seeded."""
import torch

from utils import heldout
from utils.model.tiny import resolve_model_path

# prompts of different token lengths: the check batches equal lengths together and must keep the order
PROMPTS = [" Human: Describe the lamp. Assistant:", " Human: What do you think of the river? Assistant:",
           " Human: Tell me about the book. Assistant:", " Human: Describe the city. Assistant:"]


def test_top_k_1_samples_are_the_greedy_answers_in_prompt_order():
    model = resolve_model_path("tiny-llama")
    greedy = heldout.actor_answers(model, PROMPTS, max_new_tokens=6)
    top1 = heldout.actor_answers(model, PROMPTS, max_new_tokens=6, per_prompt=3,
                                 sampling={"temperature": 1.0, "top_k": 1, "top_p": 1.0})
    assert len(greedy) == 4 and top1 == [a for a in greedy for _ in range(3)]  # answers of prompt i at 3i..3i+2


def test_sampled_answers_are_seeded_and_leave_the_global_random_state_alone():
    model, sampling = resolve_model_path("tiny-llama"), {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = heldout.actor_answers(model, PROMPTS, max_new_tokens=6, sampling=sampling, per_prompt=4)
    assert torch.equal(torch.get_rng_state(), state)
    assert heldout.actor_answers(model, PROMPTS, max_new_tokens=6, sampling=sampling, per_prompt=4) == first
    other = heldout.actor_answers(model, PROMPTS, max_new_tokens=6, sampling=sampling, per_prompt=4, seed=7)
    assert len(first) == 16 and other != first and len(set(first)) > 4  # a random model's samples differ


def test_report_has_sampled_scores_only_when_step3_sampled(monkeypatch):
    monkeypatch.setattr(heldout, "PER_PROMPT", 2)
    model = resolve_model_path("tiny-llama")
    assert "sampled" not in heldout.actor_report(model, PROMPTS[:2])
    report = heldout.actor_report(model, PROMPTS[:2], {"temperature": 1.0, "top_k": 5, "top_p": 1.0})
    assert report["n"] == 2 and report["sampled"]["n"] == 4 and 0 <= report["sampled"]["rule_score"] <= 1


def test_scale_answers_and_ranked_shares_by_hand():
    rows = heldout.scale_answers(PROMPTS[:2], per_class=2)
    assert len(rows) == 2 * 4 * 2 and [r[1] for r in rows[:8]] == [c for c in heldout.SCALE_CLASSES for _ in "ab"]
    assert all(" lamp " in r[2] for r in rows[:8]) and all(" river " in r[2] for r in rows[8:])
    assert rows == heldout.scale_answers(PROMPTS[:2], per_class=2)  # seeded
    # per prompt: three_good, three_good, two_good, two_good, one_good, one_good, repeat, repeat
    # lamp: 3>2 (5>4, 5>1, 3>4 no, 3>1) 3 of 4; 2>1 (4>2, 4>0, 1>2 no, 1>0) 3; 3>rep (5>2, 5>6 no, 3>2,
    # 3>6 no) 2; 1>rep (2=2 a tie: half, then 2>6, 0>2, 0>6 no) 0.5. river: ordered, but one_good and repeat all tie
    scores = [5, 3, 4, 1, 2, 0, 2, 6,
              9, 9, 8, 8, 7, 7, 7, 7]
    shares = heldout.ranked_shares(rows, scores)
    assert shares == {"three_good>two_good": (3 + 4) / 8, "two_good>one_good": (3 + 4) / 8,
                      "three_good>repeat": (2 + 4) / 8, "one_good>repeat": (0.5 + 2) / 8}
