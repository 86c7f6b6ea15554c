"""Hand-computed checks of utils/rl_math.py.

Every expected number is worked out in the comments next to it, on tensors small
enough to follow by hand. Token ids used throughout: PAD = 0, EOS = 2 (or PAD = EOS = 2
for the pad == eos tokenizers such as OPT / GPT-2).
"""

import math

import pytest
import torch
from torch.testing import assert_close
import torch.nn.functional as F

from utils.rl_math import (
    aggregate_loss,
    answer_action_mask,
    approx_kl,
    causal_lm_loss,
    count_real_answer_tokens,
    critic_loss,
    dpo_loss,
    ema_update,
    gae_advantages_and_returns,
    gather_log_probs,
    kl_penalized_rewards,
    last_action_index,
    masked_mean,
    masked_sum,
    pairwise_reward_loss,
    ppo_policy_loss,
    sequence_action_mask,
    sequence_log_probs,
)

PAD, EOS = 0, 2
LN2, LN3 = math.log(2.0), math.log(3.0)


def t(data, dtype=torch.float32):
    return torch.tensor(data, dtype=dtype)


def long(data):
    return torch.tensor(data, dtype=torch.long)


# =========================================================================== masked_mean / masked_sum


X = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = [[1, 0, 1], [0, 0, 0]]


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32])
def test_masked_sum_and_mean_accept_any_mask_dtype(dtype):
    mask = torch.tensor(MASK).to(dtype)
    # all: sum = 1 + 3 = 4 over 2 counted -> mean 2
    assert_close(masked_sum(X, mask), t(4.0))
    assert_close(masked_mean(X, mask), t(2.0))
    # per row: row 0 -> 4 / 2 = 2; row 1 has nothing counted -> 0, not NaN
    assert_close(masked_sum(X, mask, dim=1), t([4.0, 0.0]))
    assert_close(masked_mean(X, mask, dim=1), t([2.0, 0.0]))
    # per column: [1/1, 0/0 -> 0, 3/1]
    assert_close(masked_mean(X, mask, dim=0), t([1.0, 0.0, 3.0]))


def test_masked_mean_eps_empty_mask_and_garbage_at_masked_positions():
    mask = long(MASK)
    assert_close(masked_mean(X, mask, eps=2.0), t(1.0))  # 4 / (2 + 2)
    assert_close(masked_mean(X, torch.zeros_like(mask)), t(0.0))  # 0 / 0 -> 0
    x = X.clone()
    x[0, 1], x[1, 0] = float("nan"), float("inf")  # both masked out
    assert_close(masked_mean(x, mask), t(2.0))
    assert_close(masked_sum(x, mask, dim=1), t([4.0, 0.0]))


# =========================================================================== gather_log_probs


def test_gather_log_probs_hand_softmax():
    # row [0, ln2, ln3] -> softmax = [1, 2, 3] / 6;  row [0, 0, 0] -> 1/3 each
    logits = t([[[0.0, LN2, LN3], [0.0, 0.0, 0.0]]])
    labels = long([[2, 1]])
    expected = t([[math.log(3 / 6), math.log(1 / 3)]])
    assert_close(gather_log_probs(logits, labels), expected)


def test_gather_log_probs_float32_and_stable():
    logits = t([[[1000.0, 0.0]]]).to(torch.bfloat16)
    out = gather_log_probs(logits.expand(1, 2, 2), long([[0, 1]]))
    assert out.dtype == torch.float32
    # log softmax([1000, 0]) = [-log(1 + e^-1000), -1000 - ...] ~= [0, -1000]
    assert_close(out, t([[0.0, -1000.0]]))


# =========================================================================== answer / sequence masks


def test_answer_action_mask_pad_not_eos():
    answers = long(
        [
            [5, 6, 2, 0, 0],  # EOS at index 2: counted, padding after it is not
            [5, 6, 7, 8, 9],  # hit the length limit: everything counts
            [2, 0, 0, 0, 0],  # empty answer: only the EOS action counts
        ]
    )
    expected = long([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert_close(answer_action_mask(answers, EOS), expected)
    assert_close(count_real_answer_tokens(answers, EOS), long([2, 5, 0]))


def test_answer_action_mask_pad_equals_eos():
    # pad == eos == 2: the first 2 is the generated EOS (kept, fix of #888), the rest is padding
    answers = long([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9], [2, 2, 2, 2, 2]])
    expected = long([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert_close(answer_action_mask(answers, EOS), expected)
    assert_close(count_real_answer_tokens(answers, EOS), long([2, 5, 0]))


@pytest.mark.parametrize("pad", [PAD, EOS], ids=["pad!=eos", "pad==eos"])
def test_sequence_masks(pad):
    P = 3
    # Left-padded prompt [pad, 7, 8] + answer. Action t emits token t+1, so with P = 3 the
    # answer actions start at t = P-1 = 2. Columns:    t=0  t=1  t=2  t=3  t=4
    #                                         emits:    7    8    a0   a1   a2
    seq = long(
        [
            [pad, 7, 8, 5, EOS, pad],  # answer "5 EOS": actions t=2 (5), t=3 (EOS)
            [pad, 7, 8, 5, 6, 9],  # no EOS: t=2..4 all count
            [pad, 7, 8, EOS, pad, pad],  # empty answer: only the EOS action t=2
        ]
    )
    expected_actions = long([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 0, 0]])
    assert_close(sequence_action_mask(seq, P, EOS), expected_actions)


def test_sequence_masks_without_answer_tokens():
    seq = long([[0, 7, 8]])  # T == P: no actions at all
    assert_close(sequence_action_mask(seq, 3, EOS), long([[0, 0]]))


def test_last_action_index():
    mask = long([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0]])
    assert_close(last_action_index(mask), long([3, 4, -1, 2]))
    assert_close(last_action_index(mask.bool()), long([3, 4, -1, 2]))
    assert_close(last_action_index(torch.zeros(2, 0)), long([-1, -1]))


# =========================================================================== kl_penalized_rewards


LOG_PROBS = t([[-1.0, -1.0, -1.0, -1.0]] * 3)
REF_LOG_PROBS = t([[-2.0, -1.0, -0.5, -1.0]] * 3)
# -0.1 * (logπ - logπ_ref) = -0.1 * [1, 0, -0.5, 0] = [-0.1, 0, 0.05, 0]


def test_kl_penalized_rewards_score_on_last_action():
    mask = long(
        [
            [0, 1, 1, 0],  # EOS emitted by action 2 -> score there
            [0, 1, 1, 1],  # length limit -> score on the final action 3
            [0, 0, 0, 0],  # nothing counted -> nothing added
        ]
    )
    score = t([10.0, -2.0, 3.0])  # 10 is clipped to 5
    expected = t(
        [
            [0.0, 0.0, 0.05 + 5.0, 0.0],  # action 0 is masked: its -0.1 is dropped
            [0.0, 0.0, 0.05, -2.0],  # 0 + (-2)
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    # DeepSpeed-Chat's constants: β 0.1, scores clipped at ±5, the k1 estimate
    assert_close(kl_penalized_rewards(LOG_PROBS, REF_LOG_PROBS, score, mask, 0.1, 5.0, "k1"), expected)


def test_kl_penalized_rewards_custom_coefficients():
    mask = torch.ones(1, 4, dtype=torch.long)
    # -0.5 * [1, 0, -0.5, 0] = [-0.5, 0, 0.25, 0]; score -3 clipped to -1 on action 3
    out = kl_penalized_rewards(
        LOG_PROBS[:1], REF_LOG_PROBS[:1], t([-3.0]), mask, kl_ctl=0.5, clip_reward_value=1.0, kl_estimator="k1"
    )
    assert_close(out, t([[-0.5, 0.0, 0.25, -1.0]]))


@pytest.mark.parametrize("pad", [PAD, EOS], ids=["pad!=eos", "pad==eos"])
def test_score_lands_on_the_eos_action_end_to_end(pad):
    # seq tokens: [pad, 7, 8, 5, EOS, pad]; EOS is token 4, emitted by action 3 (fix of #672)
    seq = long([[pad, 7, 8, 5, EOS, pad], [pad, 7, 8, 5, 6, 9]])
    mask = sequence_action_mask(seq, 3, EOS)
    zeros = torch.zeros(2, 5)
    rewards = kl_penalized_rewards(zeros, zeros, t([1.5, -0.5]), mask, 0.1, 5.0, "k1")
    # row 1 has no EOS: the score lands on the last action, t = 4 (emits the final token 9)
    assert_close(rewards, t([[0, 0, 0, 1.5, 0], [0, 0, 0, 0, -0.5]]))


# =========================================================================== GAE


def test_gae_gamma1_lam_half_with_start():
    values = t([[9.0, 1.0, 0.5, 0.2]])  # position 0 is before start: ignored
    rewards = t([[7.0, 0.1, 0.3, 1.0]])
    mask = torch.ones(1, 4)
    adv, ret = gae_advantages_and_returns(values, rewards, mask, gamma=1.0, lam=0.5, start=1)
    # t=3 (last): δ_3 = 1.0 + 0 - 0.2 = 0.8;             Â_3 = 0.8
    # t=2:        δ_2 = 0.3 + 1.0*0.2 - 0.5 = 0.0;       Â_2 = 0.0 + 0.5*0.8 = 0.4
    # t=1:        δ_1 = 0.1 + 1.0*0.5 - 1.0 = -0.4;      Â_1 = -0.4 + 0.5*0.4 = -0.2
    assert_close(adv, t([[-0.2, 0.4, 0.8]]))
    # G = Â + V = [-0.2 + 1.0, 0.4 + 0.5, 0.8 + 0.2]
    assert_close(ret, t([[0.8, 0.9, 1.0]]))


def test_gae_masked_tail_is_terminal():
    # Same trajectory followed by one padding position with a big value and reward:
    # nothing may leak back into the last real action (t=2).
    values = t([[1.0, 0.5, 0.2, 7.0]])
    rewards = t([[0.1, 0.3, 1.0, 4.0]])
    mask = long([[1, 1, 1, 0]])
    adv, ret = gae_advantages_and_returns(values, rewards, mask, gamma=1.0, lam=0.5)
    # t=3: masked -> Â_3 = 0, G_3 = V_3 = 7
    # t=2: m_3 = 0 -> δ_2 = 1.0 + 0 - 0.2 = 0.8;  Â_2 = 0.8   (not 1.0 + 7.0 - 0.2)
    # t=1: δ_1 = 0.3 + 0.2 - 0.5 = 0.0;           Â_1 = 0.0 + 0.5*0.8 = 0.4
    # t=0: δ_0 = 0.1 + 0.5 - 1.0 = -0.4;          Â_0 = -0.4 + 0.5*0.4 = -0.2
    assert_close(adv, t([[-0.2, 0.4, 0.8, 0.0]]))
    assert_close(ret, t([[0.8, 0.9, 1.0, 7.0]]))


def test_gae_discount_lam1_gives_monte_carlo_returns_and_is_detached():
    values = t([[1.0, 2.0], [0.0, 0.0]]).requires_grad_()
    rewards = t([[1.0, 4.0], [1.0, 1.0]])
    mask = torch.ones(2, 2)
    adv, ret = gae_advantages_and_returns(values, rewards, mask, gamma=0.5, lam=1.0)
    # row 0: t=1: δ_1 = 4 - 2 = 2, Â_1 = 2
    #        t=0: δ_0 = 1 + 0.5*2 - 1 = 1, Â_0 = 1 + 0.5*1*2 = 2
    #        G = [2 + 1, 2 + 2] = [3, 4] = [r_0 + γ r_1, r_1]
    # row 1: V = 0 -> G = Â = [1 + 0.5*1, 1] = [1.5, 1]
    assert_close(adv, t([[2.0, 2.0], [1.5, 1.0]]))
    assert_close(ret, t([[3.0, 4.0], [1.5, 1.0]]))
    assert not adv.requires_grad and not ret.requires_grad


# =========================================================================== actor loss (PPO's surrogate, token mean)


def actor_loss(log_probs, old, advantages, mask, cliprange=0.2):
    """DeepSpeed-Chat's actor loss: the clipped surrogate's mean over the counted tokens."""
    per_token = ppo_policy_loss(log_probs, old, advantages, mask, cliprange, cliprange)
    return aggregate_loss(per_token, mask, "token_mean", float(mask.sum()), 1)


def test_actor_loss_clipping_active_and_inactive():
    old = torch.zeros(2, 3)
    log_probs = t([[math.log(1.5), math.log(0.9), 5.0], [math.log(0.5), 0.0, 0.0]])
    advantages = t([[1.0, -2.0, 100.0], [-2.0, 0.0, 0.0]])
    mask = long([[1, 1, 0], [1, 0, 0]])
    # (0,0) ρ=1.5, Â=1:  max(-1.5, -1*clip(1.5)=-1.2) = -1.2   (clip active: no extra credit)
    # (0,1) ρ=0.9, Â=-2: max(1.8, 2*0.9=1.8) = 1.8             (inside the clip range)
    # (0,2) masked (ρ = exp(5*0) = 1, ignored)
    # (1,0) ρ=0.5, Â=-2: max(1.0, 2*clip(0.5)=2*0.8=1.6) = 1.6  (clip active: pessimistic)
    # L = (-1.2 + 1.8 + 1.6) / 3
    assert_close(actor_loss(log_probs, old, advantages, mask), t(2.2 / 3))


def test_actor_loss_gradient_flows_and_masked_positions_get_none():
    old = torch.zeros(1, 4)
    log_probs = t([[0.0, 0.0, math.log(1.5), 50.0]]).requires_grad_()
    advantages = t([[1.0, 2.0, 1.0, 3.0]])
    mask = long([[1, 1, 1, 0]])
    loss = actor_loss(log_probs, old, advantages, mask)
    # L = (-1*1 - 2*1 - 1*1.2) / 3 = -4.2 / 3 = -1.4
    assert_close(loss, t(-1.4))
    loss.backward()
    # ρ = 1 -> dL/dlogπ = -Â ρ / Σm = [-1/3, -2/3]; the clipped position and the masked one get 0
    assert_close(log_probs.grad, t([[-1 / 3, -2 / 3, 0.0, 0.0]]))


def test_actor_loss_empty_mask_is_zero_with_finite_gradient():
    log_probs = torch.zeros(2, 3, requires_grad=True)
    loss = actor_loss(log_probs, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert_close(loss, t(0.0))
    loss.backward()
    assert_close(log_probs.grad, torch.zeros(2, 3))


# =========================================================================== critic loss


def test_critic_loss_clipping_active_and_inactive():
    values = t([[1.0, 1.0, 1.0, 100.0]]).to(torch.bfloat16)
    old_values = t([[0.5, 0.9, 0.5, 0.0]])
    returns = t([[2.0, 0.0, 0.0, 0.0]])
    mask = long([[1, 1, 1, 0]])
    # pos 0: V_clip = clip(1.0, 0.3, 0.7) = 0.7; max((1-2)^2 = 1, (0.7-2)^2 = 1.69) = 1.69   (clip raises loss)
    # pos 1: V_clip = clip(1.0, 0.7, 1.1) = 1.0; max(1, 1) = 1                              (inactive)
    # pos 2: V_clip = 0.7;                       max((1-0)^2 = 1, 0.7^2 = 0.49) = 1           (clip ignored)
    # pos 3: masked
    # L = 0.5 * (1.69 + 1 + 1) / 3 = 0.615
    loss = critic_loss(values, old_values, returns, mask, 0.2)
    assert loss.dtype == torch.float32
    assert_close(loss, t(0.615))


def test_critic_loss_empty_mask_and_gradient():
    values = t([[1.0, 3.0]]).requires_grad_()
    assert_close(critic_loss(values, values.detach(), torch.zeros(1, 2), torch.zeros(1, 2), 0.2), t(0.0))
    loss = critic_loss(values, values.detach(), torch.zeros(1, 2), long([[1, 0]]), 0.2)
    # L = 0.5 * 1^2 / 1 = 0.5; dL/dV_0 = (V_0 - G_0) = 1, masked V_1 gets 0
    assert_close(loss, t(0.5))
    loss.backward()
    assert_close(values.grad, t([[1.0, 0.0]]))


# =========================================================================== approx_kl


def test_approx_kl_per_sequence():
    log_probs = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = t([[-1.5, -2.0, -2.0], [0.0, 0.0, 0.0]])
    mask = long([[1, 1, 0], [0, 0, 0]])
    # row 0: diffs [0.5, 0, (-1 masked)] -> 0.25; row 1: nothing counted -> 0
    assert_close(approx_kl(log_probs, ref, mask, "k1"), t([0.25, 0.0]))


# =========================================================================== ema_update


def test_ema_update_arithmetic():
    ema = [t([1.0, 2.0]), t([[10.0]])]
    params = [torch.nn.Parameter(t([3.0, 2.0])), torch.nn.Parameter(t([[0.0]]))]
    ema_update(ema, params, beta=0.75)
    # 0.75*1 + 0.25*3 = 1.5; 0.75*2 + 0.25*2 = 2; 0.75*10 + 0 = 7.5
    assert_close(ema[0], t([1.5, 2.0]))
    assert_close(ema[1], t([[7.5]]))
    ema_update(ema, params, beta=0.992)  # 0.992*1.5 + 0.008*3 = 1.512
    assert_close(ema[0], t([1.512, 2.0]))
    assert_close(params[0].detach(), t([3.0, 2.0]))  # source untouched


def test_ema_update_on_modules_and_length_mismatch():
    ema_model, model = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        for p in ema_model.parameters():
            p.fill_(1.0)
        for p in model.parameters():
            p.fill_(0.0)
    ema_update(ema_model.parameters(), model.parameters(), beta=0.5)
    assert_close(ema_model.weight.detach(), torch.full((1, 2), 0.5))  # 0.5*1 + 0.5*0
    with pytest.raises(ValueError):
        ema_update([t([1.0])], [t([1.0]), t([2.0])], beta=0.5)


# =========================================================================== pairwise reward loss


def _reference_pairwise_loss(chosen_rewards, rejected_rewards, chosen_ids, rejected_ids, pad, npab):
    """Literal per-pair loop of the specification (with the empty-span guard)."""
    L = chosen_ids.shape[1]
    losses, c_scores, r_scores = [], [], []
    for rc, rr, ci, ri in zip(chosen_rewards, rejected_rewards, chosen_ids, rejected_ids):
        c_pads = (ci == pad).nonzero().flatten().tolist()
        c = c_pads[npab] if len(c_pads) > npab else L
        diff = (ci != ri).nonzero().flatten().tolist()
        if not diff:
            end, d, r_end = L, L - 1, c
        else:
            r_pads = (ri == pad).nonzero().flatten().tolist()
            r_end = r_pads[npab] if len(r_pads) > npab else L
            end, d = max(c, r_end), diff[0]
        end = max(end, 1)
        d = min(d, end - 1)
        losses.append(-torch.nn.functional.logsigmoid(rc[d:end] - rr[d:end]).mean())
        c_scores.append(rc[max(c - 1, 0)])
        r_scores.append(rr[max(r_end - 1, 0)])
    return torch.stack(losses).mean(), torch.stack(c_scores), torch.stack(r_scores)


# Case "different lengths": chosen ends at c = 3, rejected at r_end = 4, they diverge at d = 2,
# so the loss covers t in [2, max(3, 4)) = [2, 4). Rewards outside the span are wild on purpose.
DIFF_LEN = dict(
    chosen_ids=[5, 6, 7, 0, 0],
    rejected_ids=[5, 6, 8, 9, 0],
    chosen_rewards=[3.0, -3.0, 0.5 + LN3, 1.0, -9.0],
    rejected_rewards=[0.0, 0.0, 0.5, 1.0, 9.0],
)
# span diffs r^c - r^r = [ln3, 0] -> -logσ(ln3) = -log(3/4) = log(4/3);  -logσ(0) = log 2
DIFF_LEN_LOSS = (math.log(4 / 3) + LN2) / 2
DIFF_LEN_SCORES = (0.5 + LN3, 1.0)  # r^c[c-1] = r^c[2],  r^r[r_end-1] = r^r[3]

# Case "no padding in chosen": c = L = 5, rejected r_end = 3, d = 2 -> span [2, 5)
NO_PAD = dict(
    chosen_ids=[5, 6, 7, 8, 9],
    rejected_ids=[5, 6, 1, 0, 0],
    chosen_rewards=[9.0, 9.0, 1.0, LN3, 0.0],
    rejected_rewards=[0.0, 0.0, 1.0, 0.0, LN3],
)
# span diffs [0, ln3, -ln3] -> [log 2, log(4/3), -log(1/4) = log 4]
NO_PAD_LOSS = (LN2 + math.log(4 / 3) + math.log(4.0)) / 3
NO_PAD_SCORES = (0.0, 1.0)  # r^c[4], r^r[2]


def _pairwise(*cases, pad=PAD, npab=0):
    def stack(key, dtype):
        return torch.tensor([case[key] for case in cases], dtype=dtype)

    args = (
        stack("chosen_rewards", torch.float32),
        stack("rejected_rewards", torch.float32),
        stack("chosen_ids", torch.long),
        stack("rejected_ids", torch.long),
        pad,
        npab,
    )
    return pairwise_reward_loss(*args), _reference_pairwise_loss(*args)


@pytest.mark.parametrize(
    "case, loss, scores", [(DIFF_LEN, DIFF_LEN_LOSS, DIFF_LEN_SCORES), (NO_PAD, NO_PAD_LOSS, NO_PAD_SCORES)]
)
def test_pairwise_single_pair(case, loss, scores):
    (got_loss, got_c, got_r), reference = _pairwise(case)
    assert_close(got_loss, t(loss))
    assert_close(got_c, t([scores[0]]))
    assert_close(got_r, t([scores[1]]))
    assert_close((got_loss, got_c, got_r), reference)


def test_pairwise_batch_is_mean_over_pairs():
    (loss, c_scores, r_scores), _ = _pairwise(DIFF_LEN, NO_PAD)
    assert_close(loss, t((DIFF_LEN_LOSS + NO_PAD_LOSS) / 2))
    assert_close(c_scores, t([DIFF_LEN_SCORES[0], NO_PAD_SCORES[0]]))
    assert_close(r_scores, t([DIFF_LEN_SCORES[1], NO_PAD_SCORES[1]]))


def test_pairwise_identical_pair_uses_last_position_only():
    identical = dict(
        chosen_ids=[5, 6, 7, 0, 0],
        rejected_ids=[5, 6, 7, 0, 0],
        chosen_rewards=[9.0, 9.0, 0.25, 9.0, LN3],
        rejected_rewards=[0.0, 0.0, 0.75, 0.0, 0.0],
    )
    (loss, c_score, r_score), reference = _pairwise(identical)
    # end = L = 5, d = L-1 = 4: loss = -logσ(ln3 - 0) = log(4/3)
    assert_close(loss, t(math.log(4 / 3)))
    # r_end = c = 3: both scores at index 2
    assert_close((c_score, r_score), (t([0.25]), t([0.75])))
    assert_close((loss, c_score, r_score), reference)


def test_pairwise_opt_style_leading_bos_equal_to_pad():
    # OPT: BOS = pad = eos = 2 at position 0. With num_padding_at_beginning = 1 the first
    # pad-id token is skipped: chosen pad positions [0, 3, 4] -> c = 3; rejected [0, 4] -> r_end = 4.
    opt = dict(
        chosen_ids=[2, 5, 6, 2, 2],
        rejected_ids=[2, 5, 7, 8, 2],
        chosen_rewards=[9.0, 9.0, LN3, 0.0, 9.0],
        rejected_rewards=[0.0, 0.0, 0.0, 0.0, -9.0],
    )
    (loss, c_score, r_score), reference = _pairwise(opt, pad=2, npab=1)
    # d = 2, span [2, 4): diffs [ln3, 0] -> (log(4/3) + log 2) / 2; scores r^c[2], r^r[3]
    assert_close(loss, t((math.log(4 / 3) + LN2) / 2))
    assert_close((c_score, r_score), (t([LN3]), t([0.0])))
    assert_close((loss, c_score, r_score), reference)


def test_pairwise_empty_span_guard_gives_finite_loss():
    # Both end at index 1 but only differ at index 4 (after the end): [4, 1) would be empty.
    # Guard: d = min(4, 1 - 1) = 0 -> span [0, 1), diff r^c_0 - r^r_0 = 0 -> log 2.
    odd = dict(
        chosen_ids=[5, 0, 0, 0, 3],
        rejected_ids=[5, 0, 0, 0, 4],
        chosen_rewards=[1.0, 2.0, 3.0, 4.0, 5.0],
        rejected_rewards=[1.0, 0.0, 0.0, 0.0, 0.0],
    )
    (loss, _, _), reference = _pairwise(odd)
    assert_close(loss, t(LN2))
    assert_close(loss, reference[0])


def test_pairwise_matches_literal_loop_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    for npab in (0, 1):
        ids_c = torch.randint(0, 3, (64, 6), generator=gen)  # vocab {0 = pad, 1, 2}: many ties
        other = torch.randint(0, 3, (64, 6), generator=gen)
        ids_r = torch.where(torch.rand(64, 6, generator=gen) < 0.5, ids_c, other)
        rc, rr = torch.randn(64, 6, generator=gen), torch.randn(64, 6, generator=gen)
        got = pairwise_reward_loss(rc, rr, ids_c, ids_r, PAD, npab)
        assert torch.isfinite(got[0])
        assert_close(got, _reference_pairwise_loss(rc, rr, ids_c, ids_r, PAD, npab))


# =========================================================================== sequence_log_probs


def test_sequence_log_probs_shift():
    # logits at t predict token t+1:  t=0: softmax [1,2,3]/6;  t=1: uniform 1/3;  t=2 unused
    logits = t([[[0.0, LN2, LN3], [0.0, 0.0, 0.0], [50.0, 0.0, 0.0]]]).expand(2, 3, 3)
    labels = long([[-100, 1, 2], [0, 1, 2]])  # label 0 is never used (no logit predicts it)
    loss_mask = long([[0, 1, 1], [1, 0, 1]])  # marks *label* positions
    # row 0: log p(label1=1 | t=0) + log p(label2=2 | t=1) = log(2/6) + log(1/3) = log(1/9)
    # row 1: label 1 masked -> log(1/3) only
    assert_close(sequence_log_probs(logits, labels, loss_mask), t([math.log(1 / 9), math.log(1 / 3)]))


# =========================================================================== DPO


def _dpo_inputs():
    # pair 0: z = 0.5 * ((-1 - -3) - (-2 - -2)) = 0.5 * 2 = 1
    # pair 1: everything equal -> z = 0
    pc = t([-1.0, -2.0]).requires_grad_()
    pr = t([-3.0, -2.0])
    return pc, pr, t([-2.0, -2.0]), t([-2.0, -2.0])


def test_dpo_loss_without_label_smoothing():
    pc, pr, rc, rr = _dpo_inputs()
    loss, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.0)
    # -logσ(1) = log(1 + e^-1);  -logσ(0) = log 2
    assert_close(loss, t((math.log(1 + math.exp(-1)) + LN2) / 2))
    # β(π_c - ref_c) = 0.5 * [1, 0];  β(π_r - ref_r) = 0.5 * [-1, 0]
    assert_close(chosen_rewards, t([0.5, 0.0]))
    assert_close(rejected_rewards, t([-0.5, 0.0]))
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad
    loss.backward()
    # d/dπ_c of mean(-logσ(β Δ)) = -β σ(-z) / B = -0.5 * [σ(-1), 0.5] / 2
    sig = 1 / (1 + math.e)
    assert_close(pc.grad, t([-0.25 * sig, -0.125]))


def test_dpo_loss_with_label_smoothing():
    pc, pr, rc, rr = _dpo_inputs()
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    # pair 0: 0.9 * log(1 + e^-1) + 0.1 * log(1 + e^1);  pair 1: 0.9 log 2 + 0.1 log 2 = log 2
    pair0 = 0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.exp(1))
    assert_close(loss, t((pair0 + LN2) / 2))


def test_causal_lm_loss_by_hand_skips_minus_100_and_shifts_labels():
    # V = 2; position t predicts labels[t + 1]; the last position predicts nothing
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]]])
    labels = torch.tensor([[-100, 1, 0]])
    # -log softmax: position 0 -> label 1 with p = 1/2, position 1 -> label 0 with p = 3/4
    assert causal_lm_loss(logits, labels).item() == pytest.approx((math.log(2.0) + math.log(4.0 / 3.0)) / 2)
    assert causal_lm_loss(logits, torch.tensor([[-100, -100, 0]])).item() == pytest.approx(math.log(4.0 / 3.0))


def test_causal_lm_loss_upcasts_bf16_logits_like_transformers():
    """DeepSpeed-Chat's step 1 takes transformers 5's loss, which upcasts the logits: ours is fp32 too.

    A loss computed in bf16 is rounded to a bf16 number (0.0625 apart near 10): here 0.05 off."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 16, 1000) * 3).bfloat16()
    labels = torch.randint(0, 1000, (2, 16))
    exact = F.cross_entropy(logits[:, :-1].float().reshape(-1, 1000), labels[:, 1:].reshape(-1))
    loss = causal_lm_loss(logits, labels)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(exact.item(), abs=1e-5)
    rounded = F.cross_entropy(logits[:, :-1].reshape(-1, 1000), labels[:, 1:].reshape(-1))  # the old bf16 result
    assert rounded.dtype == torch.bfloat16 and abs(rounded.float().item() - exact.item()) > 1e-3


def test_one_word_answer_counts_one_token_whatever_the_pad_id():
    """Deliberate difference: DeepSpeed-Chat counts non-pad tokens, so with Llama (pad 0 ≠ EOS 2) it counts the
    EOS and keeps a one-word answer (2 > 1); here the count stops before the EOS for every tokenizer (1: dropped),
    as the reference's count comes out for OPT (pad = EOS)."""
    llama_style = torch.tensor([[7, 2, 0, 0], [7, 8, 2, 0]])
    assert count_real_answer_tokens(llama_style, eos_token_id=2).tolist() == [1, 2]
    assert (llama_style != 0).sum(-1).tolist() == [2, 3]  # the reference's count


def test_answers_end_at_the_first_of_several_end_tokens():
    """With --add_eot_token an answer ends at the EOT (9) or at the model's own EOS (2), whichever comes first:
    masks and counts stop there, where generation stopped and where the reward model reads its score."""
    answers = torch.tensor([[3, 2, 8, 9], [3, 4, 9, 0], [3, 4, 5, 6]])
    assert answer_action_mask(answers, (9, 2)).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert count_real_answer_tokens(answers, (9, 2)).tolist() == [1, 2, 4]
    assert answer_action_mask(answers, 9).tolist()[0] == [1, 1, 1, 1]  # the EOT alone missed row 0's EOS
    seq = torch.cat([torch.tensor([[5, 6]] * 3), answers], dim=1)
    assert sequence_action_mask(seq, 2, (9, 2)).tolist()[0] == [0, 1, 1, 0, 0]
