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
  gradient back into the prompt pass), so the results agree up to float rounding (tests/test_answer_logprobs.py).
* **Position ids from the attention mask** (``cumsum(mask) − 1``, pads at 0), as ``generate`` numbers the
  tokens it samples: how much left padding a batch carries changes nothing.
* **Log-softmax without a float32 copy of the whole logits** (:func:`utils.rl_math.gather_log_probs`).

The shared pass needs a model whose ``forward`` takes ``position_ids``, ``logits_to_keep`` and a KV cache
(every transformers 5 causal LM), and no activation checkpointing (transformers turns the cache off under
it); otherwise the plain pass runs, still with logits at the answer positions only where ``logits_to_keep``
is taken. Shapes: prompts ``[B, P]`` left padded, answers ``[B, A]`` right padded; masks 1 = real token.
"""
from __future__ import annotations

import inspect

import torch

from utils.rl_math import gather_log_probs


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions of the real tokens of left/right padded rows: ``cumsum(mask) − 1``, pads at 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _module(model):
    """The ``nn.Module`` behind a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


def forward_parameters(model) -> frozenset:
    """The keyword names ``model.forward`` takes (of the module a DeepSpeed engine wraps)."""
    module = _module(model)
    cached = getattr(module, "_answer_logprobs_params", None)
    if cached is None:
        cached = frozenset(inspect.signature(module.forward).parameters)
        try:
            module._answer_logprobs_params = cached
        except AttributeError:  # a module that refuses new attributes: just recompute next time
            pass
    return cached


def _cache_name(params: frozenset) -> str | None:
    for name in ("cache", "past_key_values"):  # transformers 5.24 renamed past_key_values to cache
        if name in params:
            return name
    return None


def can_share_prompt(model) -> bool:
    """Can :func:`answer_log_probs` run a group's prompt once on ``model`` (see the module docstring)?"""
    params = forward_parameters(model)
    checkpointing = getattr(_module(model), "is_gradient_checkpointing", False)
    return (not checkpointing and _cache_name(params) is not None
            and {"position_ids", "logits_to_keep", "use_cache"} <= params)


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
                     share_prompt: bool = True) -> torch.Tensor:
    """``[B, A]`` float32 ``log π(answers[:, j] | prompt, answers[:, :j])`` at temperature ``temperature``.

    Args:
        model: a causal LM (or a DeepSpeed engine around one); called as it is (train or eval mode is the
            caller's), with gradients when the caller's context records them.
        prompts: ``[B, P]`` left padded; ``prompt_mask`` ``[B, P]`` (1 = real token).
        answers: ``[B, A]`` right padded; ``answer_mask`` ``[B, A]`` (1 = real token: up to and including the
            answer's end token). Values at positions with mask 0 are meaningless (the caller masks them).
        group_size: rows ``g·G … g·G + G − 1`` may share one prompt (checked: :func:`shared_group_size`).
        temperature: the logits are divided by it (the distribution answers were sampled from).
        share_prompt: False forces the plain pass (tests compare the two).
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
        return gather_log_probs(logits, answers, temperature)

    # the shared pass: each prompt once (its last position predicts the first answer token), then the answers
    cache_name = _cache_name(params)
    out, first = _logits(model, prompts[::G], prompt_mask[::G], positions[::G, :P], 1, params, use_cache=True)
    first_lp = gather_log_probs(first.repeat_interleave(G, dim=0), answers[:, :1], temperature)  # [B, 1]
    if A == 1:
        return first_lp
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    cache.batch_repeat_interleave(G)
    _, rest = _logits(model, answers[:, :-1], mask[:, :-1], positions[:, P:-1], A - 1, params, use_cache=True,
                      **{cache_name: cache})
    return torch.cat([first_lp, gather_log_probs(rest, answers[:, 1:], temperature)], dim=1)
