"""Hand-computed checks of the critic-free estimators and the KL estimators (utils/rl_math.py).

Groups: ``scores [N]`` are ``N / G`` groups of ``G`` consecutive answers to one prompt; ``valid``
(1 = counts) leaves dropped answers out of their group. Every expected number is worked out in
the comment next to it.
"""
import math

import pytest
import torch
from torch.testing import assert_close

from step3_rlhf_finetuning.algorithms import ESTIMATORS
from utils.rl_math import (aggregate_loss, discounted_returns, dr_grpo_advantages, grpo_advantages, kl_estimate,
                           kl_penalized_rewards, masked_whiten, ppo_policy_loss, reinforce_advantages,
                           reinforce_baseline_advantages, rloo_advantages)

SEQUENCE_ESTIMATORS = {name: spec.advantage_function() for name, spec in ESTIMATORS.items() if not spec.critic}
GROUP_ESTIMATORS = {name: fn for name, fn in SEQUENCE_ESTIMATORS.items() if ESTIMATORS[name].group}


def t(data):
    return torch.tensor(data, dtype=torch.float32)


# =========================================================================== group estimators


def test_grpo_normalises_by_the_group_sample_std():
    # group 1: 1, 2, 3 -> mean 2, sample std sqrt(((-1)² + 0 + 1²) / 2) = 1 -> -1, 0, 1
    # group 2: 0, 0, 6 -> mean 2, centred -2, -2, 4, std sqrt((4 + 4 + 16) / 2) = sqrt(12)
    adv = grpo_advantages(t([1, 2, 3, 0, 0, 6]), 3, eps=0.0)
    s12 = math.sqrt(12)
    assert_close(adv, t([-1, 0, 1, -2 / s12, -2 / s12, 4 / s12]))
    assert_close(adv[:3], (t([1, 2, 3]) - 2) / t([1, 2, 3]).std())  # as torch.std (Bessel)


def test_equal_rewards_in_a_group_give_zero_advantage_never_nan():
    scores = t([5, 5, 5, 5, 1, 1])
    for name, estimate in GROUP_ESTIMATORS.items():
        adv = estimate(scores, 2, None)
        assert torch.isfinite(adv).all() and adv.abs().max() == 0, name
    assert torch.equal(grpo_advantages(scores, 2, eps=0.0), torch.zeros(6))  # 0 / 0 avoided even with eps 0


@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, 1e-7, -2.9])
def test_a_group_whose_scores_are_all_equal_gets_exactly_zero(value):
    # float32: 0.7 · 4 / 4 = 0.70000005, so r − mean was 6e-8 and GRPO's (r − mean) / (std + 1e-6) gave ±0.056;
    # RLOO's r − (Σ − r)/(n − 1) rounds the same way. A group with nothing to compare gets 0, bit for bit.
    scores = t([value] * 4 + [value, value, 0.0, value])  # a second group, one answer scoring differently
    valid = t([1, 1, 1, 1, 1, 1, 1, 1])
    for name, estimate in GROUP_ESTIMATORS.items():
        adv = estimate(scores, 4, valid)
        assert torch.equal(adv[:4], torch.zeros(4)), (name, adv)
        assert (adv[4:] != 0).any(), name  # the second group still compares
    # a dropped answer that scored differently does not make the group comparable
    adv = grpo_advantages(t([value, value, 5.0, value]), 4, t([1, 1, 0, 1]))
    assert torch.equal(adv, torch.zeros(4))


@pytest.mark.parametrize("estimate", [grpo_advantages, dr_grpo_advantages, rloo_advantages,
                                      reinforce_baseline_advantages])
def test_a_single_answer_group_is_refused(estimate):
    with pytest.raises(ValueError, match="at least 2 answers per prompt"):
        estimate(t([1, 2, 3]), 1)
    with pytest.raises(ValueError, match="multiple of the group size 2"):
        estimate(t([1, 2, 3]), 2)


def test_dr_grpo_only_centres():
    # 1, 2, 6 -> mean 3 -> -2, -1, 3 (no division by the std 2.65)
    assert_close(dr_grpo_advantages(t([1, 2, 6]), 3), t([-2, -1, 3]))


def test_rloo_leave_one_out_arithmetic():
    # 1, 2, 6: baselines (2 + 6)/2 = 4, (1 + 6)/2 = 3.5, (1 + 2)/2 = 1.5 -> -3, -1.5, 4.5
    # = G/(G-1) · (r - mean) = 1.5 · (-2, -1, 3)
    assert_close(rloo_advantages(t([1, 2, 6]), 3), t([-3, -1.5, 4.5]))
    # G = 2: r1 - r2 and r2 - r1
    assert_close(rloo_advantages(t([3, 1, 0, 4]), 2), t([2, -2, -4, 4]))


def test_dropped_answers_leave_their_group():
    valid = t([1, 1, 0, 1, 0, 0])
    # group 1 without its third answer (nan there never counts): 1, 2 -> grpo ±0.5 / sqrt(0.5); rloo ±1
    scores = t([1, 2, float("nan"), 7, 8, 9])
    half = 0.5 / math.sqrt(0.5)
    assert_close(grpo_advantages(scores, 3, valid, eps=0.0), t([-half, half, 0, 0, 0, 0]))
    assert_close(rloo_advantages(scores, 3, valid), t([-1, 1, 0, 0, 0, 0]))
    # group 2 has one valid answer: nothing to compare with -> 0 for everyone
    assert_close(dr_grpo_advantages(scores, 3, valid), t([-0.5, 0.5, 0, 0, 0, 0]))
    assert_close(reinforce_advantages(scores, 3, valid), t([1, 2, 0, 7, 0, 0]))


def test_reinforce_needs_no_group():
    assert_close(reinforce_advantages(t([0.5, -1.0]), 1, None), t([0.5, -1.0]))


# =========================================================================== tokens, returns, whitening


def test_critic_free_token_advantages_by_hand():
    # one answer of 3 actions (columns 1..3), score 2 placed on the last action, k1 penalty β = 0.5
    # log-ratios logπ - logπ_ref: 0.2, -0.4, 0.6 -> penalties -0.1, +0.2, -0.3
    mask = t([[0, 1, 1, 1]])
    logp, ref = t([[0, 0.2, -0.4, 0.6]]), t([[0, 0, 0, 0]])
    rewards = kl_penalized_rewards(logp, ref, t([2.0]), mask, kl_ctl=0.5, clip_reward_value=float("inf"),
                                   kl_estimator="k1")
    assert_close(rewards, t([[0, -0.1, 0.2, 1.7]]))
    # γ = 1: returns from each action to the end: 1.8, 1.9, 1.7; γ = 0.5: 1.7, 0.2 + 0.85 = 1.05, -0.1 + 0.525
    assert_close(discounted_returns(rewards, mask, 1.0), t([[0, 1.8, 1.9, 1.7]]))
    assert_close(discounted_returns(rewards, mask, 0.5), t([[0, 0.425, 1.05, 1.7]]))


def test_masked_whiten_over_counted_positions_and_across_ranks():
    x, mask = t([[9, 1, 3], [5, 99, 99]]), t([[0, 1, 1], [1, 0, 0]])
    # counted: 1, 3, 5 -> mean 3, population variance 8/3
    out = masked_whiten(x, mask, eps=0.0)
    s = math.sqrt(8 / 3)
    assert_close(out, t([[0, -2 / s, 0], [2 / s, 0, 0]]))
    # a fake second rank holding the same numbers doubles every moment: the same mean and variance
    assert_close(masked_whiten(x, mask, all_reduce=lambda m: m.mul_(2), eps=0.0), out)
    assert torch.equal(masked_whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))


def test_dr_grpo_constant_normaliser_weighs_every_token_the_same():
    # two rows of 1 and 3 tokens, advantage 1 everywhere, ratio 1: per-token loss -1
    mask = t([[1, 0, 0], [1, 1, 1]])
    zeros = torch.zeros(2, 3)
    per_token = ppo_policy_loss(zeros, zeros, torch.ones(2, 3), mask, 0.2, 0.2)
    assert_close(aggregate_loss(per_token, mask, "token_mean", 4.0, 3), t(-1.0))  # token mean: -4 / 4
    # Dr. GRPO: token sum / (rows · max answer length) = -4 / (2 · 3)
    assert_close(aggregate_loss(per_token, mask, "seq_mean_token_sum_norm", 2.0, 3), t(-4 / 6))
    with pytest.raises(ValueError, match="normalizer must be ≥ 0"):
        aggregate_loss(per_token, mask, "token_mean", -1.0, 3)


# =========================================================================== KL estimators


def test_kl_estimators_against_their_formulas():
    logp, ref = t([[math.log(0.5), math.log(0.2)]]), t([[math.log(0.25), math.log(0.4)]])
    delta = ref - logp  # log(0.5), log(2)
    assert_close(kl_estimate(logp, ref, "k1"), t([[math.log(2), -math.log(2)]]))
    assert_close(kl_estimate(logp, ref, "k2"), 0.5 * delta ** 2)
    # k3 = r - 1 - log r with r = π_ref/π: 0.5 - 1 + log 2 = 0.1931, 2 - 1 - log 2 = 0.3069
    assert_close(kl_estimate(logp, ref, "k3"), t([[0.5 - 1 + math.log(2), 1 - math.log(2)]]))
    assert (kl_estimate(logp, ref, "k3") >= 0).all() and (kl_estimate(logp, ref, "k2") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


def test_k3_is_unbiased_for_the_kl_of_two_categoricals():
    p, q = t([0.7, 0.2, 0.1]), t([0.3, 0.3, 0.4])
    exact = (p * (p / q).log()).sum()
    k3 = kl_estimate(p.log()[None], q.log()[None], "k3")[0]
    k1 = kl_estimate(p.log()[None], q.log()[None], "k1")[0]
    assert_close((p * k3).sum(), exact)  # expectation under π of each estimator = KL(π || π_ref)
    assert_close((p * k1).sum(), exact)


def test_k3_is_finite_for_extreme_log_ratios():
    out = kl_estimate(t([[0.0]]), t([[-1000.0]]), "k3")
    assert torch.isfinite(out).all() and out.item() > 0


def test_kl_loss_gradient_flows_through_the_actor_only():
    logp = t([[0.0, -1.0, -2.0]]).requires_grad_()
    ref = t([[0.0, -1.5, -2.0]])
    mask = t([[0, 1, 1]])
    loss = aggregate_loss(kl_estimate(logp, ref, "k3"), mask, "token_mean", 2.0, 3)
    # counted: δ = -0.5 and 0 -> k3 = e^-0.5 - 1 + 0.5 and 0; mean over 2
    assert_close(loss, t((math.exp(-0.5) - 0.5) / 2))
    loss.backward()
    # d k3 / d logπ = -(e^δ - 1) = 1 - e^δ; masked position: no gradient
    assert_close(logp.grad, t([[0.0, (1 - math.exp(-0.5)) / 2, 0.0]]))
