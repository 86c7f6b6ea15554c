"""Pure tensor math for the RLHF pipeline: masks, log-probs, PPO, reward-model and DPO losses.

Everything here is a plain function of tensors (torch only, no DeepSpeed / transformers),
so it can be unit-tested on tiny hand-made inputs.

Conventions used by every function
----------------------------------
* **Masks**: value 1 = the position counts, 0 = it is ignored. A mask may be ``bool``,
  integer or floating point; it is converted internally. Values at positions with mask 0
  never influence a result (even if they are ``inf``/``nan``), and receive zero gradient.
* **Empty masks**: a mean over a mask that sums to 0 is 0, never NaN.
* **Actions** (PPO): for a sequence ``seq`` of T tokens, action ``t`` (0 <= t < T-1) is the
  emission of token ``t+1``; per-action tensors therefore have ``A = T-1`` columns. With a
  left-padded prompt of length ``P`` the first answer action is ``t = P-1`` (``start``).
* **EOS**: the first EOS generated in an answer *is* an action (it is trained, and the
  reward-model score lands on it); every token after it is padding. This works whether
  ``pad_token_id == eos_token_id`` or not (fix of DeepSpeed-Chat #888 / #672).
"""

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
    "actor_loss",
    "critic_loss",
    "approx_kl",
    "causal_lm_loss",
    "ema_update",
    "pairwise_reward_loss",
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


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits)``, computed in float32.

    Args:
        logits: ``[B, T, V]`` (any float dtype).
        labels: ``[B, T]`` token ids. Negative ids (e.g. the ``-100`` ignore index) are
            read as id 0: the value there is meaningless and must be masked out by the caller.

    Returns:
        ``[B, T]`` float32: ``log_softmax(logits)[b, t, labels[b, t]]``.
    """
    logits = logits.float()
    index = labels.clamp(min=0).unsqueeze(-1)
    picked = logits.gather(dim=-1, index=index).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


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
    kl_ctl: float = 0.1,
    clip_reward_value: float = 5.0,
) -> torch.Tensor:
    """Per-action PPO rewards: KL penalty everywhere, clipped score on the last action.

    ``r_t = -kl_ctl * (log_probs_t - ref_log_probs_t)`` at actions with mask 1 (0 elsewhere),
    plus ``clip(reward_score, -c, c)`` at the last action with mask 1 — the EOS action if
    EOS was generated, else the final token's action (fix of DeepSpeed-Chat #672, which
    added it one position to the right). Rows with no counted action get nothing added.

    Args:
        log_probs: ``[B, A]`` log-probs of the taken actions under the (old) actor.
        ref_log_probs: ``[B, A]`` same under the reference model.
        reward_score: ``[B]`` reward-model score per sequence.
        action_mask: ``[B, A]``.
        kl_ctl: KL coefficient.
        clip_reward_value: ``c``.

    Returns:
        ``[B, A]`` rewards (dtype of ``log_probs``).
    """
    rewards = _apply_mask(-kl_ctl * (log_probs - ref_log_probs), action_mask)
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
    gamma: float = 1.0,
    lam: float = 0.95,
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


def actor_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cliprange: float = 0.2,
) -> torch.Tensor:
    """PPO clipped policy loss (computed in float32).

    ``ρ = exp((logπ − logπ_old) · m)``;
    ``L = Σ max(−Â·ρ, −Â·clip(ρ, 1−c, 1+c)) · m / Σ m`` (0 when ``Σ m == 0``).

    Args:
        log_probs: ``[B, A]`` current actor log-probs (carries the gradient).
        old_log_probs: ``[B, A]`` log-probs at experience time.
        advantages: ``[B, A]``.
        action_mask: ``[B, A]``.
        cliprange: ``c``.

    Returns:
        Scalar float32 loss.
    """
    m = _float_mask(action_mask, log_probs.float())
    log_ratio = _apply_mask(log_probs.float() - old_log_probs.float(), m)
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return masked_mean(torch.max(loss_unclipped, loss_clipped), m)


def critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    cliprange_value: float = 0.2,
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


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence KL estimate: mean over counted actions of ``logπ − logπ_ref``.

    This is the simple ``k1`` Monte-Carlo estimator of ``KL(π || π_ref)`` on the sampled
    tokens (can be negative for a single sample). 0 for rows with no counted action.

    Args:
        log_probs: ``[B, A]``.
        ref_log_probs: ``[B, A]``.
        action_mask: ``[B, A]``.

    Returns:
        ``[B]``.
    """
    return masked_mean(log_probs - ref_log_probs, action_mask, dim=1)


@torch.no_grad()
def ema_update(ema_params: Iterable[torch.Tensor], params: Iterable[torch.Tensor], beta: float = 0.992) -> None:
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


def pairwise_reward_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_ids: torch.Tensor,
    rejected_ids: torch.Tensor,
    pad_token_id: int,
    num_padding_at_beginning: int = 0,
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

    Returns:
        ``(loss, chosen_scores, rejected_scores)``: scalar float32, ``[B]``, ``[B]``.
    """
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

    positions = torch.arange(L, device=chosen_ids.device).expand(B, L)
    span = (positions >= divergence[:, None]) & (positions < end[:, None])
    per_token = -F.logsigmoid(chosen_rewards.float() - rejected_rewards.float())
    loss = masked_mean(per_token, span, dim=1).mean()

    chosen_scores = chosen_rewards.gather(1, (c_end - 1).clamp(min=0)[:, None]).squeeze(1)
    rejected_scores = rejected_rewards.gather(1, (r_end - 1).clamp(min=0)[:, None]).squeeze(1)
    return loss, chosen_scores, rejected_scores


# --------------------------------------------------------------------------- DPO


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
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
