"""Hand-computed checks of the policy losses (PPO with clip-higher, GSPO, CISPO), the loss aggregations and their
per-optimizer-step normaliser, DAPO's overlong penalty and group filter (utils/rl_math.py), and dynamic sampling's
refill across ranks (step3_rlhf_finetuning.ppo_trainer.RoundCollector). Every expected number is worked out in the
comment next to it."""
import math
import threading

import pytest
import torch
from torch.testing import assert_close

from step3_rlhf_finetuning.algorithms import ESTIMATORS, POLICY_LOSSES, estimator_table
from step3_rlhf_finetuning.config import PPOConfig
from utils.rl_math import (aggregate_loss, cispo_policy_loss, gspo_policy_loss, informative_groups, loss_count,
                           overlong_penalty, ppo_policy_loss, step_normalizers)


def t(data):
    return torch.tensor(data, dtype=torch.float32)


LN = math.log


# =========================================================================== PPO's surrogate, clip-higher


def test_ppo_clip_higher_lets_a_token_grow_further_than_the_lower_clip():
    # ρ = 1.25, 1.3 (Â = 1) and 0.7 (Â = −1); ε_low 0.2, ε_high 0.28: bounds 0.8 … 1.28
    log_probs = t([[LN(1.25), LN(1.3), LN(0.7)]]).requires_grad_()
    old, adv, mask = torch.zeros(1, 3), t([[1.0, 1.0, -1.0]]), t([[1, 1, 1]])
    per_token = ppo_policy_loss(log_probs, old, adv, mask, 0.2, 0.28)
    # 1.25: inside → −1.25; 1.3: clipped at 1.28 → max(−1.3, −1.28) = −1.28; 0.7 (Â < 0): max(0.7, 0.8) = 0.8
    assert_close(per_token, t([[-1.25, -1.28, 0.8]]))
    per_token.sum().backward()
    # only the unclipped token has a gradient: d(−Â·ρ)/dlogπ = −Â·ρ = −1.25
    assert_close(log_probs.grad, t([[-1.25, 0.0, 0.0]]))
    # symmetric 0.2 (DeepSpeed-Chat's): 1.25 is clipped too
    assert_close(ppo_policy_loss(log_probs.detach(), old, adv, mask, 0.2, 0.2), t([[-1.2, -1.2, 0.8]]))


def test_ppo_masked_tokens_are_exactly_zero_even_when_inf():
    per_token = ppo_policy_loss(t([[0.0, float("inf")]]), torch.zeros(1, 2), t([[1.0, float("nan")]]),
                                t([[1, 0]]), 0.2, 0.2)
    assert torch.equal(per_token, t([[-1.0, 0.0]]))


# =========================================================================== GSPO


def test_gspo_clips_the_answers_geometric_mean_ratio_once_per_answer():
    # answer 0: token log-ratios 0.1 and 0.3 → s = e^0.2 = 1.2214 > 1.2: the whole answer is clipped (Â = 1),
    #           although its first token's own ratio e^0.1 = 1.105 is inside the range
    # answer 1: 0.3 and −0.3 → s = 1 (Â = −1): inside; each token's loss is −Â·s = 1
    old = torch.zeros(2, 3)
    log_probs = t([[0.1, 0.3, 9.0], [0.3, -0.3, 0.0]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 0]])
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    per_token = gspo_policy_loss(log_probs, old, adv, mask, 0.2, 0.2)
    assert_close(per_token, t([[-1.2, -1.2, 0.0], [1.0, 1.0, 0.0]]))
    loss = aggregate_loss(per_token, mask, "seq_mean_token_mean", 2.0, 3)  # (−1.2 + 1) / 2
    assert_close(loss, t(-0.1))
    loss.backward()
    # answer 0 clipped: no gradient; answer 1: −Â·s·(1/2 tokens)·(1/2 answers) = 0.25 on each token
    assert_close(log_probs.grad, t([[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]]))
    # PPO on the same tokens would clip answer 1's first token (e^0.3 = 1.35, Â < 0: loss 1.35, not 1)
    assert_close(ppo_policy_loss(log_probs.detach(), old, adv, mask, 0.2, 0.2)[1, 0], t(math.exp(0.3)))


def test_gspo_is_the_papers_sequence_objective_for_one_advantage_per_answer():
    """GSPO: J = mean_i min(s_i·Â_i, clip(s_i)·Â_i) with s_i = exp(mean_t log-ratio) and its gradient through s_i;
    the per-token form aggregated as each answer's token mean gives the same value and gradient."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 5, generator=g) * 0.1 - 1.0
    new = (old + torch.randn(4, 5, generator=g) * 0.02).requires_grad_()
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    adv_seq = t([1.5, -0.5, 0.7, -2.0])
    eps = (0.004, 0.005)  # some answers clipped, some not
    loss = aggregate_loss(gspo_policy_loss(new, old, adv_seq[:, None].expand(4, 5), mask, *eps), mask,
                          "seq_mean_token_mean", 4.0, 5)
    grad, = torch.autograd.grad(loss, new)
    ref_new = new.detach().clone().requires_grad_()
    s = torch.exp(((ref_new - old) * mask).sum(1) / mask.sum(1))
    paper = -torch.min(s * adv_seq, s.clamp(1 - eps[0], 1 + eps[1]) * adv_seq).mean()
    ref_grad, = torch.autograd.grad(paper, ref_new)
    assert_close(loss, paper)
    assert_close(grad, ref_grad)
    clipped = (s < 1 - eps[0]) | (s > 1 + eps[1])
    assert clipped.any() and not clipped.all()


# =========================================================================== CISPO


def test_cispo_clips_a_detached_weight_and_keeps_every_tokens_gradient():
    # token 0: ρ = e^0.5 = 1.65 > 1.28: the weight is clipped to 1.28; Â = 2, logπ = −1 → loss −1.28·2·(−1) = 2.56
    # token 1: ρ = e^0.1 = 1.105 (inside), Â = −1, logπ = −0.9 → loss −1.105·(−1)·(−0.9) = −0.9947
    old = t([[-1.5, -1.0]])
    log_probs = t([[-1.0, -0.9]]).requires_grad_()
    adv, mask = t([[2.0, -1.0]]), t([[1, 1]])
    per_token = cispo_policy_loss(log_probs, old, adv, mask, 0.2, 0.28)
    rho1 = math.exp(0.1)
    assert_close(per_token, t([[2.56, -rho1 * 0.9]]))
    per_token.sum().backward()
    # d/dlogπ = −w·Â with w detached: −1.28·2 = −2.56 (PPO would give 0: clipped) and −1.105·(−1) = 1.105
    # (a weight with a gradient would add −Â·ρ·logπ: −(−1)·1.105·(−0.9) = −0.99 more on token 1)
    assert_close(log_probs.grad, t([[-2.56, rho1]]))
    ppo_grad = torch.autograd.grad(ppo_policy_loss(log_probs, old, adv, mask, 0.2, 0.28).sum(), log_probs)[0]
    assert ppo_grad[0, 0] == 0  # PPO drops the clipped token's gradient; CISPO keeps it


def test_cispo_default_bounds_leave_the_weight_free_below_and_at_most_5():
    spec = POLICY_LOSSES["cispo"]
    old, mask, adv = torch.zeros(1, 3), t([[1, 1, 1]]), t([[1.0, 1.0, 1.0]])
    log_probs = t([[LN(0.01), LN(3.0), LN(50.0)]])
    per_token = cispo_policy_loss(log_probs, old, adv, mask, spec.cliprange, spec.cliprange_high)
    # weights 0.01 (no lower bound), 3 (inside), 5 (50 clipped at 1 + 4): loss = −w·logπ
    assert_close(per_token, t([[-0.01 * LN(0.01), -3 * LN(3.0), -5 * LN(50.0)]]))


# =========================================================================== aggregation and its normaliser


PER_TOKEN = t([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # 2 tokens, 1 token, an answer with none (dropped)


@pytest.mark.parametrize("mode, count, value", [
    ("token_mean", 3.0, 6 / 3),  # (1 + 2 + 3) / 3 tokens
    ("seq_mean_token_mean", 2.0, (1.5 + 3) / 2),  # answer means 1.5 and 3; the empty answer does not count
    ("seq_mean_token_sum_norm", 3.0, 6 / 4 / 3),  # token sum / horizon 4, over the 3 answers
])
def test_each_aggregation_by_hand(mode, count, value):
    assert loss_count(MASK, mode).item() == count
    assert_close(aggregate_loss(PER_TOKEN, MASK, mode, count, 4), t(value))
    assert aggregate_loss(PER_TOKEN, torch.zeros(3, 3), mode, 0.0, 4).item() == 0.0  # nothing counted: 0, no NaN


def test_the_normaliser_is_the_optimizer_steps_mean_count_per_micro_batch():
    # micro-batches with 5, 4 and 1 tokens: one step of 3 → 10 / 3 each; steps of 2 → (5 + 4) / 2 and the short
    # last run of one on its own; steps of 1: each its own (today's per-micro-batch mean)
    assert step_normalizers([5, 4, 1], 3) == pytest.approx([10 / 3] * 3)
    assert step_normalizers([5, 4, 1], 2) == pytest.approx([4.5, 4.5, 1.0])
    assert step_normalizers([5, 4, 1], 1) == [5.0, 4.0, 1.0]
    # two ranks: the other holds 1, 2 and 3 tokens (a fake all-reduce adds them): (5 + 4 + 1 + 1 + 2 + 3) / (3 · 2)
    other = torch.tensor([6.0], dtype=torch.float64)
    assert step_normalizers([5, 4, 1], 3, all_reduce=lambda sums: sums.add_(other), world_size=2) == \
        pytest.approx([16 / 6] * 3)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_a_short_last_micro_batch_does_not_weigh_its_tokens_more(mode):
    """An optimizer step of two micro-batches, 2 answers and 1 (the engine averages their losses): with the step's
    normaliser its gradient is that of one micro-batch holding all 3 answers; each micro-batch's own mean (the old
    way) weighs the lone answer's tokens twice as much."""
    g = torch.Generator().manual_seed(1)
    log_probs = torch.randn(3, 4, generator=g).requires_grad_()
    old, adv = log_probs.detach() + 0.01, torch.randn(3, 4, generator=g)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    micro = [slice(0, 2), slice(2, 3)]

    def loss_of(rows, normalizer):
        per_token = ppo_policy_loss(log_probs[rows], old[rows], adv[rows], mask[rows], 0.2, 0.2)
        return aggregate_loss(per_token, mask[rows], mode, normalizer, 4)

    whole = torch.autograd.grad(loss_of(slice(0, 3), loss_count(mask, mode).item()), log_probs)[0]
    norms = step_normalizers([loss_count(mask[m], mode).item() for m in micro], 2)
    stepped = torch.autograd.grad(sum(loss_of(m, n) for m, n in zip(micro, norms)) / 2, log_probs)[0]
    assert_close(stepped, whole)
    own = torch.autograd.grad(sum(loss_of(m, loss_count(mask[m], mode).item()) for m in micro) / 2, log_probs)[0]
    assert not torch.allclose(own, whole)


# =========================================================================== DAPO: overlong penalty, group filter


def test_overlong_penalty_by_hand():
    # cap 8, buffer 4: free up to 4 tokens, then (4 − |y|) / 4: 5 → −0.25, 6 → −0.5, 8 → −1
    assert torch.equal(overlong_penalty(torch.tensor([1, 4, 5, 6, 7, 8]), 8, 4), t([0, 0, -0.25, -0.5, -0.75, -1]))
    assert torch.equal(overlong_penalty(torch.tensor([8]), 8, 0), t([0.0]))  # 0: off
    # buffer 1: only an answer that reaches the cap (no end token within it) pays, the whole −1: a missing-EOS penalty
    assert torch.equal(overlong_penalty(torch.tensor([1, 6, 7, 8]), 8, 1), t([0, 0, 0, -1]))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([3]), 8, 9)


def test_informative_groups_have_two_valid_answers_that_score_differently():
    scores = t([1, 1, 1, 0, 0.7, 0.7, 5, 2, 9, 9])
    valid = t([1, 1, 1, 1, 1, 1, 1, 0, 0, 1])
    # groups of 2: (1, 1) equal; (1, 0) differ; (0.7, 0.7) equal; (5, dropped 2) one valid; (dropped 9, 9) one valid
    assert informative_groups(scores, 2, valid).tolist() == [False, True, False, False, False]
    assert informative_groups(scores, 2).tolist() == [False, True, False, True, False]


# =========================================================================== the specs


def test_every_spec_names_a_function_that_exists_and_defaults_resolve():
    for spec in ESTIMATORS.values():
        assert spec.critic == (spec.advantage is None)
        if spec.advantage:
            assert callable(spec.advantage_function())
        assert spec.name in estimator_table()
    for spec in POLICY_LOSSES.values():
        assert callable(spec.loss_function())
    # one place per default: the config resolves every None from the specs, and an explicit value wins
    grpo = PPOConfig(advantage_estimator="group_norm", n_samples_per_prompt=2)
    assert (grpo.advantage_estimator, grpo.use_kl_loss, grpo.kl_estimator, grpo.loss_agg) == \
        ("grpo", True, "k3", "token_mean")
    assert (grpo.cliprange, grpo.cliprange_high, grpo.title) == (0.2, 0.2, "GRPO")
    gspo = PPOConfig(advantage_estimator="dr_grpo", policy_loss="gspo")
    assert (gspo.cliprange, gspo.cliprange_high, gspo.loss_agg, gspo.title) == \
        (3e-4, 4e-4, "seq_mean_token_mean", "Dr. GRPO with GSPO's loss")
    assert PPOConfig(policy_loss="gspo", cliprange=0.1).cliprange_high == 0.1  # --cliprange alone sets both
    assert PPOConfig(cliprange_high=0.28).cliprange == 0.2
    assert PPOConfig(advantage_estimator="dr_grpo", loss_agg="token_mean").loss_agg == "token_mean"
    assert PPOConfig(generation_batches=3).dynamic_sampling_max_batches == 12
    with pytest.raises(ValueError, match="unknown policy loss"):
        PPOConfig(policy_loss="trpo")
