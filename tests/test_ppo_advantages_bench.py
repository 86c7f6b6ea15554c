"""bench/bench_ppo_advantages.py's measures, by hand: the group-centred scores, step 3's first GAE advantages of
one answer, and the correlation of the advantages with the centred scores by token position. (Its run on a tiny
step-2 folder is in tests/test_real_rl_rows.py's whole-path test.)"""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ppo_advantages", REPO / "bench" / "bench_ppo_advantages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scores_are_centred_within_their_prompt(bench):
    assert bench.centred_scores([[1.0, 3.0], [2.0, 2.0, 5.0]]) == [[-1.0, 1.0], [-1.0, -1.0, 2.0]]


def test_step0_advantages_by_hand(bench):
    # values 0.5, 1.0, 0.0 before three actions, score 2 on the last, λ 0.5, γ 1:
    # t=2: δ = 2 − 0 = 2, Â = 2; t=1: δ = 0 + 0 − 1 = −1, Â = −1 + 0.5·2 = 0; t=0: δ = 1 − 0.5 = 0.5, Â = 0.5 + 0
    assert torch.allclose(bench.step0_advantages(torch.tensor([0.5, 1.0, 0.0]), 2.0, lam=0.5),
                          torch.tensor([0.5, 0.0, 2.0]))
    # λ 1 telescopes: every token's advantage is the score minus its own value
    assert torch.allclose(bench.step0_advantages(torch.tensor([0.5, 1.0, 0.0]), 2.0, lam=1.0),
                          torch.tensor([1.5, 1.0, 2.0]))
    # values 0 and λ 0.95: the score, discounted by 0.95 a token back from the end
    assert torch.allclose(bench.step0_advantages(torch.zeros(3), 1.0, lam=0.95), torch.tensor([0.9025, 0.95, 1.0]))


def test_signal_by_position_by_hand(bench):
    advantages = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, -2.0])]
    cells = bench.signal_by_position(advantages, [1.0, -1.0], buckets=((0, 1), (1, None), (5, None)))
    # first tokens: (1, −1) against (1, −1): 1
    assert cells[0] == pytest.approx(1.0)
    # tokens 1+: x = (2, 3, −2), y = (1, 1, −1): centred x (1, 2, −3), y (2, 2, −4)/3 → 6 / (√14 · √24 / 3)
    assert cells[1] == pytest.approx(18 / math.sqrt(14 * 24))
    # no answer reaches token 5
    assert math.isnan(cells[2])
    # every token: x = (1, 2, 3, −1, −2), y = (1, 1, 1, −1, −1): 8.4 / √(17.2 · 4.8)
    assert cells[3] == pytest.approx(8.4 / math.sqrt(17.2 * 4.8))


def test_pearson_of_a_constant_is_zero_not_nan(bench):
    assert bench.pearson(torch.ones(4), torch.arange(4.0)) == 0.0
    assert bench.pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])) == pytest.approx(1.0)


def test_head_learning_first_update_by_hand(bench):
    # one prompt, two answers of one action each: states (1, 0) scored 1 and (0, 1) scored 0. Before the update the
    # head is 0: advantages = scores (1, 0) against centred (0.5, −0.5): corr 1; value loss ½·mean(1², 0²) = 0.25.
    # The loss's gradient at 0 is −mean(G·h) = (−0.5, 0); AdamW's first step moves each weight by lr·sign(−grad)
    # (m̂/√v̂ = g/|g|), a zero gradient not at all: the head ends at (lr, 0).
    states = [[torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])]]
    run = bench.head_learning(states, [[1.0, 0.0]], lr=0.1, batch_prompts=1)
    assert run["corr"] == [pytest.approx(1.0)] and run["spans"] == [(0, 1)]
    assert run["loss"] == [pytest.approx(0.25)]
    assert torch.allclose(run["weight"], torch.tensor([0.1, 0.0]), atol=1e-6)


def test_a_value_head_that_can_learn_a_baseline_reaches_grpos_signal(bench):
    # Two kinds of prompt, told apart by the state's second feature: kind A's answers score 1 or 0.5 (mean 0.75),
    # kind B's 0.5 or 0 (0.25), every action of an answer sharing its state. With values 0 the advantages are the raw
    # scores, which carry the kind: corr with the centred scores about 1/√2 in every batch (one A, one B). A head that
    # learns each kind's mean removes it: G − V = the centred score, corr → 1. A learning rate of 0 stays put.
    gen = torch.Generator().manual_seed(0)
    states, scores = [], []
    for i in range(80):
        kind = i % 2
        high, low = (1.0, 0.5) if kind == 0 else (0.5, 0.0)
        state = torch.tensor([1.0, 1.0 if kind == 0 else -1.0])
        n = int(torch.randint(2, 5, (), generator=gen))
        states.append([state.expand(n, 2), state.expand(n + 1, 2)])
        scores.append([high, low])
    still = bench.head_learning(states, scores, lr=0.0, batch_prompts=2)
    assert still["corr"] == [pytest.approx(1 / math.sqrt(2), abs=0.02)] * 4
    assert still["spans"] == [(0, 10), (10, 20), (20, 30), (30, 40)]  # 40 batches of 2 prompts, 4 stretches
    learned = bench.head_learning(states, scores, lr=0.05, batch_prompts=2)
    assert learned["corr"][-1] > 0.97 and learned["corr"][0] < learned["corr"][-1]
    assert learned["loss"][-1] < still["loss"][-1] / 4
