"""The reward model of step 2 (and the critic / reward models of step 3).

:class:`RewardModel` = a Hugging Face backbone without LM head (``AutoModel``) +
``v_head: Linear(d, 1, bias=False)`` (``d`` = ``word_embed_proj_dim`` for OPT, else
``hidden_size``), giving one scalar per token: ``r_t = v_head(h_t)``.

* ``forward(input_ids, attention_mask)`` on a step-2 batch ``[chosen_1..B; rejected_1..B]``
  (2B rows) returns ``{"loss", "chosen_mean_scores", "rejected_mean_scores"}`` with
  DeepSpeed-Chat's pairwise loss (:func:`utils.rl_math.pairwise_reward_loss`). There a
  sequence's score is read at ``c − 1``, ``c`` = its pad-id token number
  ``num_padding_at_beginning`` (0-based; OPT's leading BOS = pad is skipped with 1).
* ``forward(input_ids, attention_mask, chosen_index, rejected_index, pair_group)`` on a ``--kwise`` batch
  (:class:`~utils.data.data_utils.DataCollatorKwise`: U distinct texts, N pairs of G prompts) forwards each text
  once and returns the same keys (scores ``[N]``), with InstructGPT's K-wise loss (:func:`kwise_loss`).
* ``forward_value(input_ids, attention_mask, prompt_length=P)`` returns per-token
  ``values [B, T]`` and ``chosen_end_scores [B]`` (see :func:`end_score_index`): the
  value at the **last token before the first pad token after the prompt**, or at the last
  position when there is none (the answer hit the length limit). For OPT-style tokenizers
  (pad = eos) that is the token before the EOS; with a distinct pad token (Llama) it is the
  EOS itself. Either way it is where ``forward`` reads a score in step 2.

Building, saving and loading (strictly) a step-2 folder: :mod:`utils.model.critic`.
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from utils.model.model_utils import cache_kwarg, disable_activation_checkpointing, enable_activation_checkpointing
from utils.rl_math import end_score_reward_loss, pairwise_reward_loss

REWARD_LOSSES = ("span", "end")  # DeepSpeed-Chat's per-token span loss; InstructGPT's end-score loss


# --------------------------------------------------------------------------- scores

def end_score_index(input_ids: torch.Tensor, prompt_length: Union[int, torch.Tensor], pad_token_id: int,
                    eos_token_id: int, num_padding_at_beginning: int = 0) -> torch.Tensor:
    """Position of each sequence's end score: the token before the first pad after the prompt.

    This is the position step 2's pairwise loss reads (``c − 1``), so training and
    scoring agree for every tokenizer: with pad = eos (OPT) it is the last token
    before the EOS; with a separate pad (Llama) it is the EOS itself.

    The search starts at ``prompt_length`` (or, when it is 0, at
    ``num_padding_at_beginning``, so an OPT leading BOS = pad is not taken for the end).
    A sequence without padding there ends at ``T − 1``; an empty answer (pad right after
    the prompt) gives the last prompt position. ``eos_token_id`` is kept for callers'
    symmetry; only the pad id decides. Always in ``[0, T−1]``.

    Args:
        input_ids: ``[B, T]`` prompt + answer (+ EOS, + right padding).
        prompt_length: ``P``, an int or a ``[B]`` tensor (one per row).
        pad_token_id, eos_token_id: the tokenizer's ids (may be equal).
        num_padding_at_beginning: leading pad-id tokens (1 for OPT, else 0).

    Returns:
        ``[B]`` long positions.
    """
    B, T = input_ids.shape
    start = torch.as_tensor(prompt_length, device=input_ids.device).long().expand(B)
    start = torch.where(start > 0, start, torch.full_like(start, num_padding_at_beginning))
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    is_end = (input_ids == pad_token_id) & (positions >= start[:, None])
    first_end = torch.where(is_end, positions, torch.full_like(positions, T)).min(dim=1).values
    return (first_end - 1).clamp(min=0)


def kwise_loss(pair_losses: torch.Tensor, pair_group: torch.Tensor) -> torch.Tensor:
    """InstructGPT's K-wise average of pair losses: each prompt's pairs averaged, then the prompts averaged.

    InstructGPT (Ouyang et al. 2022, eq. 1) puts all C(K, 2) comparisons of a prompt's K answers in one batch
    element and scales them by 1/C(K, 2): a prompt with many pairs weighs what a prompt with one pair does, and
    no answer is seen in many separate updates (which overfit there). With one pair per prompt this is the plain
    mean over pairs, step 2's ordinary loss.

    Args:
        pair_losses: ``[N]`` loss of each pair (e.g. ``−logσ(s_c − s_r)``).
        pair_group: ``[N]`` long, the prompt of each pair (any ids; only equality matters).

    Returns:
        Scalar: ``mean_g mean_{i ∈ g} pair_losses_i`` (float32).
    """
    if pair_losses.shape != pair_group.shape or pair_losses.dim() != 1 or not len(pair_losses):
        raise ValueError(f"kwise_loss needs [N] losses and [N] groups, N ≥ 1; got {tuple(pair_losses.shape)} and "
                         f"{tuple(pair_group.shape)}")
    _, group = torch.unique(pair_group, return_inverse=True)  # 0 … G−1
    G = int(group.max()) + 1
    losses = pair_losses.float()
    sums = torch.zeros(G, dtype=losses.dtype, device=losses.device).index_add(0, group, losses)
    counts = torch.bincount(group, minlength=G).to(losses.dtype)
    return (sums / counts).mean()


def count_leading_pads(ids: torch.Tensor, pad_token_id: int) -> int:
    """Number of ``pad_token_id`` tokens a 1-D sequence starts with (OPT: its BOS = pad)."""
    not_pad = (ids != pad_token_id).nonzero()
    return int(not_pad[0]) if len(not_pad) else len(ids)


# --------------------------------------------------------------------------- model

def value_head_dim(config) -> int:
    """Input size of ``v_head``: OPT projects to ``word_embed_proj_dim``; others use the hidden size."""
    for key in ("word_embed_proj_dim", "hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    raise ValueError(f"cannot find the hidden size of {type(config).__name__}")


class ValueHead(nn.Linear):
    """``v_head``: a bias-free ``Linear(d, 1)`` evaluated in fp32, whatever the backbone's dtype.

    Under bf16 the scores of one batch share a large common offset (the pairwise loss
    does not pin it) and differ by less than bf16's resolution there (2⁻⁷ ≈ 0.008 at
    |score| ≈ 1.4): a bf16 head rounds chosen and rejected scores to the same number,
    the loss reads exactly ln 2 and accuracy collapses (ties count as wrong). DeepSpeed-Chat
    returns the head's output in the backbone's dtype; here the product is taken in
    fp32 from the (bf16) hidden states and weight. A subclass of ``nn.Linear``, so the
    state dict keeps the name ``v_head.weight`` and ZeRO-3 still gathers the weight.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())


def _opt_positions(mask: torch.Tensor) -> torch.Tensor:
    return mask.cumsum(dim=1) * mask - 1  # OPT's own rule (its embedding adds 2): padding at −1


def _column_positions(mask: torch.Tensor) -> torch.Tensor:
    return torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # RoPE models: the column


# The position ids a backbone gives its tokens when called without any (the plain pass), by model type; the reward
# model's shared pass (RewardModel._pair_values) runs only where this is known.
PLAIN_POSITIONS = {"opt": _opt_positions, **{t: _column_positions for t in (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")}}


class RewardModel(nn.Module):
    """Backbone (no LM head) + bias-free scalar ``v_head``. See the module docstring."""

    def __init__(self, base_model: nn.Module, tokenizer, num_padding_at_beginning: int = 0, loss: str = "span"):
        super().__init__()
        if loss not in REWARD_LOSSES:
            raise ValueError(f"unknown reward loss {loss!r}; known: {', '.join(REWARD_LOSSES)}")
        self.config = base_model.config
        self.num_padding_at_beginning = num_padding_at_beginning
        self.loss = loss
        self.v_head = ValueHead(value_head_dim(self.config), 1, bias=False)
        self.rwtransformer = base_model
        self.PAD_ID = tokenizer.pad_token_id
        self.EOS_ID = tokenizer.eos_token_id
        self.share_prefix = True  # rows sharing a start run it once where they can (False: the plain pass, for tests)

    # gradient checkpointing is the backbone's (transformers ≥ 5 calls it "activation checkpointing")
    def gradient_checkpointing_enable(self, **kwargs):
        enable_activation_checkpointing(self.rwtransformer, **kwargs)

    def gradient_checkpointing_disable(self):
        disable_activation_checkpointing(self.rwtransformer)

    def _values(self, input_ids, attention_mask=None, past_key_values=None, position_ids=None, head_mask=None,
                inputs_embeds=None, use_cache=False) -> torch.Tensor:
        """``[B, T]`` per-token values ``v_head(h_t)``, fp32 (see :class:`ValueHead`)."""
        kwargs = dict(attention_mask=attention_mask, use_cache=use_cache)
        for name, value in (("position_ids", position_ids), ("head_mask", head_mask), ("inputs_embeds", inputs_embeds)):
            if value is not None:
                kwargs[name] = value
        if past_key_values is not None:
            kwargs[cache_kwarg(self.rwtransformer)] = past_key_values
        hidden = self.rwtransformer(input_ids, **kwargs)[0]
        return self.v_head(hidden).squeeze(-1)  # fp32 (ValueHead)

    def _can_share(self) -> bool:
        from utils.model.lean_forward import cache_parameter, checkpointing, forward_parameters

        return not checkpointing(self.rwtransformer) and cache_parameter(self.rwtransformer) is not None and \
            {"position_ids", "use_cache"} <= forward_parameters(self.rwtransformer)

    def _shared_ready(self, input_ids: torch.Tensor, attention_mask) -> bool:
        """Can the rows' shared starts run once (:meth:`_prefix_values`)? Where the backbone's own positions are known
        (:data:`PLAIN_POSITIONS`), it takes a KV cache, ``share_prefix`` is on and the device prefers it
        (:func:`utils.model.lean_forward.shares_prefix`: on a GPU one plain pass is faster)."""
        from utils.model.lean_forward import shares_prefix

        return self.share_prefix and attention_mask is not None and \
            getattr(self.config, "model_type", None) in PLAIN_POSITIONS and self._can_share() and \
            shares_prefix(input_ids.device)

    def _prefix_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, source: torch.Tensor,
                       group: torch.Tensor, shared: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
        """``[N, T]`` values of the rows of ``input_ids`` at the columns ``shared[group[r]] − 1 … stop[r] − 1`` of each
        row ``source[r]``, each group's first ``shared`` columns run once on the backbone and its rows' continuations
        on its KV cache (:func:`utils.model.lean_forward.split_groups`, whose arguments these are); other columns are
        0. The positions are those the backbone gives a plain call (:data:`PLAIN_POSITIONS`), so the values are the
        plain pass's up to float rounding, and so are their gradients (the cache carries them back into the
        prefix pass)."""
        from utils.model.lean_forward import cache_parameter, output_cache, split_groups

        split = split_groups(input_ids, attention_mask, source, group, shared, stop)
        positions = PLAIN_POSITIONS[self.config.model_type](attention_mask.long())
        out = self.rwtransformer(split.prefix, attention_mask=split.prefix_mask, use_cache=True,
                                 position_ids=positions[split.head].gather(1, split.prefix_columns))
        cache = output_cache(out)
        cache.batch_select_indices(group)
        mask = torch.cat([split.prefix_mask[group], split.cont_mask], dim=1)
        hidden = self.rwtransformer(split.conts, attention_mask=mask, use_cache=True,
                                    position_ids=positions[split.source[:, None], split.columns],
                                    **{cache_parameter(self.rwtransformer): cache})[0]
        last = self.v_head(out[0][:, -1]).squeeze(-1)[group]  # [R]: the value at column shared − 1
        cont = self.v_head(hidden).squeeze(-1)  # [R, C]
        rows = split.source[:, None].expand_as(split.columns)
        values = torch.zeros(input_ids.shape, dtype=cont.dtype, device=cont.device)
        values = values.index_put((rows[split.present], split.columns[split.present]), cont[split.present])
        return values.index_put((split.source, shared[group] - 1), last)

    def _pair_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """``[2B, T]`` values of ``[chosen; rejected]`` rows at every column the pairwise loss reads
        (:func:`~utils.rl_math.pairwise_read_window`), each pair's shared start run once (:meth:`_prefix_values`; the
        span reads values at the shorter answer's padding, whose position ids differ between models); other columns
        are 0. None where that cannot be done (then :meth:`_values` runs the plain pass)."""
        from utils.model.lean_forward import pair_groups, shared_lengths
        from utils.rl_math import pairwise_read_window

        if not self._shared_ready(input_ids, attention_mask):
            return None
        B = input_ids.shape[0] // 2
        first, stop = pairwise_read_window(input_ids[:B], input_ids[B:], self.PAD_ID, self.num_padding_at_beginning)
        shared = torch.minimum(shared_lengths(input_ids, attention_mask), first + 1)
        if int(shared.min()) < 1:
            return None
        source, group = pair_groups(B, input_ids.device)
        return self._prefix_values(input_ids, attention_mask, source, group, shared,
                                   torch.maximum(stop, shared + 1).repeat_interleave(2))

    def _kwise_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, chosen_index: torch.Tensor,
                      rejected_index: torch.Tensor, pair_group: torch.Tensor) -> torch.Tensor | None:
        """``[U, T]`` values of a ``--kwise`` batch's texts at every column the pairs' losses read, the answers to
        one prompt continuing that prompt's one pass (:meth:`_prefix_values`): a prompt of 68 tokens and its 8
        answers of ~90 run as 68 + 8 × 90 tokens, not 8 × 158. None where that cannot be done."""
        from utils.model.lean_forward import group_prefix_lengths
        from utils.rl_math import pairwise_read_window

        if not self._shared_ready(input_ids, attention_mask):
            return None
        U = input_ids.shape[0]
        _, pair_prompt = torch.unique(pair_group, return_inverse=True)  # [N]: 0 … G − 1
        G = int(pair_prompt.max()) + 1
        text_group = torch.zeros(U, dtype=torch.long, device=input_ids.device)
        text_group[chosen_index] = pair_prompt
        text_group[rejected_index] = pair_prompt
        first, stop = pairwise_read_window(input_ids[chosen_index], input_ids[rejected_index], self.PAD_ID,
                                           self.num_padding_at_beginning)
        row_stop = torch.zeros(U, dtype=torch.long, device=input_ids.device)
        row_stop = row_stop.scatter_reduce(0, chosen_index, stop, "amax").scatter_reduce(0, rejected_index, stop, "amax")
        group_first = torch.full((G,), input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        group_first = group_first.scatter_reduce(0, pair_prompt, first, "amin")
        shared = torch.minimum(group_prefix_lengths(input_ids, attention_mask, text_group), group_first + 1)
        if int(shared.min()) < 1:
            return None
        source = torch.arange(U, device=input_ids.device)
        return self._prefix_values(input_ids, attention_mask, source, text_group, shared,
                                   torch.maximum(row_stop, shared[text_group] + 1).clamp(max=input_ids.shape[1]))

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, position_ids=None,
                head_mask=None, inputs_embeds=None, use_cache=False, chosen_index=None, rejected_index=None,
                pair_group=None):
        """Pairwise loss on ``[chosen; rejected]`` (``input_ids`` ``[2B, T]``): DeepSpeed-Chat's per-token span loss,
        or with ``loss="end"`` the end scores' (:func:`~utils.rl_math.end_score_reward_loss`). Each pair's shared
        start (the prompt) runs once (:meth:`_pair_values`) when the call is a plain one.

        With ``chosen_index``/``rejected_index``/``pair_group`` (``[N]`` each, a ``--kwise`` batch): ``input_ids``
        ``[U, T]`` are distinct texts, run once each, pair i compares rows ``chosen_index[i]`` and
        ``rejected_index[i]`` with the same loss (span or end), and the pairs' losses are averaged per prompt
        ``pair_group[i]``, then over prompts (:func:`kwise_loss`).

        Returns ``{"loss": scalar, "chosen_mean_scores": [B], "rejected_mean_scores": [B]}`` (``[N]`` with K-wise).
        """
        if chosen_index is not None:
            return self._kwise_forward(input_ids, attention_mask, chosen_index, rejected_index, pair_group)
        if input_ids.shape[0] % 2:
            raise ValueError(f"RewardModel.forward needs [chosen; rejected] rows, got {input_ids.shape[0]} rows")
        plain = past_key_values is None and position_ids is None and head_mask is None and inputs_embeds is None
        rewards = self._pair_values(input_ids, attention_mask) if plain else None
        if rewards is None:
            rewards = self._values(input_ids, attention_mask, past_key_values, position_ids, head_mask,
                                   inputs_embeds, use_cache)
        B = input_ids.shape[0] // 2
        loss, chosen, rejected = pairwise_reward_loss(rewards[:B], rewards[B:], input_ids[:B], input_ids[B:],
                                                      self.PAD_ID, self.num_padding_at_beginning)
        if self.loss == "end":
            loss = end_score_reward_loss(chosen, rejected)
        return {"loss": loss, "chosen_mean_scores": chosen, "rejected_mean_scores": rejected}

    def _kwise_forward(self, input_ids, attention_mask, chosen_index, rejected_index, pair_group) -> dict:
        """:meth:`forward` on a ``--kwise`` batch: the U distinct texts, each prompt's run once where the device
        prefers it (:meth:`_kwise_values`; else one plain pass), then each pair's loss from its two rows (values at
        the same columns as the pairwise batch's: right padding, causal attention)."""
        if rejected_index is None or pair_group is None:
            raise ValueError("a K-wise batch needs chosen_index, rejected_index and pair_group together")
        values = self._kwise_values(input_ids, attention_mask, chosen_index, rejected_index, pair_group)
        if values is None:
            values = self._values(input_ids, attention_mask)  # [U, T]
        losses, chosen, rejected = pairwise_reward_loss(values[chosen_index], values[rejected_index],
                                                        input_ids[chosen_index], input_ids[rejected_index],
                                                        self.PAD_ID, self.num_padding_at_beginning, per_pair=True)
        if self.loss == "end":
            losses = -F.logsigmoid(chosen.float() - rejected.float())  # end_score_reward_loss, pair by pair
        return {"loss": kwise_loss(losses, pair_group), "chosen_mean_scores": chosen, "rejected_mean_scores": rejected}

    def forward_value(self, input_ids=None, attention_mask=None, past_key_values=None, position_ids=None,
                      head_mask=None, inputs_embeds=None, return_value_only=False, prompt_length=0,
                      use_cache=False, group_size=1):
        """Per-token values ``[B, T]``; unless ``return_value_only``, also the end scores.

        Returns ``values`` or ``{"values": [B, T], "chosen_end_scores": [B]}`` with the end
        score at :func:`end_score_index` (``prompt_length``: int or ``[B]`` tensor).

        ``group_size`` G > 1 (step 3: rows ``g·G … g·G + G − 1`` answer one prompt, left padded to ``prompt_length``
        columns): where the rows do repeat their prompt and the device prefers it (:meth:`_shared_ready`), each prompt
        runs once and its G answers on its KV cache (:meth:`_prefix_values`); the values before column
        ``prompt_length − 1`` are then 0 (never read: the critic reads ``P − 1 …``, the end score is at ``P − 1`` or
        after), the rest the plain pass's up to float rounding.
        """
        values = None
        plain = past_key_values is None and position_ids is None and head_mask is None and inputs_embeds is None
        if plain and group_size > 1 and isinstance(prompt_length, int) and prompt_length > 0:
            values = self._group_values(input_ids, attention_mask, prompt_length, group_size)
        if values is None:
            values = self._values(input_ids, attention_mask, past_key_values, position_ids, head_mask,
                                  inputs_embeds, use_cache)
        if return_value_only:
            return values
        index = end_score_index(input_ids, prompt_length, self.PAD_ID, self.EOS_ID, self.num_padding_at_beginning)
        return {"values": values, "chosen_end_scores": values.gather(1, index[:, None]).squeeze(1)}

    def _group_values(self, input_ids: torch.Tensor, attention_mask, prompt_length: int, group_size: int):
        """:meth:`forward_value`'s values with each of ``group_size`` rows' prompt (the first ``prompt_length``
        columns) run once, or None where the rows do not repeat it or the device prefers one plain pass."""
        from utils.model.lean_forward import shared_group_size

        P = prompt_length
        if not self._shared_ready(input_ids, attention_mask) or P >= input_ids.shape[1] or \
                shared_group_size(input_ids[:, :P], attention_mask[:, :P], group_size) != group_size:
            return None
        B, T = input_ids.shape
        device = input_ids.device
        source = torch.arange(B, device=device)
        shared = torch.full((B // group_size,), P, dtype=torch.long, device=device)
        return self._prefix_values(input_ids, attention_mask, source, source // group_size, shared,
                                   torch.full((B,), T, dtype=torch.long, device=device))
