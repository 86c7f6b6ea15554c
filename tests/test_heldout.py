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
