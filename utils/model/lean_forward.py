"""Log-probabilities of answers under a causal LM, computing only what is read.

Step 3 (and DPO) needs ``log π(answer token | everything before it)`` for the answer tokens alone. The plain
way (one forward over ``prompt + answer``, the LM head at every position, a log-softmax over the whole
``[B, T, V]`` logits) spends most of its LM-head work on prompt positions nobody reads, and with
``--n_samples_per_prompt G`` it runs every prompt G times through the model. Here:

* **Logits only where they are read**: the LM head runs on the answer positions alone
  (transformers' ``logits_to_keep``), and the last token's position, which predicts nothing, is not fed.
* **One prompt pass per group** (:func:`answer_log_probs` with ``share_prompt``): consecutive rows with the
  same prompt (the G answers to one prompt, or DPO's chosen and rejected after their shared prefix) run the
  prompt once with a KV cache; the cache is repeated for the rows and the answers run on it. The answers'
  attention, positions and gradients are those of the plain pass (the prompt's keys and values carry the
  gradient back into the prompt pass), so the results agree up to float rounding (tests/test_lean_forward.py).
* **Position ids from the attention mask** (``cumsum(mask) − 1``, pads at 0), as ``generate`` numbers the
  tokens it samples: how much left padding a batch carries changes nothing.
* **Log-softmax without a float32 copy of the whole logits** (:func:`utils.rl_math.gather_log_probs`).
* **The LM head at the label positions alone** (step 1's :func:`label_loss`, DPO's plain pass): each row's counted
  positions are handed to transformers' ``logits_to_keep`` as a ``[B, K]`` tensor, K the most any row counts, so
  neither the prompts nor the padding between rows' answers reach the vocabulary-wide logits and their float32 copy.
  On a GPU (:func:`keeps_label_positions`); a CPU keeps the window from the first label to the last, bit for bit
  the numbers its results were measured with.
* **Few shapes on a GPU** (:func:`shape_multiple`): where a pass is cut to the columns it reads, the cut is rounded
  up to a multiple of 64 there, which keeps the collator's round-up (a new shape costs a GPU ~0.2 s); on a CPU,
  where every column costs compute, nothing is rounded.
* **By device, where one pass beats the shared prefix** (:func:`shares_prefix`): DPO's and the reward model's pairs
  run their shared prefix once on a CPU (fewer FLOPs: measured faster) and as one concatenated pass on a GPU
  (half the passes: a small model's step there is bound by kernel launches, not FLOPs).

The shared pass needs a model whose ``forward`` takes ``position_ids``, ``logits_to_keep`` and a KV cache
(every transformers 5 causal LM), and no activation checkpointing (transformers turns the cache off under
it); otherwise the plain pass runs, still with logits at the answer positions only where ``logits_to_keep``
is taken. Shapes: prompts ``[B, P]`` left padded, answers ``[B, A]`` right padded; masks 1 = real token.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from utils.rl_math import gather_log_probs, token_entropy


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions of the real tokens of left/right padded rows: ``cumsum(mask) − 1``, pads at 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


GPU_SHAPE_MULTIPLE = 64


def shape_multiple(device) -> int:
    """What a pass cut to the columns it reads (:func:`label_loss`, :func:`pair_log_probs`) rounds its lengths up
    to: 64 on a GPU, 1 (no rounding) elsewhere.

    The collators round each batch up to 128 columns on a GPU (:func:`utils.data.data_utils.pad_multiple`) so that
    a run sees few shapes; cutting every batch to its own last label undid that (a new shape costs ~0.2 s on a GPU:
    GEMM heuristics, allocator, attention kernel choice). 64 keeps the shapes few and the extra columns cheap. On a
    CPU a column costs its FLOPs, so the cut stays exact."""
    return GPU_SHAPE_MULTIPLE if getattr(device, "type", str(device)) == "cuda" else 1


def keeps_label_positions(device) -> bool:
    """Whether :func:`counted_log_probs` runs the LM head on each row's counted positions alone (True: a GPU) or on
    the window of columns from the first counted one to the last (False: a CPU). The two give the same loss up to
    rounding. On a GPU the head over the window (its float32 logits, ``V`` wide) is the largest tensor of a step
    whose prompts are long. On a CPU the window gives the numbers every CPU result here was measured with, bit for
    bit (the demo's held-out table, which the gathered head's rounding moved by up to 2.5 points after 40 steps of
    float noise), and the gather saved ~4 % of a tiny-llama SFT step there."""
    return getattr(device, "type", str(device)) == "cuda"


def shares_prefix(device) -> bool:
    """Whether a pair of rows sharing a prefix (DPO's chosen and rejected, the reward model's) runs that prefix once
    and the two continuations on its KV cache (True), or the two whole rows in one pass (False): the one rule of
    :func:`pair_log_probs` and :class:`utils.model.reward_model.RewardModel`.

    On a CPU the shared prefix saves its FLOPs and was measured faster. On a GPU a small model's step is bound by
    kernel launches and host syncs, not FLOPs: the shared path runs two passes per model (DPO: 4 a step, ~6,000
    kernels more than TRL's 2 for SmolLM2-135M) plus index work with syncs, so one concatenated pass wins."""
    return getattr(device, "type", str(device)) == "cpu"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _module(model):
    """The ``nn.Module`` behind a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


def forward_parameters(model) -> frozenset:
    """The keyword names ``model.forward`` takes (of the module a DeepSpeed engine wraps)."""
    module = _module(model)
    cached = getattr(module, "_lean_forward_params", None)
    if cached is None:
        cached = frozenset(inspect.signature(module.forward).parameters)
        try:
            module._lean_forward_params = cached
        except AttributeError:  # a module that refuses new attributes: just recompute next time
            pass
    return cached


def cache_parameter(model) -> str | None:
    """The keyword ``model.forward`` takes a KV cache by (``cache`` from transformers 5.24, ``past_key_values``
    before), or None."""
    params = forward_parameters(model)
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def output_cache(out):
    """The KV cache a forward with ``use_cache=True`` returned (``out.cache``, or ``out.past_key_values`` before
    transformers 5.24)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def checkpointing(model) -> bool:
    """Is activation (gradient) checkpointing on? transformers turns the KV cache off under it."""
    module = _module(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the first is transformers ≥ 5's
        if hasattr(type(module), name):
            return bool(getattr(module, name))
    return False


def can_share_prompt(model) -> bool:
    """Can :func:`answer_log_probs` run a group's prompt once on ``model`` (see the module docstring)?"""
    params = forward_parameters(model)
    return (not checkpointing(model) and cache_parameter(model) is not None
            and {"position_ids", "logits_to_keep", "use_cache"} <= params)


def keeps_positions(model) -> bool:
    """Does ``model.forward`` take ``logits_to_keep`` as a ``[B, K]`` tensor of positions per row? transformers'
    causal LMs do where their forward calls ``slice_logits_to_keep`` (5.x); others get the column window."""
    module = _module(model)
    cached = getattr(module, "_lean_keeps_positions", None)
    if cached is None:
        forward = inspect.unwrap(type(module).forward)
        code = getattr(forward, "__code__", None)
        cached = "logits_to_keep" in forward_parameters(model) and code is not None and \
            "slice_logits_to_keep" in code.co_names
        try:
            module._lean_keeps_positions = cached
        except AttributeError:
            pass
    return cached


def shared_group_size(prompts: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> int:
    """``group_size`` when the rows are consecutive groups of that many identical prompts (and masks), else 1."""
    B = prompts.shape[0]
    if group_size <= 1 or B % group_size:
        return 1
    same = (torch.equal(prompts, prompts[::group_size].repeat_interleave(group_size, dim=0))
            and torch.equal(prompt_mask, prompt_mask[::group_size].repeat_interleave(group_size, dim=0)))
    return group_size if same else 1


def _logits(model, ids, mask, positions, keep: int, params: frozenset, **extra):
    """``[B, keep, V]``: the logits of the last ``keep`` positions of ``ids`` (all of them, sliced, when the model
    does not take ``logits_to_keep``)."""
    kwargs = dict(attention_mask=mask, use_cache=extra.pop("use_cache", False), **extra)
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    if "logits_to_keep" in params:
        out = model(ids, logits_to_keep=keep, **kwargs)
        return out, out.logits
    out = model(ids, **kwargs)
    return out, out.logits[:, -keep:]


def answer_log_probs(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, answers: torch.Tensor,
                     answer_mask: torch.Tensor, group_size: int = 1, temperature: float = 1.0,
                     share_prompt: bool = True, entropy: bool = False):
    """``[B, A]`` float32 ``log π(answers[:, j] | prompt, answers[:, :j])`` at temperature ``temperature``; with
    ``entropy``, the pair (log-probs, ``[B, A]`` float32 entropy of the distribution each answer token was drawn from,
    detached: :func:`utils.rl_math.token_entropy` of the same logits, no forward pass of its own).

    Args:
        model: a causal LM (or a DeepSpeed engine around one); called as it is (train or eval mode is the
            caller's), with gradients when the caller's context records them.
        prompts: ``[B, P]`` left padded; ``prompt_mask`` ``[B, P]`` (1 = real token).
        answers: ``[B, A]`` right padded; ``answer_mask`` ``[B, A]`` (1 = real token: up to and including the
            answer's end token). Values at positions with mask 0 are meaningless (the caller masks them).
        group_size: rows ``g·G … g·G + G − 1`` may share one prompt (checked: :func:`shared_group_size`).
        temperature: the logits are divided by it (the distribution answers were sampled from).
        share_prompt: False forces the plain pass (tests compare the two).
        entropy: also return the entropies (step 3 logs their mean).
    """
    params = forward_parameters(model)
    B, P = prompts.shape
    A = answers.shape[1]
    mask = torch.cat([prompt_mask.long(), answer_mask.long()], dim=1)
    positions = position_ids(mask)
    G = shared_group_size(prompts, prompt_mask, group_size) if share_prompt and can_share_prompt(model) else 1
    if G == 1:  # the plain pass: prompt + answer without its last token; logits at the A answer actions
        ids = torch.cat([prompts, answers], dim=1)[:, :-1]
        _, logits = _logits(model, ids, mask[:, :-1], positions[:, :-1], A, params)
        logps = gather_log_probs(logits, answers, temperature)
        return (logps, token_entropy(logits, temperature)) if entropy else logps

    # the shared pass: each prompt once (its last position predicts the first answer token), then the answers
    out, first = _logits(model, prompts[::G], prompt_mask[::G], positions[::G, :P], 1, params, use_cache=True)
    first_lp = gather_log_probs(first.repeat_interleave(G, dim=0), answers[:, :1], temperature)  # [B, 1]
    first_entropy = token_entropy(first, temperature).repeat_interleave(G, dim=0) if entropy else None
    if A == 1:
        return (first_lp, first_entropy) if entropy else first_lp
    cache = output_cache(out)
    cache.batch_repeat_interleave(G)
    _, rest = _logits(model, answers[:, :-1], mask[:, :-1], positions[:, P:-1], A - 1, params, use_cache=True,
                      **{cache_parameter(model): cache})
    logps = torch.cat([first_lp, gather_log_probs(rest, answers[:, 1:], temperature)], dim=1)
    return (logps, torch.cat([first_entropy, token_entropy(rest, temperature)], dim=1)) if entropy else logps


# --------------------------------------------------------------------------- language-model loss (step 1, PPO-ptx)


def counted_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                      counted: torch.Tensor, positions: torch.Tensor | None = None):
    """``(log-probs, weights)``, both ``[B, K]`` float32: ``log π(targets[:, t] | input_ids[:, :t + 1])`` at K
    positions ``t`` per row covering every position ``counted`` marks (weight: its ``counted`` value; 0 at the
    positions taken only to fill a row), or None when nothing is counted.

    The model runs on the columns up to the last counted one and its LM head on each row's counted positions alone
    on a GPU (:func:`keeps_label_positions`, :func:`keeps_positions`; else on the window of columns from the first
    counted one); on a GPU both lengths are
    rounded up to :func:`shape_multiple` (extra positions weigh 0). Host syncs: one, before the forward.

    Args:
        input_ids: ``[B, T]``; ``attention_mask`` ``[B, T]``, or a packed batch's ``[B, 1, T, T]`` (with
            ``positions``); ``positions`` ``[B, T]`` position ids (default: from the 2-D mask).
        targets: ``[B, T − 1]``: position ``t``'s next token (``input_ids[:, 1:]`` or shifted labels; any value where
            not counted).
        counted: ``[B, T − 1]`` (1 = counted; a float weight is kept as it is).
    """
    B, T = input_ids.shape
    device = input_ids.device
    hit = counted != 0
    columns = hit.any(dim=0)
    index = torch.arange(T - 1, device=device)
    stats = torch.stack([torch.where(columns, index, -1).max(), torch.where(columns, index, T).min(),
                         hit.sum(dim=1).max()]).tolist()  # the one host sync
    last, first, most = stats
    if last < 0:
        return None
    multiple = shape_multiple(device)
    n = min(_round_up(last + 1, multiple), T)  # the columns fed
    mask = attention_mask[..., :n, :n] if attention_mask.dim() == 4 else attention_mask[:, :n]
    positions = position_ids(attention_mask[:, :n]) if positions is None else positions[:, :n]
    pad = n - (T - 1)  # 1 where the rounding feeds the last column, which predicts nothing
    hit, targets, weights = (torch.nn.functional.pad(x[:, :n], (0, max(pad, 0))) for x in (hit, targets, counted))
    if keeps_label_positions(device) and keeps_positions(model):  # each row's counted positions first, then fill
        K = min(_round_up(most, multiple), n)
        keep = torch.sort((~hit).to(torch.uint8), dim=1, stable=True).indices[:, :K]
        logits = _logits(model, input_ids[:, :n], mask, positions, keep, forward_parameters(model))[1]
    else:  # the window from the first counted column
        width = min(_round_up(n - first, multiple), n)
        keep = torch.arange(n - width, n, device=device).expand(B, width)
        logits = _logits(model, input_ids[:, :n], mask, positions, width, forward_parameters(model))[1]
    return gather_log_probs(logits, targets.gather(1, keep)), weights.gather(1, keep).float()


def label_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross entropy, float32, the mean over the label positions that are not -100: the value of
    :func:`utils.rl_math.causal_lm_loss` on the full logits, with the LM head only at the positions that predict a
    label (:func:`counted_log_probs`) and no ``log_softmax`` copy of the logits.

    Args:
        model: a causal LM (or a DeepSpeed engine around one).
        input_ids: ``[B, T]`` right padded, or packed sequences.
        attention_mask: ``[B, T]``, or a packed batch's block-diagonal ``[B, 1, T, T]`` (with ``positions``).
        labels: ``[B, T]`` unshifted (position ``t`` predicts ``labels[t + 1]``), -100 = not counted.
        positions: ``[B, T]`` position ids (default: from the 2-D ``attention_mask``).
    """
    targets = labels[:, 1:]
    out = counted_log_probs(model, input_ids, attention_mask, targets, targets != -100, positions)
    if out is None:  # nothing to predict: a zero that still reaches every parameter's gradient
        mask = attention_mask[..., :1, :1] if attention_mask.dim() == 4 else attention_mask[:, :1]
        return model(input_ids[:, :1], attention_mask=mask, use_cache=False).logits.sum() * 0.0
    logps, weights = out
    return -(logps * weights).sum() / weights.sum()


# --------------------------------------------------------------------------- pairs sharing a prefix (DPO, step 2)


def shared_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` for rows ``[chosen_1..B; rejected_1..B]`` (right padded): how many leading tokens each pair shares
    (the first position where they differ), at most either row's length."""
    B2, T = input_ids.shape
    B = B2 // 2
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    differs = input_ids[:B] != input_ids[B:]
    diverge = torch.where(differs, positions, torch.full_like(positions, T)).min(dim=1).values
    lengths = attention_mask.long().sum(dim=1)
    return torch.minimum(diverge, torch.minimum(lengths[:B], lengths[B:]))


@dataclass
class PrefixSplit:
    """Rows cut where they stop sharing a prefix with the other rows of their group: each group's first ``shared``
    tokens once, left padded (``prefix``, ``prefix_mask`` ``[G, D]``; ``prefix_columns``: each prefix token's column
    in the input), and each row's continuation, its columns ``shared … stop − 1``, right padded (``conts``,
    ``cont_mask`` = the input's attention there, ``present`` = within the row's columns; ``[R, C]``); ``source [R]``
    is each continuation's row in the input, ``group [R]`` the prefix it continues, ``columns [R, C]`` each
    continuation token's column in the input, ``head [G]`` the input row each prefix is read from."""
    prefix: torch.Tensor
    prefix_mask: torch.Tensor
    prefix_columns: torch.Tensor
    conts: torch.Tensor
    cont_mask: torch.Tensor
    present: torch.Tensor
    source: torch.Tensor
    columns: torch.Tensor
    group: torch.Tensor
    head: torch.Tensor


PairSplit = PrefixSplit  # a pair is a group of two (split_pairs)


def split_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, source: torch.Tensor, group: torch.Tensor,
                 shared: torch.Tensor, stop: torch.Tensor) -> PrefixSplit:
    """:class:`PrefixSplit` of the rows ``source [R]`` of ``input_ids [N, T]`` (in that order), row ``r`` continuing
    prefix ``group[r]`` (``0 … G − 1``, each used): the first ``shared[g]`` columns (each ≥ 1) of group ``g``'s first
    row once (the caller guarantees the group's rows agree there, tokens and attention), then each row's columns up
    to ``stop [R]`` (exclusive; ≤ ``T``). Prefix columns may hold left padding (their attention 0)."""
    T = input_ids.shape[1]
    device = input_ids.device
    head = source[group_heads(group, len(shared))]  # [G]: the row each prefix is read from
    start = shared[group]
    C = max(int((stop - start).max()), 1)
    offsets = torch.arange(C, device=device)
    present = offsets[None, :] < (stop - start)[:, None]
    columns = (start[:, None] + offsets[None, :]).clamp(max=T - 1)
    conts = torch.where(present, input_ids[source[:, None], columns], torch.zeros_like(columns))
    cont_mask = attention_mask[source[:, None], columns].long() * present
    D = int(shared.max())
    prefix_columns = torch.arange(D, device=device)[None, :] - (D - shared)[:, None]
    in_prefix = prefix_columns >= 0
    prefix_columns = prefix_columns.clamp(min=0)
    prefix = input_ids[head].gather(1, prefix_columns) * in_prefix
    prefix_mask = attention_mask[head].gather(1, prefix_columns).long() * in_prefix
    return PrefixSplit(prefix, prefix_mask, prefix_columns, conts, cont_mask, present, source, columns, group, head)


def split_pairs(input_ids: torch.Tensor, attention_mask: torch.Tensor, shared: torch.Tensor,
                stop: torch.Tensor) -> PrefixSplit:
    """:func:`split_groups` of right-padded rows ``[chosen_1..B; rejected_1..B]``, pair ``i`` a group: its first
    ``shared[i]`` tokens (≥ 1) once, then columns up to ``stop[i]`` (exclusive; ≤ the width) of both rows, the
    continuations interleaved (row ``2i`` chosen, ``2i + 1`` rejected)."""
    source, group = pair_groups(input_ids.shape[0] // 2, input_ids.device)
    return split_groups(input_ids, attention_mask, source, group, shared, stop.repeat_interleave(2))


def pair_groups(B: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``source [2B]``, ``group [2B]`` of :func:`split_groups` for rows ``[chosen_1..B; rejected_1..B]``: pair ``i``
    is group ``i``, its continuations interleaved (row ``2i`` chosen, ``2i + 1`` rejected)."""
    source = torch.stack([torch.arange(B), torch.arange(B, 2 * B)], dim=1).reshape(-1).to(device)
    return source, torch.arange(B, device=device).repeat_interleave(2)


def group_heads(group: torch.Tensor, G: int) -> torch.Tensor:
    """``[G]``: the index of each group's first row in ``group [R]`` (``0 … G − 1``, each used)."""
    rows = torch.arange(len(group), device=group.device)
    return torch.full((G,), len(group), dtype=torch.long, device=group.device).scatter_reduce(0, group, rows, "amin")


def group_prefix_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``[G]``: how many leading columns the rows of each group (``group [N]``: ``0 … G − 1``, each used) share, tokens
    and attention alike, at most the shortest row's real length (right-padded rows)."""
    N, T = input_ids.shape
    device = input_ids.device
    G = int(group.max()) + 1
    head = group_heads(group, G)[group]
    differs = (input_ids != input_ids[head]) | (attention_mask != attention_mask[head])
    columns = torch.arange(T, device=device).expand(N, T)
    agree = torch.where(differs, columns, torch.full_like(columns, T)).min(dim=1).values
    agree = torch.minimum(agree, attention_mask.long().sum(dim=1))
    return torch.full((G,), T, dtype=torch.long, device=device).scatter_reduce(0, group, agree, "amin")


def pair_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   loss_mask: torch.Tensor, share_prompt: bool | None = None) -> torch.Tensor:
    """``[2B]`` float32 sums of ``log π(token | before)`` over the tokens ``loss_mask`` counts, for DPO's rows
    ``[chosen_1..B; rejected_1..B]`` (right padded): :func:`utils.rl_math.sequence_log_probs` of the full logits.

    ``loss_mask`` counts only tokens from where chosen and rejected first differ (the prompt and any shared start
    of the answers cancel out). Where :func:`shares_prefix` says so (a CPU; ``share_prompt`` True/False forces
    it), each pair's shared part runs once and its two continuations run on its KV cache
    (:func:`answer_log_probs`), the LM head on the continuations alone. Otherwise (a GPU, a pair without a shared
    token, a model that cannot share): one pass over all rows, the LM head at the counted positions alone
    (:func:`counted_log_probs`).
    """
    if share_prompt is None:
        share_prompt = shares_prefix(input_ids.device)
    shared = shared_lengths(input_ids, attention_mask) if share_prompt and can_share_prompt(model) else None
    if shared is None or int(shared.min()) < 1:
        out = counted_log_probs(model, input_ids, attention_mask, input_ids[:, 1:], loss_mask[:, 1:])
        if out is None:  # nothing counted: zeros that still reach the gradient
            return model(input_ids[:, :1], attention_mask=attention_mask[:, :1], use_cache=False).logits[:, 0, 0] * 0.0
        logps, weights = out
        return (logps * weights).sum(dim=1)
    lengths = attention_mask.long().sum(dim=1)
    B = len(shared)
    split = split_pairs(input_ids, attention_mask, shared, torch.maximum(lengths[:B], lengths[B:]))
    logps = answer_log_probs(model, split.prefix.repeat_interleave(2, dim=0),
                             split.prefix_mask.repeat_interleave(2, dim=0), split.conts, split.cont_mask, group_size=2)
    counted = loss_mask[split.source[:, None], split.columns] * split.cont_mask
    sums = (logps * counted).sum(dim=1)
    return torch.cat([sums[0::2], sums[1::2]])
