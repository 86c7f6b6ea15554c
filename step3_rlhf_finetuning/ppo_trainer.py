"""Step 3's RL trainer: it owns the round. Per RL step, ``main`` makes the algorithm's calls::

    rollout = trainer.experience(batch, step)        # generate + score one prompt batch (nothing kept: said, not scored)
    ready = rounds.collect(rollout, text)            # RoundCollector: --generation_batches batches (dynamic sampling)
    trainer.compute_advantages(round)                # --advantage_estimator on the whole round, groups intact
    stats = trainer.optimise(round, texts, steps, micro_batch, unsup_micro_batch)  # --ppo_epochs, PTX, EMA
    reporter.report(progress, round, stats, seconds)  # metrics: console, tensorboard, metrics.jsonl

The record and its batching live in :mod:`step3_rlhf_finetuning.rollout` (imported here under their old names), the
metrics in :mod:`step3_rlhf_finetuning.metrics`, all math in :mod:`utils.rl_math`; this module only moves tensors
between the models. Shapes: ``B`` answers (``--n_samples_per_prompt`` G per prompt, next to each other), prompt
length ``P`` (left padded to the batch's longest prompt, a multiple of 8), answer length ``A`` (the
longest answer generated, ≤ ``--max_answer_seq_len``), ``T = P + A``. Per-action tensors have ``A``
columns, one per answer token: action ``j`` emits answer token ``j`` (from sequence position
``P − 1 + j``); prompt positions have none. Masks: 1 = counts.

Nothing is computed that is thrown away: the log-probs come from the LM head at the answer positions only
and the G answers to a prompt run their prompt once (:mod:`utils.model.lean_forward`); when the update is
provably on-policy the old log-probs are the training pass's own (:func:`old_logprobs_from_training_pass`);
without a KL term (``--kl_ctl 0``) there is no reference model.

Dropped answers (≤ 1 real token) stay in the rollout with an all-zero action mask: they add
nothing to any loss, statistic or group baseline, and every rank keeps the same number of
micro-batches.
"""
from __future__ import annotations

import contextlib
import random
import time
from typing import List, Optional

import torch
from deepspeed.runtime.torch_autocast import autocast_if_enabled

from step3_rlhf_finetuning.metrics import PolicyStats, TrainStats, reward_ema, summarize_rollout  # noqa: F401
from step3_rlhf_finetuning.rollout import (Rollout, RoundCollector, WholeSteps, cut_batches,  # noqa: F401
                                           _distributed_reduce, _group_rows)
from utils.distributed import get_all_reduce_mean, get_world_size
from utils.model.lean_forward import answer_log_probs, can_share_prompt, label_loss, position_ids
from utils.rl_math import (aggregate_loss, answer_action_mask, count_real_answer_tokens, critic_loss,
                           discounted_returns, ema_update, gae_advantages_and_returns, kl_estimate,
                           kl_penalized_rewards, loss_count, masked_sum, masked_whiten, overlong_penalty, policy_ratio,
                           ratio_clip_sums, step_normalizers)


@contextlib.contextmanager
def deterministic(*modules):
    """Put ``modules`` in eval mode (no dropout) for the block, then restore their modes.

    Used for the experience forwards: the engines stay in train mode (so a hybrid
    engine uses its training modules, as in the reference) while dropout is off, so
    log π_old and V_old are exact.
    """
    modules = [m for m in modules if m is not None]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def old_logprobs_from_training_pass(ppo, micro_batches_per_round: int, grad_accum: int, dropout: bool) -> bool:
    """Can log π_old be the training pass's own detached log-probs instead of a forward pass of its own?

    Yes when the update is provably on-policy and nothing reads log π_old before training: one pass over the
    round (``ppo_epochs`` 1) whose micro-batches all see the weights that generated it (the actor's optimizer
    steps only at the round's end: ``grad_accum``, the RL micro-batches per optimizer step, a multiple of the
    round's), no dropout (the training pass in train mode then equals the eval-mode pass), and no KL penalty in the
    reward (it needs log π_old at advantage time). When a step spans several rounds, the earlier rounds' micro-batches
    wait for it (:class:`WholeSteps`) and are not trained when their round's KL metric is logged, so then there may be
    no reference model (``kl_ctl`` 0). Then the ratio is exactly 1 and its gradient is the policy gradient, as TRL
    computes it.
    """
    kl_in_reward = ppo.kl_ctl > 0 and not ppo.use_kl_loss
    rounds_wait = grad_accum != micro_batches_per_round and ppo.kl_ctl > 0
    return (ppo.ppo_epochs == 1 and grad_accum % max(micro_batches_per_round, 1) == 0 and not dropout
            and not kl_in_reward and not rounds_wait)


class DeepSpeedPPOTrainer:
    """RL on a :class:`~step3_rlhf_finetuning.rlhf_engine.DeepSpeedRLHFEngine` (or anything with the same fields):
    PPO with a critic (``gae``) or a critic-free estimator (module docstring).

    Per RL step: :meth:`experience` for each prompt batch, :meth:`compute_advantages` on the round,
    :meth:`optimise` (module docstring). ``ppo`` (:class:`~step3_rlhf_finetuning.config.PPOConfig`) holds the update's constants, ``generation``
    (:class:`~step3_rlhf_finetuning.config.GenerationConfig`) how answers are generated, ``reward``
    (:class:`~step3_rlhf_finetuning.config.RewardConfig`) where scores come from; ``reward_fn`` is the loaded
    ``--reward_fn`` (:func:`utils.reward_functions.load_reward_fn`).
    """

    def __init__(self, rlhf_engine, ppo, generation, log=None, reward=None, reward_fn=None, on_policy=False,
                 warn=None):
        from step3_rlhf_finetuning.config import RewardConfig
        from utils.distributed import print_rank_0

        self.log = log or print_rank_0  # main passes its TrainLogger's info
        self.warn = warn or self.log  # ... and its warning
        self.rlhf_engine = rlhf_engine
        self.actor_model = rlhf_engine.actor
        self.critic_model = rlhf_engine.critic  # None for the critic-free estimators
        self.ref_model = rlhf_engine.ref  # None without a KL term (--kl_ctl 0)
        self.reward_model = rlhf_engine.reward  # None when a reward function alone scores
        self.tokenizer = rlhf_engine.tokenizer
        self.ppo = ppo
        self.reward = reward or RewardConfig()
        self.reward_fn = reward_fn
        self.generation = generation
        self.max_answer_seq_len = generation.max_answer_seq_len
        self.pad_token_id = self.tokenizer.pad_token_id
        # the tokens that end an answer: the EOS, and --eot_token when --add_eot_token added it
        self.end_token_ids = end_of_answer_token_ids(self.tokenizer, generation.eot_token)
        self.actor_zero_stage = self.actor_model.zero_optimization_stage()
        self.z3_enabled = self.actor_zero_stage == 3
        self.hybrid_engine = getattr(rlhf_engine, "hybrid_engine_active", False)
        self.generation_copy = self._make_generation_copy(generation.dtype)
        self.generator = self._make_generator(generation.backend)
        # log-probs are those of the distribution answers are sampled from (logits / temperature; as TRL)
        self.temperature = generation.logprob_temperature
        self.policy_loss_fn = ppo.policy_loss_spec.loss_function()  # --policy_loss's per-token loss
        # on-policy (old_logprobs_from_training_pass): log π_old is the training pass's, no pass of its own
        self.on_policy = on_policy
        if on_policy:
            self.log("old log-probs: the training pass's own (on-policy: one optimizer step per round, no dropout, "
                     "no KL in the reward), no forward pass of their own")

    # ------------------------------------------------------------------ generate

    def _make_generation_copy(self, dtype: str | None):
        """The :class:`utils.generation.GenerationCopy` of the actor answers come from, or None (the actor itself):
        in ``--generation_dtype``, and under ZeRO-3 (in that dtype, else the actor's) with whole weights gathered
        once per rollout (:meth:`_copy_fits` decides each time whether it fits) and freed after it."""
        from utils.generation import GenerationCopy
        from utils.runtime import torch_dtype

        if self.hybrid_engine:
            if dtype is not None:  # main refuses it; a direct caller gets the same rule
                raise ValueError("--generation_dtype and the hybrid engine both choose how the actor generates")
            return None
        if dtype is None and not self.z3_enabled:
            return None
        copy = GenerationCopy(self.actor_model.module, torch_dtype(dtype) if dtype else None,
                              device=getattr(self.actor_model, "device", None))
        if not copy.partitioned:
            self.log(f"generation: from a {dtype} copy of the actor, refreshed before each generation")
            return copy
        what = dtype or str(copy.dtype).removeprefix("torch.")
        self.log(f"generation: ZeRO-3 actor: its weights are gathered once per rollout into a whole {what} copy "
                 f"({copy.nbytes / 2 ** 20:.1f} MiB on each rank, freed after the rollout) that each rank generates "
                 "from on its own")
        self._copy_fitted = True  # the last decision of _copy_fits (said when it changes)
        return copy

    def _copy_fits(self, rows: int) -> bool:
        """ZeRO-3: does the whole-weight copy fit for a rollout of ``rows`` answers on every rank
        (:func:`utils.generation.copy_fits`)? All ranks decide alike (the gathering and the synced ``generate`` are
        both collective); the reason is said when the decision changes."""
        from utils.generation import available_memory, copy_fits, kv_cache_bytes

        copy, generator = self.generation_copy, self.generator
        cached = getattr(generator, "cache", None) is not None and getattr(generator, "batch_size", 0) >= rows
        length = self.generation.max_prompt_seq_len + self.max_answer_seq_len
        kv = 0 if cached else kv_cache_bytes(copy.module.config, rows, length, copy.dtype)
        fits, why = copy_fits(copy.nbytes, kv, copy.gather_bytes, available_memory(copy.device))
        if torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1:
            flag = torch.tensor([int(fits)], device=copy.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            if fits and not bool(flag.item()):
                why = "another rank's whole-weight copy would not fit; generating with model.generate (synced)"
            fits = bool(flag.item())
        if fits != self._copy_fitted and not fits:
            self.warn(f"generation: {why}")
        elif fits != self._copy_fitted:
            self.log("generation: the whole-weight copy fits again; generating from it")
        self._copy_fitted = fits
        return fits

    @property
    def generation_module(self):
        """The module answers are generated with: the :class:`~utils.generation.GenerationCopy` (``--generation_dtype``,
        ZeRO-3's whole weights), or the actor's module."""
        return self.generation_copy.module if self.generation_copy is not None else self.actor_model.module

    def _make_generator(self, requested: str):
        """The actor's generation path, chosen once (and said once): DeepSpeed's hybrid engine when it is
        active, else :func:`utils.generation.choose_backend` — a :class:`StaticGenerator` or None (plain
        ``generate``)."""
        from utils.generation import StaticGenerator, choose_backend

        if self.hybrid_engine:
            self.generation_backend = "hybrid-engine"
            self.log("generation: DeepSpeed hybrid engine")
            return None
        backend, why = choose_backend(requested, self.generation_module, self.actor_zero_stage)
        self.generation_backend = backend
        self.log(f"generation: {backend} backend" + (f" ({why})" if why else ""))
        if backend == "hf":
            return None
        return StaticGenerator(self.generation_module, self.generation.max_prompt_seq_len, self.max_answer_seq_len,
                               self.end_token_ids, self.pad_token_id, use_cuda_graph=backend == "cuda-graph",
                               log=self.log)

    def _prefilled_cache(self, prompts: torch.Tensor, mask: torch.Tensor, group: int, module=None):
        """``generate``'s KV cache for all but the last token of each group's prompt, run once per group and repeated
        for its ``group`` rows; None where the plain ``generate`` must do it (one answer per prompt, ZeRO-3
        partitions, the hybrid engine, a model without the cache API). ``module``: the one generating (default
        :attr:`generation_module`)."""
        from utils.generation import is_partitioned
        from utils.model.lean_forward import cache_parameter, output_cache, shared_group_size

        module = module if module is not None else self.generation_module
        if (group <= 1 or is_partitioned(module) or self.hybrid_engine or prompts.shape[1] < 2
                or not can_share_prompt(module) or shared_group_size(prompts, mask, group) != group):
            return None
        head, head_mask = prompts[::group, :-1], mask[::group, :-1]
        out = module(head, attention_mask=head_mask, position_ids=position_ids(head_mask), use_cache=True,
                     logits_to_keep=1)
        cache = output_cache(out)
        if cache is None or not hasattr(cache, "batch_repeat_interleave"):
            return None
        cache.batch_repeat_interleave(group)
        return cache

    def _generate_sequence(self, prompts: torch.Tensor, mask: torch.Tensor, group: int = 1) -> tuple:
        """(``[B, P + n]``: the actor's answers after the prompts, right padded with the pad id, ``n`` the longest
        answer; tokens generated). ``group``: rows ``g·G …`` repeat one prompt (its prefill runs once)."""
        from utils.generation import generate_kwargs
        from utils.model.lean_forward import cache_parameter

        gen, copy = self.generation, self.generation_copy
        # ZeRO-3: the whole-weight copy when it fits (else the partitioned actor, every rank in step)
        use_copy = copy is not None and (not copy.partitioned or self._copy_fits(len(prompts)))
        if use_copy:
            if copy.partitioned:
                release_in_flight(self.actor_model)
            copy.refresh()  # the actor's weights after its last step, in the copy's dtype
        module = copy.module if use_copy else self.actor_model.module
        generator = self.generator if use_copy or copy is None else None
        # --torch_autocast: DeepSpeed autocasts an engine's own forward; generation and forward_value call the module
        # directly, so they run under the engine's autocast here (never a backward). A --generation_dtype copy
        # runs in its own dtype.
        casts = use_copy and gen.dtype is not None
        precision = contextlib.nullcontext() if casts else autocast_if_enabled(self.actor_model)
        try:
            with torch.no_grad(), precision:
                if generator is not None:
                    seq = generator.generate(prompts, mask, do_sample=gen.do_sample, temperature=gen.temperature,
                                             top_k=gen.top_k, top_p=gen.top_p)
                else:
                    # sampling through a logits processor: torch.multinomial costs a quarter of the CPU's generation
                    kwargs = dict(attention_mask=mask, max_new_tokens=self.max_answer_seq_len,
                                  pad_token_id=self.pad_token_id, eos_token_id=list(self.end_token_ids),
                                  synced_gpus=self.z3_enabled and not use_copy, use_cache=True,
                                  **generate_kwargs(gen.do_sample, gen.temperature, gen.top_k, gen.top_p))
                    cache = self._prefilled_cache(prompts, mask, group, module)
                    if cache is not None:
                        kwargs[cache_parameter(module)] = cache
                    # the module's generate, as DeepSpeed-Chat: an active hybrid engine has replaced it with its own
                    seq = module.generate(prompts, **kwargs)
        finally:
            if use_copy and copy.partitioned:
                copy.release()  # ZeRO-3: the memory goes back to training (GenerationCopy)
        seq = seq[:, :prompts.shape[1] + self.max_answer_seq_len]
        answers = seq[:, prompts.shape[1]:]
        generated = answers.shape[1]
        # the columns after every row's end are padding (a static generator may return some): cut them
        real = answer_action_mask(answers, self.end_token_ids).any(dim=0).nonzero()
        width = int(real[-1]) + 1 if len(real) else min(1, generated)
        return seq[:, :prompts.shape[1] + width], generated

    def _print_answers(self, prompts, answers, step: int) -> None:
        gen = self.generation
        if gen.print_answers and step % max(gen.print_answers_interval, 1) == 0:
            self.log(f"--- prompt --> step={step}, {self.tokenizer.batch_decode(prompts, skip_special_tokens=True)}")
            self.log(f"--- ans    --> step={step}, {answers}")

    def generate(self, prompts: torch.Tensor, mask: torch.Tensor, prompt_text=None, rows=None,
                 step: int = 0) -> Rollout:
        """``--n_samples_per_prompt`` answers to each of ``prompts [b, P]`` and their log-probs (and values).

        Returns a :class:`Rollout` of ``B = b·G`` rows without scores. Answers with ≤ 1 real token (before
        the first end token) are dropped (masked out); ``info["dropped"]`` counts them on every rank. With
        ``--mask_truncated_answers`` an answer without an end token (cut at ``--max_answer_seq_len``) keeps its
        place in its group but counts in no loss (its action mask is 0). When every answer on every rank was
        dropped, ``info["kept"]`` is 0 and no log-prob was computed (the fields are zeros): the caller skips the
        batch. On-policy, ``logprobs`` stays zeros until :meth:`train_step`.
        """
        start = time.time()
        G = self.ppo.n_samples_per_prompt
        prompts, mask = prompts.repeat_interleave(G, dim=0), mask.repeat_interleave(G, dim=0)
        prompt_text = [t for t in (prompt_text or [""] * (len(prompts) // G)) for _ in range(G)]
        rows = [r for r in (rows or [{}] * (len(prompts) // G)) for _ in range(G)]
        self.eval()
        seq, generated = self._generate_sequence(prompts, mask, G)
        generate_time = time.time() - start
        self.train()

        P = prompts.shape[1]
        answer_ids = seq[:, P:]
        answer_len = count_real_answer_tokens(answer_ids, self.end_token_ids)
        answers = [self.tokenizer.decode(ids[:n], skip_special_tokens=True)
                   for ids, n in zip(answer_ids.tolist(), answer_len.tolist())]
        self._print_answers(prompts, answers, step)
        valid = (answer_len > 1).long()
        truncated = (answer_len >= self.max_answer_seq_len).long()  # no end token within the cap
        counts = get_all_reduce_mean(torch.stack([valid.sum(), (1 - valid).sum()]).double()) * get_world_size()
        kept, dropped = (int(round(c)) for c in counts.tolist())
        info = {"generate": generate_time, "generated_tokens": generated, "sequences": len(seq), "dropped": dropped,
                "kept": kept, "batches": 1}
        answer_mask = answer_action_mask(answer_ids, self.end_token_ids)
        info["tokens"] = int(mask.sum()) + int(answer_mask.sum())  # real tokens: prompts and answers (their end)
        attention_mask = torch.cat([mask.long(), answer_mask], dim=1)
        counted = valid * (1 - truncated) if self.ppo.mask_truncated_answers else valid
        action_mask = answer_mask * counted[:, None]
        rollout = Rollout(prompts=prompts, input_ids=seq, attention_mask=attention_mask, action_mask=action_mask,
                          logprobs=torch.zeros(answer_ids.shape, dtype=torch.float32, device=seq.device),
                          ref_logprobs=None, valid=valid, answer_len=answer_len, truncated=truncated,
                          prompt_text=prompt_text, rows=rows, answers=answers, group_size=G,
                          pad_token_id=self.pad_token_id, info=info)
        if self.ref_model is not None:
            rollout.ref_logprobs = torch.zeros_like(rollout.logprobs)
        if self.critic_model is not None:
            rollout.values = torch.zeros_like(rollout.logprobs)
        if kept == 0:  # the same on every rank: all skip the batch (dynamic sampling may fill a round with its rows)
            info["experience"] = time.time() - start
            return rollout
        with torch.no_grad(), deterministic(self.actor_model.module,
                                            self.critic_model.module if self.critic_model else None):
            if not self.on_policy:
                rollout.logprobs = self._action_log_probs(self.actor_model, rollout)
            if self.ref_model is not None:
                rollout.ref_logprobs = self._action_log_probs(self.ref_model, rollout)
            if self.critic_model is not None:
                with autocast_if_enabled(self.critic_model):
                    rollout.values = self._values(rollout).float().detach()
        info["experience"] = time.time() - start
        return rollout

    def _action_log_probs(self, model, rollout: Rollout, entropy: bool = False):
        """``[B, A]`` log-probs of the answer tokens under ``model`` (at the sampling temperature): the LM head at
        the answer positions only, each group's prompt run once (:func:`utils.model.answer_log_probs`); with
        ``entropy``, the pair (log-probs, ``[B, A]`` detached entropies of the same logits)."""
        P = rollout.prompt_length
        return answer_log_probs(model, rollout.prompts, rollout.attention_mask[:, :P], rollout.answer_ids,
                                rollout.attention_mask[:, P:], rollout.group_size, self.temperature, entropy=entropy)

    def _values(self, rollout: Rollout) -> torch.Tensor:
        """``[B, A]`` critic values of the state before each answer action (positions ``P − 1 … T − 2``), each group's
        prompt run once where the device prefers it (:meth:`~utils.model.reward_model.RewardModel.forward_value`)."""
        P = rollout.prompt_length
        values = self.critic_model.forward_value(rollout.input_ids, rollout.attention_mask, return_value_only=True,
                                                 prompt_length=P, group_size=rollout.group_size)
        return values[:, P - 1:-1]

    # ------------------------------------------------------------------ experience

    def experience(self, batch: dict, step: int = 0) -> Rollout:
        """One prompt batch of the collator (``prompt``, ``prompt_att_mask``, ``prompt_text``, ``rows``; on the
        device) → its scored :class:`Rollout`: :meth:`generate`, then :meth:`score`. Whether anything was kept is
        decided here, once (every rank's count, :attr:`Rollout.nothing_kept`): when every answer was dropped the
        batch is said (``step``: the generation batch's number) and not scored; :class:`RoundCollector` skips it."""
        rollout = self.generate(batch["prompt"], batch["prompt_att_mask"], batch.get("prompt_text"),
                                batch.get("rows"), step)
        if rollout.nothing_kept:
            self.warn(f"generation batch {step}: every answer had ≤ 1 token ({rollout.info['dropped']} dropped); "
                      "nothing to score")
        else:
            rollout.scores = self.score(rollout)
        return rollout

    # ------------------------------------------------------------------ score

    def score(self, rollout: Rollout) -> torch.Tensor:
        """``[B]`` float32 rewards: the reward model's end score, the reward function's score, or
        ``RM + --reward_fn_weight · fn`` (:class:`~step3_rlhf_finetuning.config.RewardConfig`); plus, with
        ``--overlong_penalty L``, DAPO's soft length penalty (:func:`utils.rl_math.overlong_penalty`) of the answer's
        tokens, its end token included, times ``--overlong_penalty_weight``. With the penalty, the score before it is
        kept as ``rollout.task_scores`` (``--dynamic_sampling`` filters on it; logged as ``task_reward``)."""
        from utils.reward_functions import call_reward_fn

        start = time.time()
        total = torch.zeros(len(rollout), dtype=torch.float32, device=rollout.input_ids.device)
        if self.reward_model is not None:
            with torch.no_grad(), autocast_if_enabled(self.reward_model):
                out = self.reward_model.forward_value(rollout.input_ids, rollout.attention_mask,
                                                      prompt_length=rollout.prompt_length,
                                                      group_size=rollout.group_size)
            total += out["chosen_end_scores"].float().detach()
        if self.reward_fn is not None:
            scores = call_reward_fn(self.reward_fn, self.reward.fn, rollout.prompt_text, rollout.answers, rollout.rows)
            weight = 1.0 if self.reward.fn_weight is None else self.reward.fn_weight
            total += weight * torch.tensor(scores, dtype=torch.float32, device=total.device)
        if self.ppo.overlong_penalty:
            rollout.task_scores = total.clone()
            lengths = rollout.attention_mask[:, rollout.prompt_length:].sum(dim=1)
            penalty = overlong_penalty(lengths, self.max_answer_seq_len, self.ppo.overlong_penalty)
            total += self.ppo.overlong_penalty_weight * penalty.to(total.device)
        rollout.info["experience"] = rollout.info.get("experience", 0.0) + time.time() - start
        return total

    # ------------------------------------------------------------------ advantages

    def compute_advantages(self, rollout: Rollout) -> None:
        """Fill ``rollout.advantages`` (and, for ``gae``, ``returns``) on the whole round, so every group is intact.

        * ``gae``: DeepSpeed-Chat's PPO — per-action rewards (KL penalty, clipped score on the last action),
          GAE with the critic's values;
        * critic-free: the clipped scores go through the estimator's per-answer function (group baselines; its
          spec's ``advantage``, :mod:`step3_rlhf_finetuning.algorithms`), land on the answer's last action with the
          KL penalties (unless ``--use_kl_loss``), are summed into discounted returns.

        Either way the advantages are then whitened over the batch of every rank with ``--whiten_advantages``
        (default: the spec's, ``reinforce`` / ``reinforce_baseline``; not ``gae``, as DeepSpeed-Chat); the critic's
        returns are not.
        """
        ppo, mask, spec = self.ppo, rollout.action_mask, self.ppo.estimator_spec
        kl_ctl = 0.0 if ppo.use_kl_loss or rollout.ref_logprobs is None else ppo.kl_ctl
        ref = rollout.ref_logprobs if rollout.ref_logprobs is not None else rollout.logprobs
        with torch.no_grad():
            if spec.critic:
                rewards = kl_penalized_rewards(rollout.logprobs, ref, rollout.scores, mask, kl_ctl,
                                               ppo.clip_reward_value, ppo.kl_estimator)
                advantages, rollout.returns = gae_advantages_and_returns(rollout.values, rewards, mask, ppo.gamma,
                                                                         ppo.lam)
            else:
                clipped = rollout.scores.float().clamp(-ppo.clip_reward_value, ppo.clip_reward_value)
                per_answer = spec.advantage_function()(clipped, rollout.group_size, rollout.valid)
                rewards = kl_penalized_rewards(rollout.logprobs, ref, per_answer, mask, kl_ctl, float("inf"),
                                               ppo.kl_estimator)
                advantages = discounted_returns(rewards, mask, ppo.gamma)
            if ppo.whiten_advantages:  # the critic's returns stay as they are
                reduce = None
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    reduce = torch.distributed.all_reduce
                advantages = masked_whiten(advantages, mask, reduce)
            rollout.advantages = advantages

    # ------------------------------------------------------------------ optimise

    def loss_normalizers(self, micro_batches: List[Rollout], per_step: int) -> List[float]:
        """Each micro-batch's normalizer for :meth:`train_step`: the mean count (``--loss_agg``'s: tokens, answers with
        a token, or answers) per micro-batch of its optimizer step, every rank's included
        (:func:`utils.rl_math.step_normalizers`). ``micro_batches`` in training order; ``per_step``: the actor's
        RL micro-batches per optimizer step (``--gradient_accumulation_steps``)."""
        counts = [float(loss_count(m.action_mask, self.ppo.loss_agg, m.valid)) for m in micro_batches]
        reduce = None
        if torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1:
            device = micro_batches[0].action_mask.device if micro_batches else None

            def reduce(sums):  # noqa: E306 - the collective runs on the engines' device
                on_device = sums.to(device)
                torch.distributed.all_reduce(on_device)
                sums.copy_(on_device.cpu())
        return step_normalizers(counts, per_step, reduce, get_world_size() if reduce else 1)

    def optimise(self, rollout: Rollout, unsup_batches: Optional[list], steps: WholeSteps,
                 micro_batch: int, unsup_micro_batch: Optional[int] = None) -> TrainStats:
        """The round's optimisation: ``--ppo_epochs`` passes over its micro-batches of ``micro_batch`` rows (actor,
        critic for gae; + LM loss on the unsupervised text ``unsup_batches``, cut into micro-batches of
        ``unsup_micro_batch`` rows (default ``micro_batch``), one per RL micro-batch; + EMA), reshuffled after each
        pass, as DeepSpeed-Chat; trained in whole optimizer steps (``steps``, :class:`WholeSteps`: micro-batches
        that do not fill one wait for the next round), each micro-batch's actor loss normalised over its optimizer
        step (``--loss_agg``, :meth:`loss_normalizers`). Returns the mean of each loss over the micro-batches trained
        now (none when all wait), the rows each model trained on (this rank) and the actor's ratio, clip and entropy
        sums (:class:`~step3_rlhf_finetuning.metrics.TrainStats`)."""
        micro = rollout.micro_batches(micro_batch)
        unsup = cut_batches(unsup_batches, unsup_micro_batch or micro_batch) if unsup_batches else [None] * len(micro)
        schedule = []  # (micro-batch, text) in training order
        for _ in range(self.ppo.ppo_epochs):
            schedule += list(zip(micro, unsup))
            random.shuffle(micro)
            random.shuffle(unsup)
        schedule = steps.take(schedule)
        normalizers = self.loss_normalizers([batch for batch, _ in schedule], steps.per_step)
        sums, stats = {}, TrainStats()
        for (batch, text), normalizer in zip(schedule, normalizers):
            losses = self.train_step(batch, normalizer, stats.policy)
            stats.actor_rows += len(batch)
            stats.critic_rows += len(batch) if "critic_loss" in losses else 0
            if text is not None:
                losses["unsup_loss"] = self.train_unsupervised(text)
                stats.actor_rows += text["input_ids"].shape[0]
            for name, value in losses.items():
                sums[name] = sums.get(name, 0.0) + value.item()
            self.update_ema()
        stats.losses = {name: total / len(schedule) for name, total in sums.items()}
        stats.waiting = len(steps.waiting)
        return stats

    def train_step(self, micro: Rollout, normalizer: Optional[float] = None,
                   stats: Optional[PolicyStats] = None) -> dict:
        """One update of the actor (and, for ``gae``, the critic) on a micro-batch of a scored rollout with
        advantages; returns the losses (detached scalars): ``actor_loss``, ``critic_loss`` (gae), ``kl_loss``
        (``--use_kl_loss``). The actor's loss is ``--policy_loss``'s per-token loss (and β·KL) aggregated by
        ``--loss_agg`` over ``normalizer`` (:meth:`loss_normalizers`; None: this micro-batch's own count). On-policy,
        the micro-batch's ``logprobs`` (a view of the round's) receive the training pass's detached log-probs, which
        are also the ratio's denominator. ``stats`` (or None) receives the micro-batch's ratio and clip sums and its
        entropy's, read from the training pass's logits (:meth:`PolicyStats.add`)."""
        ppo, mask = self.ppo, micro.action_mask
        if normalizer is None:
            normalizer = float(loss_count(mask, ppo.loss_agg, micro.valid))

        def aggregate(per_token):
            return aggregate_loss(per_token, mask, ppo.loss_agg, normalizer, self.max_answer_seq_len)

        if stats is None:
            logprobs = self._action_log_probs(self.actor_model, micro)
        else:
            logprobs, entropy = self._action_log_probs(self.actor_model, micro, entropy=True)
        if self.on_policy:
            micro.logprobs.copy_(logprobs.detach())
        if stats is not None:
            ratio = policy_ratio(logprobs, micro.logprobs, mask, sequence_level=ppo.policy_loss == "gspo")
            stats.add(ratio_clip_sums(ratio, micro.advantages, mask, ppo.cliprange, ppo.cliprange_high),
                      masked_sum(entropy, mask))
        policy_loss = aggregate(self.policy_loss_fn(logprobs, micro.logprobs, micro.advantages, mask, ppo.cliprange,
                                                    ppo.cliprange_high))
        losses = {"actor_loss": policy_loss.detach()}
        loss = policy_loss
        if ppo.use_kl_loss and micro.ref_logprobs is not None:
            kl = aggregate(kl_estimate(logprobs, micro.ref_logprobs, ppo.kl_estimator))
            loss = loss + ppo.kl_ctl * kl
            losses["kl_loss"] = kl.detach()
        self.actor_model.backward(loss)
        if self.critic_model is None:
            self.actor_model.step()
            return losses
        if not ppo.align_overflow:
            self.actor_model.step()

        with autocast_if_enabled(self.critic_model):
            values = self._values(micro)
        value_loss = critic_loss(values, micro.values, micro.returns, mask, ppo.cliprange_value)
        self.critic_model.backward(value_loss)
        if ppo.align_overflow:
            self._align_overflow()
            self.actor_model.step()
        self.critic_model.step()
        losses["critic_loss"] = value_loss.detach()
        return losses

    def _align_overflow(self) -> None:
        """fp16: skip both optimizer steps when either model's gradients overflowed (``--align_overflow``)."""
        actor_overflow = self.actor_model.optimizer.check_overflow(external=True)
        critic_overflow = self.critic_model.optimizer.check_overflow(external=True)
        if actor_overflow and not critic_overflow:
            self.critic_model.optimizer.skip_step = True
        elif critic_overflow and not actor_overflow:
            self.actor_model.optimizer.skip_step = True
        if actor_overflow or critic_overflow:
            self.log(f"OVERFLOW (actor: {actor_overflow}, critic: {critic_overflow}): "
                     "skipping both actor and critic steps")

    def train_unsupervised(self, inputs: dict) -> torch.Tensor:
        """One LM step of the actor on ``{"input_ids", "attention_mask", "labels"}`` (InstructGPT's PPO-ptx),
        weighted by ``ppo.unsup_coef``; returns the (unscaled) loss."""
        loss = label_loss(self.actor_model, inputs["input_ids"], inputs["attention_mask"], inputs["labels"])
        self.actor_model.backward(self.ppo.unsup_coef * loss)
        self.actor_model.step()
        return loss.detach()

    def update_ema(self) -> None:
        """θ_ema ← β·θ_ema + (1−β)·θ_actor with β = ``ppo.ema_beta`` (ZeRO-3 parameters gathered, update kept)."""
        ema, beta = self.rlhf_engine.actor_ema, self.ppo.ema_beta
        if ema is None:
            return
        params, ema_params = list(self.actor_model.module.parameters()), list(ema.module.parameters())
        if not self.z3_enabled:
            ema_update(ema_params, params, beta)
            return
        import deepspeed

        from utils.model.model_utils import release_zero3_params

        release_zero3_params(self.actor_model, 3)  # nothing may be left in flight before gathering
        for param, ema_param in zip(params, ema_params, strict=True):
            with deepspeed.zero.GatheredParameters([param, ema_param], modifier_rank=0):
                ema_update([ema_param], [param], beta)

    def train(self) -> None:
        for model in (self.actor_model, self.critic_model):
            if model is not None:
                model.train()

    def eval(self) -> None:
        for model in (self.actor_model, self.critic_model, self.ref_model, self.reward_model):
            if model is not None:
                model.eval()


# ---------------------------------------------------------------------- helpers

def release_in_flight(engine) -> None:
    """ZeRO-3: release the parameters a prefetch left in flight (gathering them would fail: "Cannot partition a param
    in flight"), as :func:`utils.model.model_utils.release_zero3_params` does but without the engine's
    ``gc.collect()`` and cache emptying around it: 0.5 s a call in step 3's process on the CPU, twice a tiny model's
    whole generation (the free memory :func:`utils.generation.available_memory` reads counts the allocator's cache)."""
    from utils.model.model_utils import release_zero3_params

    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "empty_partition_cache"):
        optimizer.empty_partition_cache()
    else:
        release_zero3_params(engine, 3)


def end_of_answer_token_ids(tokenizer, eot_token: str | None = None) -> tuple:
    """The tokens that end an answer: EOS, and ``eot_token`` (``--eot_token`` when ``--add_eot_token`` added it
    as a special token) if the tokenizer knows it.

    Both: a model trained to end answers with the EOT token may still emit its EOS first, and the answer
    (its masks, and the token the reward model scores) must end there, where generation stops.
    """
    eos = int(tokenizer.eos_token_id)
    if eot_token is not None:
        ids = tokenizer.convert_tokens_to_ids([eot_token])
        if ids and ids[0] is not None and ids[0] != tokenizer.unk_token_id and int(ids[0]) != eos:
            return (int(ids[0]), eos)
    return (eos,)


# DeepSpeed-Chat's name for the trainer with unsupervised (PTX) mixing: one class does both here
DeepSpeedPPOTrainerUnsupervised = DeepSpeedPPOTrainer
