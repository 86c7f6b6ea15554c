"""Step 3's experience record and its batching: :class:`Rollout` (a round's, or a micro-batch's, tensors),
:class:`RoundCollector` (scored generation batches → rounds, with DAPO's dynamic sampling), :func:`cut_batches`
(the unsupervised text cut like the rollout) and :class:`WholeSteps` (a round's schedule → whole optimizer steps).

Shapes: ``B`` answers (``--n_samples_per_prompt`` G per prompt, next to each other), prompt length ``P`` (left
padded), answer length ``A``, ``T = P + A``; per-action tensors have ``A`` columns. Masks: 1 = counts. Nothing here
runs a model: :mod:`step3_rlhf_finetuning.ppo_trainer` fills the rollout, :mod:`utils.rl_math` holds the math.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import List, Optional

import torch
import torch.nn.functional as F

from utils.distributed import get_world_size
from utils.rl_math import informative_groups


@dataclass
class Rollout:
    """The experience of one round (or a micro-batch of it): batch-first tensors ``[B, …]`` and lists of ``B``.

    =================  =========  ================================================================
    field              shape      meaning
    =================  =========  ================================================================
    prompts            [B, P]     the left-padded prompts (each repeated G times)
    input_ids          [B, T]     prompt + answer, right padded with the pad id
    attention_mask     [B, T]     prompt mask from the collator + the answer up to its first end token
    action_mask        [B, A]     1 for answer actions incl. the end token's; 0 for dropped rows
    logprobs           [B, A]     log π_old(action) (actor without dropout); on-policy: the training pass's
    ref_logprobs       [B, A]     log π_ref(action); None without a reference model (``--kl_ctl 0``)
    valid              [B]        1 = kept, 0 = dropped (answer with ≤ 1 real token)
    answer_len         [B]        real answer tokens (before the first end token)
    truncated          [B]        1 = no end token: cut at --max_answer_seq_len (masked out of the losses with
                                  --mask_truncated_answers)
    prompt_text, rows  lists      each answer's prompt text and dataset row (reward functions)
    answers            list       the decoded answers (reward functions, --print_answers)
    values             [B, A]     critic values V_old of the state before each action (gae only)
    scores             [B]        the answer's reward (:meth:`DeepSpeedPPOTrainer.score`)
    task_scores        [B]        the reward before ``--overlong_penalty`` (None without it): what
                                  ``--dynamic_sampling`` filters on (DAPO filters on accuracy, not on length), and
                                  what step 3 logs as ``task_reward``
    advantages         [B, A]     per-action advantages (0 outside the action mask)
    returns            [B, A]     GAE returns, the critic's targets (gae only)
    =================  =========  ================================================================

    ``group_size`` G: rows ``g·G … g·G + G − 1`` answer the same prompt. ``pad_token_id`` fills the columns
    that :meth:`cat` adds. ``info`` holds per-round counts and timings (seconds; summed by :meth:`cat`):
    generate, experience, generated_tokens, sequences, dropped, kept, tokens, batches; a round from
    :class:`RoundCollector` with ``--dynamic_sampling`` adds its group counts.
    """
    prompts: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    valid: torch.Tensor
    answer_len: torch.Tensor
    truncated: Optional[torch.Tensor] = None
    prompt_text: List[str] = field(default_factory=list)
    rows: List[dict] = field(default_factory=list)
    answers: List[str] = field(default_factory=list)
    values: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    task_scores: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    group_size: int = 1
    pad_token_id: int = 0
    info: dict = field(default_factory=dict)

    LISTS = ("prompt_text", "rows", "answers")
    PER_ACTION = ("action_mask", "logprobs", "ref_logprobs", "values", "advantages", "returns")
    CONSTANTS = ("group_size", "pad_token_id", "info")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def nothing_kept(self) -> bool:
        """Every answer of the batch, on every rank, was dropped (``info["kept"]`` 0, counted once by
        :meth:`~step3_rlhf_finetuning.ppo_trainer.DeepSpeedPPOTrainer.generate`): no log-prob was computed and
        nothing was scored; a round skips the batch (with ``--dynamic_sampling`` it counts as drawn)."""
        return self.info.get("kept", 1) == 0

    @property
    def prompt_length(self) -> int:
        """``P``."""
        return self.prompts.shape[1]

    @property
    def answer_ids(self) -> torch.Tensor:
        """``[B, A]`` the answers (right padded)."""
        return self.input_ids[:, self.prompt_length:]

    def _batch_fields(self):
        return [f.name for f in fields(self) if f.name not in self.CONSTANTS]

    def _replace(self, **parts) -> "Rollout":
        return Rollout(**parts, group_size=self.group_size, pad_token_id=self.pad_token_id, info={})

    def _columns(self, prompt, sequence, action, info: dict) -> "Rollout":
        """The same rows with each 2-D tensor passed through ``prompt`` (``prompts``), ``sequence`` (``input_ids``,
        ``attention_mask``) or ``action`` (the per-action tensors), each called with the field's name and value."""
        parts = {}
        for name in self._batch_fields():
            value = getattr(self, name)
            if value is None or name in self.LISTS or value.dim() < 2:
                parts[name] = value
            else:
                fn = prompt if name == "prompts" else sequence if name in ("input_ids", "attention_mask") else action
                parts[name] = fn(name, value)
        return Rollout(**parts, group_size=self.group_size, pad_token_id=self.pad_token_id, info=info)

    def trimmed(self) -> "Rollout":
        """The same rows without the prompt columns that are padding in every row and the answer columns
        after every row's end: views, so the numbers computed on them are those of the full width."""
        P, A = self.prompt_length, self.action_mask.shape[1]
        prompt_real = self.attention_mask[:, :P].any(dim=0).nonzero()
        answer_real = self.attention_mask[:, P:].any(dim=0).nonzero()
        # keep one prompt column at least: its last position predicts the first answer token
        left = min(int(prompt_real[0]) if len(prompt_real) else P - 1, P - 1)
        right = int(answer_real[-1]) + 1 if len(answer_real) else A
        if left == 0 and right == A:
            return self
        return self._columns(lambda _, v: v[:, left:], lambda _, v: v[:, left:P + right],
                             lambda _, v: v[:, :right], info={})

    def select(self, rows: torch.Tensor) -> "Rollout":
        """The rows ``rows`` (indices, in that order) as a new rollout (copies; ``info`` empty)."""
        index = rows.tolist()
        parts = {}
        for name in self._batch_fields():
            value = getattr(self, name)
            parts[name] = (None if value is None else [value[i] for i in index] if name in self.LISTS
                           else value[rows.to(value.device)])
        return self._replace(**parts)

    def micro_batches(self, size: int) -> List["Rollout"]:
        """Consecutive slices of ``size`` rows (the last may be shorter), each :meth:`trimmed` (views: writing into
        a micro-batch's tensors writes into the rollout's)."""
        out = []
        for i in range(0, len(self), size):
            parts = {name: (value[i:i + size] if value is not None else None)
                     for name in self._batch_fields() for value in [getattr(self, name)]}
            out.append(self._replace(**parts).trimmed())
        return out

    def padded(self, prompt_length: int, answer_length: int) -> "Rollout":
        """The same rollout with prompts left padded to ``prompt_length`` and answers (and per-action tensors) right
        padded to ``answer_length`` columns (pad id; masks, log-probs, values and advantages 0)."""
        left, right = prompt_length - self.prompt_length, answer_length - self.action_mask.shape[1]
        if left == 0 and right == 0:
            return self

        def fill(name):
            return self.pad_token_id if name in ("prompts", "input_ids") else 0

        return self._columns(lambda n, v: F.pad(v, (left, 0), value=fill(n)),
                             lambda n, v: F.pad(v, (left, right), value=fill(n)),
                             lambda n, v: F.pad(v, (0, right), value=fill(n)), info=dict(self.info))

    @classmethod
    def cat(cls, rollouts: List["Rollout"]) -> "Rollout":
        """One rollout of several (same fields filled): prompts left padded and answers right padded to the
        longest; ``info`` summed."""
        P = max(r.prompt_length for r in rollouts)
        A = max(r.action_mask.shape[1] for r in rollouts)
        rollouts = [r.padded(P, A) for r in rollouts]
        first = rollouts[0]
        parts = {}
        for name in first._batch_fields():
            values = [getattr(r, name) for r in rollouts]
            if values[0] is None:
                parts[name] = None
            elif name in cls.LISTS:
                parts[name] = [x for v in values for x in v]
            else:
                parts[name] = torch.cat(values, dim=0)
        info = {}
        for r in rollouts:
            for key, value in r.info.items():
                info[key] = info.get(key, 0) + value
        return cls(**parts, group_size=first.group_size, pad_token_id=first.pad_token_id, info=info)

    def state(self) -> dict:
        """Plain tensors, lists and numbers (a checkpoint loads it with ``weights_only=True``)."""
        return {name: getattr(self, name) for name in self._batch_fields() + list(self.CONSTANTS)}

    @classmethod
    def from_state(cls, state: dict) -> "Rollout":
        return cls(**state)



def cut_batches(batches: List[dict], size: int) -> List[dict]:
    """Batches (dicts of batch-first tensors) concatenated and cut into consecutive micro-batches of ``size`` rows
    (the last may be shorter): the unsupervised text of a round, paired one to one with the rollout's."""
    whole = {key: torch.cat([b[key] for b in batches], dim=0) for key in batches[0]}
    rows = next(iter(whole.values())).shape[0]
    return [{key: value[i:i + size] for key, value in whole.items()} for i in range(0, rows, size)]


class WholeSteps:
    """A round's training schedule → the micro-batches that make whole optimizer steps of ``per_step`` each
    (``--gradient_accumulation_steps``); the rest wait for the next round.

    DeepSpeed counts micro-batches across rounds, so when a round's micro-batches × ``--ppo_epochs`` do not fill whole
    optimizer steps, a step spans two rounds (or, with ``per_step`` above a round's, several). Its loss normalizer,
    the step's mean count per micro-batch (:func:`utils.rl_math.step_normalizers`), needs the count of every
    micro-batch of the step, so the micro-batches that do not make a whole step yet are trained at the start of the
    next round's schedule. They lose nothing by waiting: no optimizer step runs in between, so the weights they are
    trained at, and their ratios, are the same. Micro-batches still waiting when the run ends are not trained, as
    DeepSpeed never steps an unfinished accumulation either.

    ``waiting`` holds ``(micro-batch, text or None)`` pairs; :meth:`state` and :meth:`from_state` carry them through
    a checkpoint.
    """

    def __init__(self, per_step: int, waiting: Optional[list] = None):
        if per_step < 1:
            raise ValueError(f"per_step must be ≥ 1, got {per_step}")
        self.per_step = per_step
        self.waiting = list(waiting or [])

    def take(self, schedule: list) -> list:
        """The waiting pairs, then ``schedule``'s, cut to whole optimizer steps (in order); keeps the rest."""
        pairs = self.waiting + list(schedule)
        whole = len(pairs) - len(pairs) % self.per_step
        self.waiting = pairs[whole:]
        return pairs[:whole]

    def state(self) -> list:
        """The waiting pairs as CPU tensors, lists and numbers (``torch.load(weights_only=True)`` reads them)."""
        def cpu(value):
            return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value

        return [{"micro": {k: cpu(v) for k, v in micro.state().items()},
                 "text": None if text is None else {k: cpu(v) for k, v in text.items()}}
                for micro, text in self.waiting]

    @classmethod
    def from_state(cls, per_step: int, state: Optional[list], device=None) -> "WholeSteps":
        def to(value):
            return value.to(device) if isinstance(value, torch.Tensor) and device is not None else value

        waiting = [(Rollout.from_state({k: to(v) for k, v in pair["micro"].items()}),
                    None if pair["text"] is None else {k: to(v) for k, v in pair["text"].items()})
                   for pair in state or []]
        return cls(per_step, waiting)


def _group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """The row indices of the groups ``groups`` (indices), each group's ``group_size`` rows in order."""
    return (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)


def _distributed_reduce(tensor: torch.Tensor, op: str) -> None:
    """In place over every rank (``sum`` or ``min``); nothing with one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1:
        ops = {"sum": torch.distributed.ReduceOp.SUM, "min": torch.distributed.ReduceOp.MIN}
        torch.distributed.all_reduce(tensor, op=ops[op])


class RoundCollector:
    """Scored generation batches → rounds (DeepSpeed-Chat's MiniDataset, plus DAPO's dynamic sampling).

    Without ``--dynamic_sampling`` a round is the next ``--generation_batches`` batches that kept an answer (a batch
    whose answers were all dropped is skipped). With it, each batch keeps only its informative groups
    (:func:`utils.rl_math.informative_groups` on the clipped task scores, before ``--overlong_penalty``: two or more
    valid answers that do not all score the same), and batches are drawn until every rank holds the round's ``--generation_batches`` ×
    ``groups_per_batch`` groups or ``--dynamic_sampling_max_batches`` batches were drawn (the same number on every
    rank: the decision takes the minimum over ranks). Every rank then trains on exactly that many groups: its first
    kept ones (the surplus is dropped, as DAPO does) and, when the limit came first, dropped groups masked out of every
    loss and statistic (``valid`` and the action mask 0). ``info`` counts, over every rank, the groups kept, filtered
    (all scoring the same), surplus (informative but beyond the round's) and filled, and the batches drawn. So every rank and every round runs the same micro-batches,
    the optimizer steps where it always does, and the on-policy shortcut still holds.

    ``reduce(tensor, op)`` sums (``op`` "sum") or takes the minimum ("min") in place over the ranks; by default
    ``torch.distributed``'s. ``log`` (a warning's callable, or None) says which rounds :meth:`collect` skips.
    """

    def __init__(self, ppo, groups_per_batch: int, reduce=None, log=None):
        self.ppo = ppo
        self.log = log
        self.target = ppo.generation_batches * groups_per_batch
        self.reduce = reduce or _distributed_reduce
        self._start()

    def _start(self) -> None:
        self.parts, self.spare, self.texts, self.info = [], [], [], {}
        self.batches = self.kept_groups = self.spare_groups = self.filtered_groups = self.surplus_groups = 0

    def add(self, rollout: Rollout, text: Optional[dict] = None):
        """Take one generation batch (scored, unless ``info["kept"]`` is 0) and its unsupervised text (or None);
        ``(round, texts)`` when a round is complete, else None."""
        if not self.ppo.dynamic_sampling:
            if rollout.nothing_kept:
                return None
            self.parts.append(rollout)
            self.texts += [text] if text is not None else []
            if len(self.parts) < self.ppo.generation_batches:
                return None
            ready = Rollout.cat(self.parts), self.texts
            self._start()
            return ready
        return self._add_filtered(rollout, text)

    def collect(self, rollout: Rollout, text: Optional[dict] = None):
        """:meth:`add`, minus the rounds with nothing to train on: ``(round, texts)`` for an RL step, else None (a
        ``--dynamic_sampling`` round with no informative group is said, through ``log``, and skipped)."""
        ready = self.add(rollout, text)
        if ready is not None and ready[0].info.get("groups_kept") == 0:
            if self.log is not None:
                self.log(f"--dynamic_sampling: no group with different scores in {ready[0].info['sampled_batches']} "
                         "generation batches (--dynamic_sampling_max_batches); no RL step on them")
            return None
        return ready

    def _add_filtered(self, rollout: Rollout, text: Optional[dict]):
        G, ppo = rollout.group_size, self.ppo
        groups = len(rollout) // G
        self.batches += 1
        for key, value in rollout.info.items():
            self.info[key] = self.info.get(key, 0) + value
        if not rollout.nothing_kept:
            # on the task's reward, before --overlong_penalty: a group all right (or all wrong) whose answers differ
            # only in length is not informative (DAPO filters on accuracy)
            task = rollout.task_scores if rollout.task_scores is not None else rollout.scores
            clipped = task.float().clamp(-ppo.clip_reward_value, ppo.clip_reward_value)
            keep = informative_groups(clipped, G, rollout.valid).to(rollout.input_ids.device)
        else:  # nothing was scored: every group is one to fill with
            rollout.scores = torch.zeros(len(rollout), dtype=torch.float32, device=rollout.input_ids.device)
            if ppo.overlong_penalty:  # as every scored part has it, so the round's parts concatenate
                rollout.task_scores = rollout.scores.clone()
            keep = torch.zeros(groups, dtype=torch.bool, device=rollout.input_ids.device)
        kept, dropped = keep.nonzero().reshape(-1), (~keep).nonzero().reshape(-1)
        taken = kept[:max(self.target - self.kept_groups, 0)]
        if len(taken):
            self.parts.append(rollout.select(_group_rows(taken, G)))
            self.kept_groups += len(taken)
        self.surplus_groups += len(kept) - len(taken)
        if len(dropped) and self.spare_groups < self.target:
            spare = dropped[:self.target - self.spare_groups]
            self.spare.append(rollout.select(_group_rows(spare, G)))
            self.spare_groups += len(spare)
        self.filtered_groups += len(dropped)
        if text is not None and len(self.texts) < ppo.generation_batches:
            self.texts.append(text)
        fewest = torch.tensor([float(self.kept_groups)], dtype=torch.float64, device=rollout.input_ids.device)
        self.reduce(fewest, "min")
        if fewest.item() < self.target and self.batches < ppo.dynamic_sampling_max_batches:
            return None
        return self._finish(G)

    def _finish(self, G: int):
        filled = min(self.target - self.kept_groups, self.spare_groups)
        parts = list(self.parts)
        if filled:
            fill = Rollout.cat(self.spare)
            fill = fill.select(torch.arange(filled * G, device=fill.input_ids.device))
            fill.valid.zero_()
            fill.action_mask.zero_()
            parts.append(fill)
        device = parts[0].input_ids.device
        counts = torch.tensor([self.kept_groups, self.filtered_groups, self.surplus_groups, filled],
                              dtype=torch.float64, device=device)
        self.reduce(counts, "sum")
        ready = Rollout.cat(parts)
        ready.info = dict(self.info, sampled_batches=self.batches,
                          **dict(zip(("groups_kept", "groups_filtered", "groups_surplus", "groups_filled"),
                                     (int(round(c)) for c in counts.tolist()))))
        texts = self.texts
        self._start()
        return ready, texts
