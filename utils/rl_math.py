"""Pure tensor math for the RLHF pipeline: masks, log-probs, GAE, the policy losses (PPO, GSPO, CISPO), their
aggregation and diagnostics (ratio, clip fractions, token entropy), critic-free advantage estimators (GRPO, Dr.
GRPO, RLOO, REINFORCE++ and its baseline variant), DAPO's overlong penalty and group filter, KL estimators,
reward-model and DPO losses.

Everything here is a plain function of tensors (torch only, no DeepSpeed / transformers),
so it can be unit-tested on tiny hand-made inputs.

Conventions used by every function
----------------------------------
* **Masks**: value 1 = the position counts, 0 = it is ignored. A mask may be ``bool``,
  integer or floating point; it is converted internally. Values at positions with mask 0
  never influence a result (even if they are ``inf``/``nan``), and receive zero gradient.
* **Empty masks**: a mean over a mask that sums to 0 is 0, never NaN.
* **No defaults for the RL knobs** (clip ranges, β, γ, λ, KL estimator, aggregation …): the caller passes each; the
  one place of every default is step 3's configuration (``step3_rlhf_finetuning/config.py`` and the specs of
  ``step3_rlhf_finetuning/algorithms.py``).
* **Actions** (PPO): for a sequence ``seq`` of T tokens, action ``t`` (0 <= t < T-1) is the
  emission of token ``t+1``; per-action tensors therefore have ``A = T-1`` columns. With a
  left-padded prompt of length ``P`` the first answer action is ``t = P-1`` (``start``).
* **EOS**: the first EOS generated in an answer *is* an action (it is trained, and the
  reward-model score lands on it); every token after it is padding. This works whether
  ``pad_token_id == eos_token_id`` or not (fix of DeepSpeed-Chat #888 / #672).
"""

import math
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

Dim = Optional[Union[int, Sequence[int]]]

__all__ = [
    "masked_mean",
    "masked_sum",
    "gather_log_probs",
    "answer_action_mask",
    "count_real_answer_tokens",
    "sequence_action_mask",
    "last_action_index",
    "kl_penalized_rewards",
    "gae_advantages_and_returns",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "policy_ratio",
    "ratio_clip_sums",
    "token_entropy",
    "loss_count",
    "aggregate_loss",
    "step_normalizers",
    "critic_loss",
    "approx_kl",
    "kl_estimate",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "reinforce_baseline_advantages",
    "reinforce_advantages",
    "informative_groups",
    "overlong_penalty",
    "KL_ESTIMATORS",
    "discounted_returns",
    "masked_whiten",
    "causal_lm_loss",
    "ema_update",
    "pairwise_reward_loss",
    "pairwise_read_window",
    "end_score_reward_loss",
    "sequence_log_probs",
    "dpo_loss",
]


# --------------------------------------------------------------------------- masks / means


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Mask as a floating tensor broadcast to ``like``'s shape (dtype of ``like`` if it is floating)."""
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return torch.broadcast_to(mask.to(dtype=dtype, device=like.device), like.shape)


def _apply_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x * mask`` where masked-out entries are exactly 0 even if ``x`` is inf/nan there."""
    m = _float_mask(mask, x)
    return torch.where(m != 0, x, torch.zeros_like(x)) * m


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Sum of ``x * mask``.

    Args:
        x: any shape ``[...]``.
        mask: same shape as ``x`` (or broadcastable to it); 1 = counts, 0 = ignored.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``x`` reduced over ``dim`` (scalar when ``dim is None``).
    """
    masked = _apply_mask(x, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, eps: float = 0.0) -> torch.Tensor:
    """``sum(x * mask) / (sum(mask) + eps)`` over ``dim``; 0 (not NaN) where the mask sums to 0.

    Args:
        x: any shape ``[...]``.
        mask: same shape as ``x`` (or broadcastable to it); 1 = counts, 0 = ignored.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.
        eps: added to the denominator.

    Returns:
        ``x`` reduced over ``dim`` (scalar when ``dim is None``).
    """
    m = _float_mask(mask, x)
    num = masked_sum(x, m, dim)
    den = (m.sum() if dim is None else m.sum(dim=dim)) + eps
    # Where the denominator is 0 the numerator is 0 as well, so dividing by 1 gives 0.
    return num / torch.where(den == 0, torch.ones_like(den), den)


# --------------------------------------------------------------------------- log-probs


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     chunk_rows: int = 8) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``, computed in float32.

    ``log p = x[label] − logsumexp(x)`` with ``x = logits / temperature`` in float32: no ``log_softmax`` over
    the vocabulary is kept. Without gradients (``torch.no_grad`` or logits that need none) the rows are taken
    ``chunk_rows`` at a time, so the float32 copy (bf16 logits) and the temperature's copy exist for one chunk
    only; with gradients the whole tensor is taken at once (a chunked autograd graph would allocate a
    full-size gradient per chunk), and fp32 logits at temperature 1 are used as they are, without a copy.

    Args:
        logits: ``[..., T, V]`` (any float dtype; the leading dimensions are rows).
        labels: ``[..., T]`` token ids. Negative ids (e.g. the ``-100`` ignore index) are
            read as id 0: the value there is meaningless and must be masked out by the caller.
        temperature: the logits are divided by it (1: as they are).
        chunk_rows: rows (leading index) per chunk when no gradient is recorded.

    Returns:
        ``[..., T]`` float32: ``log_softmax(logits / temperature)[..., t, labels[..., t]]``.
    """
    index = labels.clamp(min=0).unsqueeze(-1)

    def one(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if temperature != 1.0:
            x = x / temperature
        return x.gather(dim=-1, index=idx).squeeze(-1) - torch.logsumexp(x, dim=-1)

    if (torch.is_grad_enabled() and logits.requires_grad) or logits.dim() < 3 or logits.shape[0] <= chunk_rows:
        return one(logits, index)
    return torch.cat([one(logits[i:i + chunk_rows], index[i:i + chunk_rows])
                      for i in range(0, logits.shape[0], chunk_rows)], dim=0)


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Total log-probability of the counted tokens of each sequence (used by DPO).

    The model's logits at position ``t`` predict token ``t+1``, so this sums
    ``gather_log_probs(logits[:, :-1], labels[:, 1:]) * loss_mask[:, 1:]`` over time.
    ``loss_mask`` is indexed like ``labels``: it marks the *label* positions that count
    (typically the answer tokens, including its EOS), not the logit positions.

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]`` token ids (usually the input ids).
        loss_mask: ``[B, T]``, 1 where ``labels[:, t]`` is a token whose probability counts.

    Returns:
        ``[B]`` float32 sums of log-probabilities.
    """
    token_logps = gather_log_probs(logits[:, :-1], labels[:, 1:])
    return masked_sum(token_logps, loss_mask[:, 1:], dim=1)


# --------------------------------------------------------------------------- action masks


EndIds = Union[int, Sequence[int]]  # the token (or tokens: any of them) that ends an answer


def _is_end(ids: torch.Tensor, end_ids: EndIds) -> torch.Tensor:
    """``ids == end`` for one end id, ``ids ∈ end_ids`` for several; same shape as ``ids``."""
    if isinstance(end_ids, int):
        return ids == end_ids
    return torch.isin(ids, torch.as_tensor(list(end_ids), device=ids.device))


def answer_action_mask(answer_ids: torch.Tensor, eos_token_id: EndIds) -> torch.Tensor:
    """Mask of the real generated tokens: everything up to and including the first EOS.

    Tokens after the first EOS are padding (whatever their id, so ``pad == eos`` and
    ``pad != eos`` behave the same). A row without EOS (hit the length limit) is all 1.

    Args:
        answer_ids: ``[B, A]`` generated tokens after the prompt.
        eos_token_id: the end-of-sequence id, or several ids (the first of any ends the answer).

    Returns:
        ``[B, A]`` long mask.
    """
    is_eos = _is_end(answer_ids, eos_token_id).long()
    eos_strictly_before = torch.cumsum(is_eos, dim=1) - is_eos
    return (eos_strictly_before == 0).long()


def count_real_answer_tokens(answer_ids: torch.Tensor, eos_token_id: EndIds) -> torch.Tensor:
    """Number of tokens strictly before the first EOS (0 means an empty answer).

    Args:
        answer_ids: ``[B, A]`` generated tokens after the prompt.
        eos_token_id: the end-of-sequence id, or several ids (the first of any ends the answer).

    Returns:
        ``[B]`` long counts.
    """
    no_eos_yet = torch.cumsum(_is_end(answer_ids, eos_token_id).long(), dim=1) == 0
    return no_eos_yet.long().sum(dim=1)


def sequence_action_mask(seq: torch.Tensor, prompt_length: int, eos_token_id: EndIds) -> torch.Tensor:
    """Action mask of prompt+answer sequences: 1 for the answer's actions (EOS included).

    Action ``t`` emits token ``t+1``. Prompt tokens are not actions, so ``t < P-1`` is 0;
    for ``t >= P-1`` the mask is ``answer_action_mask(seq[:, P:])[:, t-(P-1)]``: the
    answer's end is found from the EOS alone (pad may equal EOS).

    Args:
        seq: ``[B, T]`` left-padded prompt of length ``P = prompt_length`` followed by the answer.
        prompt_length: ``P``.
        eos_token_id: EOS id, or several ids.

    Returns:
        ``[B, T-1]`` long mask.
    """
    B, T = seq.shape
    mask = torch.zeros(B, max(T - 1, 0), dtype=torch.long, device=seq.device)
    if T > prompt_length:
        mask[:, prompt_length - 1 :] = answer_action_mask(seq[:, prompt_length:], eos_token_id)
    return mask


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last counted position in each row.

    Args:
        action_mask: ``[B, A]``.

    Returns:
        ``[B]`` long; -1 for rows with no counted position.
    """
    B, A = action_mask.shape
    if A == 0:
        return torch.full((B,), -1, dtype=torch.long, device=action_mask.device)
    positions = torch.arange(A, device=action_mask.device).expand(B, A)
    minus_one = torch.full_like(positions, -1)
    return torch.where(action_mask != 0, positions, minus_one).max(dim=1).values


# --------------------------------------------------------------------------- PPO


def kl_penalized_rewards(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    reward_score: torch.Tensor,
    action_mask: torch.Tensor,
    kl_ctl: float,
    clip_reward_value: float,
    kl_estimator: str,
) -> torch.Tensor:
    """Per-action rewards: KL penalty everywhere, clipped score on the last action.

    ``r_t = -kl_ctl * k_t`` at actions with mask 1 (0 elsewhere), ``k_t`` the per-token KL
    estimate (:func:`kl_estimate`; ``k1 = log_probs_t - ref_log_probs_t``, DeepSpeed-Chat's),
    plus ``clip(reward_score, -c, c)`` at the last action with mask 1 — the EOS action if
    EOS was generated, else the final token's action (DeepSpeed-Chat #672: with a separate pad token,
    Llama-style, the reference adds it one position to the right of the EOS action; for OPT it lands
    where it does here). Rows with no counted action get nothing added.

    Args:
        log_probs: ``[B, A]`` log-probs of the taken actions under the (old) actor.
        ref_log_probs: ``[B, A]`` same under the reference model.
        reward_score: ``[B]`` reward-model score per sequence.
        action_mask: ``[B, A]``.
        kl_ctl: KL coefficient (0: no penalty).
        clip_reward_value: ``c`` (``inf``: no clipping).
        kl_estimator: ``k1``, ``k2`` or ``k3``.

    Returns:
        ``[B, A]`` rewards (dtype of ``log_probs``).
    """
    kl = kl_estimate(log_probs, ref_log_probs, kl_estimator).to(log_probs.dtype)
    rewards = _apply_mask(-kl_ctl * kl, action_mask)
    last = last_action_index(action_mask)
    has_action = last >= 0
    score = reward_score.to(rewards.dtype).clamp(-clip_reward_value, clip_reward_value)
    bonus = torch.zeros_like(rewards)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    bonus[rows[has_action], last[has_action]] = score[has_action]
    return rewards + bonus


def gae_advantages_and_returns(
    values: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lam: float,
    start: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over positions ``start .. A-1`` (no whitening).

    Going backward from ``t = A-1`` to ``start``, with ``m`` the action mask::

        m_A = 0,  V_A = 0,  Â_A = 0                  (past the end is terminal)
        δ_t = r_t + γ · m_{t+1} · V_{t+1} − V_t
        Â_t = (δ_t + γ · λ · m_{t+1} · Â_{t+1}) · m_t
        G_t = Â_t + V_t

    So a position whose successor is masked (e.g. the EOS action followed by padding) is
    terminal: no value and no advantage leak back from padding. Positions with ``m_t = 0``
    get ``Â_t = 0`` and hence ``G_t = V_t`` (they are ignored by the losses anyway). With an
    all-ones mask this is exactly the reference recursion.

    Args:
        values: ``[B, A]`` critic values of the states before each action.
        rewards: ``[B, A]`` per-action rewards (e.g. from :func:`kl_penalized_rewards`).
        action_mask: ``[B, A]``.
        gamma: discount ``γ``.
        lam: GAE ``λ``.
        start: first position to compute (``P-1`` for a prompt of length ``P``).

    Returns:
        ``(advantages, returns)``, each ``[B, A-start]``, detached.
    """
    values = values.detach()
    rewards = rewards.detach()
    m = _float_mask(action_mask, values)
    A = values.shape[1]
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    next_mask = torch.zeros_like(values[:, 0])
    advantages = []
    for t in reversed(range(start, A)):
        delta = rewards[:, t] + gamma * next_mask * next_value - values[:, t]
        adv = (delta + gamma * lam * next_mask * next_adv) * m[:, t]
        advantages.append(adv)
        next_value, next_adv, next_mask = values[:, t], adv, m[:, t]
    if advantages:
        adv_tensor = torch.stack(advantages[::-1], dim=1)
    else:
        adv_tensor = values[:, start:].new_zeros(values.shape[0], 0)
    returns = adv_tensor + values[:, start:]
    return adv_tensor.detach(), returns.detach()


def _clip_bounds(clip_low: float, clip_high: float) -> Tuple[float, float]:
    return 1.0 - clip_low, 1.0 + clip_high


def ppo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                    action_mask: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """PPO's clipped surrogate per token (float32; ``--policy_loss ppo``, DeepSpeed-Chat's).

    ``ρ_t = exp(logπ_t − logπ_old,t)``, ``ℓ_t = max(−Â_t·ρ_t, −Â_t·clip(ρ_t, 1 − ε_low, 1 + ε_high))``. With
    ``clip_high > clip_low`` it is DAPO's clip-higher. A clipped token gets no gradient.

    Args:
        log_probs: ``[B, A]`` current actor log-probs (carries the gradient).
        old_log_probs: ``[B, A]`` log-probs at experience time.
        advantages: ``[B, A]``.
        action_mask: ``[B, A]`` (1 = counts).
        clip_low: ``ε_low``.
        clip_high: ``ε_high``.

    Returns:
        ``[B, A]`` float32 per-token losses, exactly 0 where the mask is 0 (:func:`aggregate_loss` makes the scalar).
    """
    m = _float_mask(action_mask, log_probs.float())
    ratio = torch.exp(_apply_mask(log_probs.float() - old_log_probs.float(), m))
    return _surrogate(ratio, advantages.float(), m, clip_low, clip_high)


def _surrogate(ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, clip_low: float, clip_high: float):
    low, high = _clip_bounds(clip_low, clip_high)
    return _apply_mask(torch.max(-adv * ratio, -adv * torch.clamp(ratio, low, high)), m)


def gspo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                     action_mask: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """GSPO's sequence-level clipped surrogate per token (Zheng et al. 2025; ``--policy_loss gspo``).

    The ratio of answer i is its sequence ratio ``s_i = exp(mean over its counted tokens of logπ − logπ_old)``,
    clipped at the sequence level: ``ℓ_t = max(−Â_t·s_i,t, −Â_t·clip(s_i,t, 1 − ε_low, 1 + ε_high))`` with GSPO-token's
    ``s_i,t = sg(s_i)·π_t / sg(π_t)``: equal to ``s_i`` in value (one clipping decision per answer), its gradient
    ``s_i·∇logπ_t``. With one advantage per answer and each answer's token mean (``seq_mean_token_mean``) this is
    GSPO's objective and gradient exactly; per-token advantages (a KL penalty in the reward) reach their own token.

    Arguments and result as :func:`ppo_policy_loss`.
    """
    lp = log_probs.float()
    m = _float_mask(action_mask, lp)
    seq_log_ratio = masked_mean(_apply_mask(lp - old_log_probs.float(), m), m, dim=1)  # [B]
    log_ratio = seq_log_ratio.detach()[:, None] + (lp - lp.detach())
    ratio = torch.exp(_apply_mask(log_ratio, m))
    return _surrogate(ratio, advantages.float(), m, clip_low, clip_high)


def cispo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      action_mask: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """CISPO per token (MiniMax-M1, 2025; ``--policy_loss cispo``):
    ``ℓ_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high))·Â_t·logπ_t``.

    The importance weight is clipped and detached, so every token keeps a gradient (``−w_t·Â_t·∇logπ_t``), unlike
    PPO's surrogate, which drops the gradient of a clipped token. The loss's value is on the log-prob's scale, not a
    surrogate's.

    Arguments and result as :func:`ppo_policy_loss`.
    """
    lp = log_probs.float()
    m = _float_mask(action_mask, lp)
    low, high = _clip_bounds(clip_low, clip_high)
    weight = torch.clamp(torch.exp(_apply_mask(lp - old_log_probs.float(), m)), low, high).detach()
    return _apply_mask(-weight * advantages.float() * lp, m)


# --------------------------------------------------------------------------- policy diagnostics (logged, no gradient)


def policy_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, action_mask: torch.Tensor,
                 sequence_level: bool = False) -> torch.Tensor:
    """The ratio a policy loss clips, detached: ``ρ_t = exp(logπ_t − logπ_old,t)`` per token (``ppo``, ``cispo``), or,
    with ``sequence_level`` (``gspo``), the answer's ``s_i = exp(mean over its counted tokens of logπ − logπ_old)`` on
    each of its tokens.

    Args:
        log_probs, old_log_probs: ``[B, A]`` current and experience-time log-probs.
        action_mask: ``[B, A]`` (1 = counts).
        sequence_level: the answer's ratio instead of the token's.

    Returns:
        ``[B, A]`` float32, 1 where the mask is 0 (an answer without a counted token: 1 on every column).
    """
    with torch.no_grad():
        lp = log_probs.detach().float()
        m = _float_mask(action_mask, lp)
        log_ratio = _apply_mask(lp - old_log_probs.detach().float(), m)
        if sequence_level:
            log_ratio = masked_mean(log_ratio, m, dim=1)[:, None].expand_as(lp)
        return torch.exp(_apply_mask(log_ratio, m))


def ratio_clip_sums(ratio: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor, clip_low: float,
                    clip_high: float) -> dict:
    """Sums over the counted tokens of one micro-batch, to be added over micro-batches and ranks and then divided by
    ``tokens`` (TRL's ``clip_ratio/low_mean`` and ``high_mean``; verl's and OpenRLHF's clip fraction is their sum):

    * ``tokens``: the counted tokens, ``Σ mask``;
    * ``clip_low``: tokens whose clip at the lower bound is active, ``ρ_t < 1 − ε_low`` with ``Â_t < 0`` (there
      PPO's clipped term is the larger one: the token gets no gradient; CISPO's weight stops at ``1 − ε_low``);
    * ``clip_high``: likewise at the upper bound, ``ρ_t > 1 + ε_high`` with ``Â_t > 0``;
    * ``ratio_sum``: ``Σ ρ_t``; ``ratio_max``: the largest ``ρ_t`` (0 without a counted token).

    Args:
        ratio: ``[B, A]`` (:func:`policy_ratio`).
        advantages: ``[B, A]``.
        action_mask: ``[B, A]`` (1 = counts).
        clip_low, clip_high: ``ε_low``, ``ε_high``.

    Returns:
        ``{name: 0-d float64 tensor}`` with the five names above.
    """
    with torch.no_grad():
        r, adv = ratio.detach().double(), advantages.detach().double()
        m = _float_mask(action_mask, r)
        counted = m != 0
        low, high = _clip_bounds(clip_low, clip_high)
        r = torch.where(counted, r, torch.ones_like(r))  # masked-out values (inf, nan) never count
        adv = torch.where(counted, adv, torch.zeros_like(adv))
        return {"tokens": m.sum(),
                "clip_low": (counted & (r < low) & (adv < 0)).double().sum(),
                "clip_high": (counted & (r > high) & (adv > 0)).double().sum(),
                "ratio_sum": masked_sum(r, m),
                "ratio_max": torch.where(counted, r, torch.zeros_like(r)).max() if r.numel() else r.new_zeros(())}


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 8) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position, detached, in float32:
    ``H = logsumexp(x) − Σ_v softmax(x)_v·x_v`` with ``x = logits / temperature``.

    Read from logits a forward pass computed anyway (no pass of its own); the rows are taken ``chunk_rows`` at a
    time, so the float32 copy of the logits exists for one chunk only.

    Args:
        logits: ``[..., T, V]`` (any float dtype; the leading dimensions are rows).
        temperature: the logits are divided by it (the distribution answers are sampled from).
        chunk_rows: rows (leading index) per chunk.

    Returns:
        ``[..., T]`` float32 entropies in nats (0 for a one-hot distribution, ``log V`` for the uniform one).
    """
    def one(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float()
        if temperature != 1.0:
            x = x / temperature
        return torch.logsumexp(x, dim=-1) - (torch.softmax(x, dim=-1) * x).sum(dim=-1)

    with torch.no_grad():
        if logits.dim() < 3 or logits.shape[0] <= chunk_rows:
            return one(logits)
        return torch.cat([one(logits[i:i + chunk_rows]) for i in range(0, logits.shape[0], chunk_rows)], dim=0)


def loss_count(action_mask: torch.Tensor, loss_agg: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`aggregate_loss` divides by, counted on one micro-batch: its counted tokens (``token_mean``), its
    answers with a counted token (``seq_mean_token_mean``) or its answers (``seq_mean_token_sum_norm``).

    Dr. GRPO's count is of answers, not of their tokens, so an answer whose tokens are all masked out still counts
    (an answer cut at the length cap under ``--mask_truncated_answers``, as TRL counts it); the rows that are not
    answers at all (``valid`` 0: dropped answers, ``--dynamic_sampling``'s filler rows) do not.

    Args:
        action_mask: ``[B, A]`` (1 = counts).
        loss_agg: ``token_mean``, ``seq_mean_token_mean`` or ``seq_mean_token_sum_norm``.
        valid: ``[B]`` (1 = an answer that counts; None: every row) — read by ``seq_mean_token_sum_norm`` only.

    Returns:
        Scalar float32.
    """
    m = action_mask.float()
    if loss_agg == "token_mean":
        return m.sum()
    if loss_agg == "seq_mean_token_mean":
        return (m.sum(dim=1) > 0).float().sum()
    if loss_agg == "seq_mean_token_sum_norm":
        if valid is None:
            return torch.tensor(float(m.shape[0]))
        return (valid.reshape(-1) != 0).float().sum()
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")


def aggregate_loss(per_token: torch.Tensor, action_mask: torch.Tensor, loss_agg: str, normalizer: float,
                   horizon: int) -> torch.Tensor:
    """A micro-batch's share of the optimizer step's loss: its sum divided by ``normalizer``.

    * ``token_mean``: ``Σ ℓ·m / normalizer`` (normalizer: counted tokens);
    * ``seq_mean_token_mean``: ``Σ_i (Σ_t ℓ·m / Σ_t m) / normalizer`` (answers with a counted token);
    * ``seq_mean_token_sum_norm``: ``Σ ℓ·m / (normalizer · horizon)`` (answers; Dr. GRPO's constant ``horizon``,
      the longest answer allowed).

    ``normalizer`` is :func:`loss_count` of this micro-batch for its own mean, or the mean count per micro-batch of
    the whole optimizer step (:func:`step_normalizers`), so that every token (answer) of the step weighs the same
    however the micro-batches are filled. 0 gives 0.

    Args:
        per_token: ``[B, A]`` per-token losses (e.g. :func:`ppo_policy_loss`, β·:func:`kl_estimate`).
        action_mask: ``[B, A]`` (1 = counts).
        loss_agg: as :func:`loss_count`.
        normalizer: ≥ 0.
        horizon: the constant of ``seq_mean_token_sum_norm`` (``--max_answer_seq_len``).

    Returns:
        Scalar float32.
    """
    m = _float_mask(action_mask, per_token.float())
    x = _apply_mask(per_token.float(), m)
    if normalizer < 0:
        raise ValueError(f"normalizer must be ≥ 0, got {normalizer}")
    if loss_agg == "token_mean":
        total = x.sum()
    elif loss_agg == "seq_mean_token_mean":
        total = masked_mean(x, m, dim=1).sum()
    elif loss_agg == "seq_mean_token_sum_norm":
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        total = x.sum() / horizon
    else:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}")
    return total / normalizer if normalizer > 0 else total * 0.0


def step_normalizers(counts: Sequence[float], per_step: int, all_reduce=None, world_size: int = 1) -> list:
    """The normalizer of each micro-batch: the mean :func:`loss_count` per micro-batch over its optimizer step.

    Micro-batches ``0 … per_step − 1`` make the first optimizer step, and so on (a shorter last run of them, their
    own: step 3 passes whole optimizer steps only, :class:`step3_rlhf_finetuning.ppo_trainer.WholeSteps`). Summed
    over the step's micro-batches and over the ranks (``all_reduce``, an in-place sum such as
    ``torch.distributed.all_reduce``, with ``world_size`` ranks), divided by the micro-batches of the step on every
    rank: each micro-batch's ``sum / normalizer``, averaged by the engine over the step's micro-batches and ranks, is
    the step's sum over its whole count. A short micro-batch (the last of a round) weighs its tokens like the others.

    Args:
        counts: this rank's count of each micro-batch, in training order.
        per_step: micro-batches per optimizer step (``--gradient_accumulation_steps``).
        all_reduce: None (one rank) or an in-place sum over the ranks (every rank has as many micro-batches).
        world_size: ranks.

    Returns:
        A list of floats, one per micro-batch.
    """
    if per_step < 1:
        raise ValueError(f"per_step must be ≥ 1, got {per_step}")
    spans = [(i, min(i + per_step, len(counts))) for i in range(0, len(counts), per_step)]
    sums = torch.tensor([float(sum(counts[a:b])) for a, b in spans], dtype=torch.float64)
    if all_reduce is not None and len(spans):
        all_reduce(sums)
    out = []
    for (a, b), total in zip(spans, sums.tolist()):
        out += [total / ((b - a) * world_size)] * (b - a)
    return out


def critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    cliprange_value: float,
) -> torch.Tensor:
    """PPO clipped value loss (computed in float32).

    ``V_clip = clip(V, V_old − c, V_old + c)``;
    ``L = ½ · Σ max((V − G)², (V_clip − G)²) · m / Σ m`` (0 when ``Σ m == 0``).

    Args:
        values: ``[B, A]`` current critic values (carries the gradient).
        old_values: ``[B, A]`` values at experience time.
        returns: ``[B, A]`` GAE returns ``G``.
        action_mask: ``[B, A]``.
        cliprange_value: ``c``.

    Returns:
        Scalar float32 loss.
    """
    v = values.float()
    v_old = old_values.float()
    g = returns.float()
    v_clipped = torch.max(torch.min(v, v_old + cliprange_value), v_old - cliprange_value)
    loss = torch.max((v - g) ** 2, (v_clipped - g) ** 2)
    return 0.5 * masked_mean(loss, action_mask)


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, action_mask: torch.Tensor,
              estimator: str) -> torch.Tensor:
    """Per-sequence KL estimate: mean over counted actions of :func:`kl_estimate`.

    ``k1`` (``logπ − logπ_ref``) can be negative for a single sample; step 3 logs
    ``k3``, which is unbiased and never negative. 0 for rows with no counted action.

    Args:
        log_probs: ``[B, A]``.
        ref_log_probs: ``[B, A]``.
        action_mask: ``[B, A]``.
        estimator: ``k1``, ``k2`` or ``k3``.

    Returns:
        ``[B]``.
    """
    return masked_mean(kl_estimate(log_probs, ref_log_probs, estimator), action_mask, dim=1)


# --------------------------------------------------------------------------- KL estimators

KL_ESTIMATORS = ("k1", "k2", "k3")
_MAX_LOG_RATIO = 20.0  # k3 exponentiates the log-ratio: bounded so that an outlier token cannot give inf


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token Monte-Carlo estimate of ``KL(π || π_ref)`` on tokens sampled from ``π`` (J. Schulman,
    "Approximating KL divergence", 2020), in float32. With ``δ = logπ_ref − logπ``:

    * ``k1 = −δ`` (unbiased; negative on tokens the reference likes better, so a batch mean can be < 0);
    * ``k2 = ½·δ²`` (biased, ≥ 0, low variance; its gradient is that of the reverse-KL's);
    * ``k3 = (e^δ − 1) − δ`` (unbiased and ≥ 0; GRPO's; ``δ`` is clamped to ±20 first).

    Args:
        log_probs: ``[B, A]`` log-probs of the sampled tokens under ``π`` (may carry a gradient).
        ref_log_probs: ``[B, A]`` the same tokens under ``π_ref``.
        estimator: ``k1``, ``k2`` or ``k3``.

    Returns:
        ``[B, A]`` float32; values at masked-out positions are meaningless (mask them).
    """
    delta = ref_log_probs.float() - log_probs.float()
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta ** 2
    if estimator == "k3":
        delta = delta.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.expm1(delta) - delta
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


# --------------------------------------------------------------------------- critic-free estimators
#
# The answers of one prompt form a group: ``scores [N]`` holds ``N / G`` groups of ``G`` consecutive
# answers (rows ``g·G … g·G + G − 1`` answer the same prompt). ``valid [N]`` (1 = counts) leaves out
# dropped answers: they take no part in their group's statistics and get advantage 0. A group with
# fewer than two valid answers, or whose valid answers all have the same score, has nothing to compare
# and gets exactly 0 everywhere (not the float32 round-off of ``r − mean``: four scores of 0.7 have a
# float32 mean 6e-8 off, which GRPO's division by a std of the same size turned into ±0.056). Each
# function maps the answers' scores to one number per answer (the same for every token of the answer:
# outcome rewards).


def _grouped(scores: torch.Tensor, valid: Optional[torch.Tensor], group_size: int, minimum: int = 2):
    """``(scores [N/G, G] float32, valid [N/G, G] float32, valid count per group [N/G, 1])``."""
    if group_size < minimum:
        raise ValueError(f"a group estimator needs at least {minimum} answers per prompt, got group size "
                         f"{group_size}")
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"scores must be [N] with N a multiple of the group size {group_size}, "
                         f"got shape {tuple(scores.shape)}")
    x = scores.float().reshape(-1, group_size)
    v = torch.ones_like(x) if valid is None else valid.to(device=x.device, dtype=torch.float32).reshape(-1, group_size)
    x = torch.where(v != 0, x, torch.zeros_like(x))  # an invalid member's score (even nan) never counts
    return x, v, v.sum(dim=1, keepdim=True)


def _group_mean(x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return (x * v).sum(dim=1, keepdim=True) / n.clamp(min=1)


def _comparable(x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``[N/G, 1]`` float: 1 for a group with two or more valid answers whose scores are not all equal."""
    valid = v != 0
    high = torch.where(valid, x, torch.full_like(x, -math.inf)).max(dim=1, keepdim=True).values
    low = torch.where(valid, x, torch.full_like(x, math.inf)).min(dim=1, keepdim=True).values
    return ((n >= 2) & (high > low)).float()


def _centered(scores, valid, group_size) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(r − group mean [N/G, G], valid count per group [N/G, 1])``; exactly 0 where it does not count and in a
    group with nothing to compare."""
    x, v, n = _grouped(scores, valid, group_size)
    return (x - _group_mean(x, v, n)) * v * _comparable(x, v, n), n


def informative_groups(scores: torch.Tensor, group_size: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which groups a group estimator can learn from (DAPO's dynamic sampling keeps these): two or more valid answers
    whose scores are not all equal. The others get advantage 0 from every group estimator.

    Args:
        scores: ``[N]`` one score per answer, ``N / group_size`` groups of consecutive answers.
        group_size: ``G ≥ 2``.
        valid: ``[N]`` (1 = counts) or None (all count).

    Returns:
        ``[N / G]`` bool.
    """
    x, v, n = _grouped(scores, valid, group_size)
    return _comparable(x, v, n).reshape(-1) != 0


def grpo_advantages(scores: torch.Tensor, group_size: int, valid: Optional[torch.Tensor] = None,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeekMath; OpenRLHF's ``group_norm``): ``A_i = (r_i − mean_g) / (std_g + eps)``.

    ``std_g`` is the sample standard deviation (Bessel's ``n − 1``, as ``torch.std``) of the group's
    valid scores. A group whose scores are all equal gets advantage exactly 0, never NaN.

    Args:
        scores: ``[N]`` one score per answer, ``N / group_size`` groups of consecutive answers.
        group_size: ``G ≥ 2``.
        valid: ``[N]`` (1 = counts) or None (all count).
        eps: added to the standard deviation.

    Returns:
        ``[N]`` float32 advantages.
    """
    centered, n = _centered(scores, valid, group_size)
    std = ((centered ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    scale = torch.where(std + eps > 0, std + eps, torch.ones_like(std))  # std 0: every centred score is 0 too
    return (centered / scale).reshape(-1)


def dr_grpo_advantages(scores: torch.Tensor, group_size: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dr. GRPO ("Understanding R1-Zero-like training", Liu et al. 2025): ``A_i = r_i − mean_g``.

    No division by the group's standard deviation (which up-weights groups that are almost all right or
    all wrong); the other half of the fix, a constant loss normaliser instead of each answer's length,
    is :func:`aggregate_loss`'s ``seq_mean_token_sum_norm``. Arguments and result as :func:`grpo_advantages`.
    """
    return _centered(scores, valid, group_size)[0].reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): ``A_i = r_i − mean of the other valid answers' scores``
    ``= r_i − (Σ_g − r_i) / (n_g − 1) = n_g / (n_g − 1) · (r_i − mean_g)``. Arguments and result as
    :func:`grpo_advantages`."""
    x, v, n = _grouped(scores, valid, group_size)
    others = ((x * v).sum(dim=1, keepdim=True) - x) / (n - 1).clamp(min=1)
    return ((x - others) * v * _comparable(x, v, n)).reshape(-1)


def reinforce_baseline_advantages(scores: torch.Tensor, group_size: int,
                                  valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025), its per-answer part: ``r_i − mean_g``. The trainer then puts it on
    the answer's last token with the KL penalties (:func:`kl_penalized_rewards`), sums the returns
    (:func:`discounted_returns`) and whitens them over the whole batch, all ranks (:func:`masked_whiten`).
    Arguments and result as :func:`grpo_advantages`."""
    return dr_grpo_advantages(scores, group_size, valid)


def reinforce_advantages(scores: torch.Tensor, group_size: int,
                         valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025), its per-answer part: the score itself (no baseline; any group size, 1
    included). As :func:`reinforce_baseline_advantages`, the trainer then adds the KL penalties, sums the
    discounted returns and whitens them over the whole batch. Returns ``[N]`` float32 (0 where not valid)."""
    x = scores.float()
    return x if valid is None else torch.where(valid != 0, x, torch.zeros_like(x))


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to an answer's score: 0 up to ``max_length − buffer`` tokens, then
    ``(max_length − buffer − |y|) / buffer``, falling linearly to −1 at ``max_length`` (−1 beyond).

    Args:
        lengths: ``[B]`` answer lengths ``|y|`` in tokens (the end token included).
        max_length: ``L_max``, the longest answer (``--max_answer_seq_len``).
        buffer: ``L_cache`` (``--overlong_penalty``), 0 < buffer ≤ max_length; 0 gives no penalty.

    Returns:
        ``[B]`` float32 in [−1, 0].
    """
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be in 0 … {max_length}, got {buffer}")
    excess = lengths.float() - (max_length - buffer)
    return torch.where(excess > 0, (-excess / buffer).clamp(min=-1.0), torch.zeros_like(excess))


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = Σ_{k ≥ t} γ^(k−t) · r_k`` over the counted actions of each row (0 where the mask is 0).

    The critic-free advantage of a token: with the outcome score on the last action and KL penalties
    on every action (:func:`kl_penalized_rewards`), ``G_t`` is the score (discounted) plus the penalties
    still to come. It is :func:`gae_advantages_and_returns` with zero values and ``λ = 1``.

    Args:
        rewards: ``[B, A]`` per-action rewards.
        action_mask: ``[B, A]``.
        gamma: discount ``γ``.

    Returns:
        ``[B, A]`` float returns, detached.
    """
    returns, _ = gae_advantages_and_returns(torch.zeros_like(rewards), rewards, action_mask, gamma, 1.0, 0)
    return returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce=None, eps: float = 1e-8) -> torch.Tensor:
    """``(x − mean) / sqrt(var + eps)`` over the counted positions (0 elsewhere); REINFORCE++'s global
    normalisation of the advantages.

    Mean and variance are taken over every counted position of ``x`` — and of the other ranks' when
    ``all_reduce`` (a function that sums a tensor over the ranks in place, e.g.
    ``torch.distributed.all_reduce``) is given. No counted position anywhere: zeros.

    Args:
        x: ``[B, A]``.
        mask: ``[B, A]`` (1 = counts).
        all_reduce: None (this tensor only) or an in-place sum over ranks.
        eps: added to the variance.

    Returns:
        ``[B, A]`` float32.
    """
    x = x.float()
    m = _float_mask(mask, x)
    moments = torch.stack([masked_sum(x, m), masked_sum(x * x, m), m.sum()]).double()
    if all_reduce is not None:
        all_reduce(moments)
    total, total_sq, count = moments.tolist()
    if count == 0:
        return torch.zeros_like(x)
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    return _apply_mask((x - mean) / math.sqrt(var + eps), m)


@torch.no_grad()
def ema_update(ema_params: Iterable[torch.Tensor], params: Iterable[torch.Tensor], beta: float) -> None:
    """In place ``θ_ema ← β·θ_ema + (1−β)·θ`` for paired tensors (no gradient is recorded).

    Args:
        ema_params: tensors (e.g. ``ema_model.parameters()``) updated in place.
        params: tensors of the same shapes, in the same order.
        beta: ``β``.

    Raises:
        ValueError: if the two iterables have different lengths.
    """
    for ema_p, p in zip(ema_params, params, strict=True):
        ema_p.mul_(beta).add_(p.detach().to(device=ema_p.device, dtype=ema_p.dtype), alpha=1.0 - beta)


# --------------------------------------------------------------------------- reward model


def _index_of_nth(is_hit: torch.Tensor, n: int, default: int) -> torch.Tensor:
    """``[B]`` position of the ``n``-th (0-based) True in each row of ``is_hit [B, L]``, else ``default``."""
    B, L = is_hit.shape
    occurrence = torch.cumsum(is_hit.long(), dim=1)
    hit = is_hit & (occurrence == n + 1)
    positions = torch.arange(L, device=is_hit.device).expand(B, L)
    return torch.where(hit, positions, torch.full_like(positions, default)).min(dim=1).values


def _pair_indices(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, pad_token_id: int,
                  num_padding_at_beginning: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c_end, r_end, divergence, end)``, each ``[B]``: :func:`pairwise_reward_loss`'s indices (its docstring),
    with its rules for identical pairs and its guards applied."""
    B, L = chosen_ids.shape
    npab = num_padding_at_beginning
    c_end = _index_of_nth(chosen_ids == pad_token_id, npab, L)
    r_end = _index_of_nth(rejected_ids == pad_token_id, npab, L)
    differs = chosen_ids != rejected_ids
    identical = ~differs.any(dim=1)
    divergence = _index_of_nth(differs, 0, L)

    full = torch.full_like(c_end, L)
    end = torch.where(identical, full, torch.max(c_end, r_end))
    divergence = torch.where(identical, full - 1, divergence)
    r_end = torch.where(identical, c_end, r_end)

    end = end.clamp(min=1)
    divergence = torch.min(divergence, end - 1)
    return c_end, r_end, divergence, end


def pairwise_read_window(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, pad_token_id: int,
                         num_padding_at_beginning: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``([B], [B])``: for each pair, the columns ``first … stop − 1`` whose values :func:`pairwise_reward_loss` reads
    (its span and both end scores; the span runs into the shorter answer's padding). No other column's value
    reaches the loss or the scores.

    Args and conventions as :func:`pairwise_reward_loss`.
    """
    c_end, r_end, divergence, end = _pair_indices(chosen_ids, rejected_ids, pad_token_id, num_padding_at_beginning)
    c_score, r_score = (c_end - 1).clamp(min=0), (r_end - 1).clamp(min=0)
    first = torch.min(torch.min(divergence, c_score), r_score)
    stop = torch.max(torch.max(end, c_score + 1), r_score + 1)
    return first, stop


def pairwise_reward_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_ids: torch.Tensor,
    rejected_ids: torch.Tensor,
    pad_token_id: int,
    num_padding_at_beginning: int = 0,
    per_pair: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpeed-Chat pairwise ranking loss on per-token rewards.

    For each pair ``i`` (``npab = num_padding_at_beginning``):

    * ``c`` = index of the pad-id token number ``npab`` (0-based) in chosen, else ``L``
      (with ``npab = 1`` an OPT leading BOS that equals pad is skipped);
    * ``d`` = first index where chosen and rejected differ;
    * identical pair: ``end = L``, ``d = L−1``, ``r_end = c``;
      otherwise: ``r_end`` = same rule on rejected, ``end = max(c, r_end)``;
    * guards for degenerate inputs: ``end = max(end, 1)``, ``d = min(d, end−1)`` so the
      span ``[d, end)`` is never empty;
    * ``loss_i = mean_{t in [d, end)} −logσ(r^c_t − r^r_t)``; ``loss = mean_i loss_i``.

    Scores: chosen ``r^c[c−1]``, rejected ``r^r[r_end−1]`` (index clamped at 0).

    Args:
        chosen_rewards: ``[B, L]`` per-token rewards of the chosen sequences.
        rejected_rewards: ``[B, L]`` per-token rewards of the rejected sequences.
        chosen_ids: ``[B, L]`` token ids (right-padded with ``pad_token_id``).
        rejected_ids: ``[B, L]``.
        pad_token_id: pad id.
        num_padding_at_beginning: leading pad-id tokens to skip (1 for OPT, else 0).
        per_pair: return the ``[B]`` losses ``loss_i`` instead of their mean (step 2's ``--kwise`` weights them
            by prompt, :func:`utils.model.reward_model.kwise_loss`).

    Returns:
        ``(loss, chosen_scores, rejected_scores)``: scalar float32 (``[B]`` with ``per_pair``), ``[B]``, ``[B]``.
    """
    B, L = chosen_ids.shape
    c_end, r_end, divergence, end = _pair_indices(chosen_ids, rejected_ids, pad_token_id, num_padding_at_beginning)

    positions = torch.arange(L, device=chosen_ids.device).expand(B, L)
    span = (positions >= divergence[:, None]) & (positions < end[:, None])
    per_token = -F.logsigmoid(chosen_rewards.float() - rejected_rewards.float())
    loss = masked_mean(per_token, span, dim=1)
    loss = loss if per_pair else loss.mean()

    chosen_scores = chosen_rewards.gather(1, (c_end - 1).clamp(min=0)[:, None]).squeeze(1)
    rejected_scores = rejected_rewards.gather(1, (r_end - 1).clamp(min=0)[:, None]).squeeze(1)
    return loss, chosen_scores, rejected_scores


def end_score_reward_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """InstructGPT's (and OpenRLHF's) pairwise loss on the end scores alone: ``mean_i −logσ(c_i − r_i)``.

    :func:`pairwise_reward_loss` (DeepSpeed-Chat's) averages the comparison over every token from where
    the two answers diverge; for answers drawn independently of each other that is mostly tokens whose
    values the end score never reads. Step 2's ``--reward_loss end`` uses this one.

    Args:
        chosen_scores: ``[B]`` end scores of the chosen sequences.
        rejected_scores: ``[B]``.

    Returns:
        Scalar float32.
    """
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float()).mean()


# --------------------------------------------------------------------------- DPO


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct Preference Optimisation loss (sigmoid form, optional label smoothing).

    ``z = β·((π_c − π_r) − (ref_c − ref_r))``;
    ``loss = mean(−logσ(z)·(1−ls) − logσ(−z)·ls)``.

    Args:
        policy_chosen_logps: ``[B]`` sequence log-probs (see :func:`sequence_log_probs`).
        policy_rejected_logps: ``[B]``.
        ref_chosen_logps: ``[B]`` same under the frozen reference model.
        ref_rejected_logps: ``[B]``.
        beta: ``β``.
        label_smoothing: ``ls`` (conservative DPO), 0 for plain DPO.

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)``: scalar, ``[B]`` ``β(π_c − ref_c)`` and
        ``[B]`` ``β(π_r − ref_r)``, the two reward tensors detached.
    """
    logits = beta * ((policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps))
    losses = -F.logsigmoid(logits) * (1.0 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    chosen_rewards = (beta * (policy_chosen_logps - ref_chosen_logps)).detach()
    rejected_rewards = (beta * (policy_rejected_logps - ref_rejected_logps)).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32, mean over label positions that are not -100.

    logits [B, T, V] of any dtype, upcast first as transformers 5's own loss does (a bf16
    loss is rounded to a bf16 number: ~0.4 % off); labels [B, T] (unshifted: position t
    predicts labels[t+1]). Returns an fp32 scalar.
    """
    logits = logits[:, :-1, :].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)
