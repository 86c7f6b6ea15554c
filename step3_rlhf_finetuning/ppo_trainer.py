"""PPO for RLHF: generate experience with the actor, then train actor and critic on it.

All math comes from :mod:`utils.rl_math`; this module only moves tensors between the
models. Shapes: ``B`` sequences, prompt length ``P`` (left padded), answer length ``A``
(``--max_answer_seq_len``), ``T = P + A``; per-action tensors have ``T − 1`` columns
(action ``t`` emits token ``t + 1``, the first answer action is ``start = P − 1``).

One experience (a dict of batch-first tensors, so :class:`MiniDataset` can slice it):

=================  =========  ================================================================
key                shape      meaning
=================  =========  ================================================================
prompts            [B, P]     the left-padded prompts
input_ids          [B, T]     prompt + answer, right padded with the pad id
attention_mask     [B, T]     prompt mask from the collator + the answer up to its first EOS
action_mask        [B, T−1]   1 for answer actions incl. the EOS action; 0 for dropped rows
logprobs           [B, T−1]   log π_old(action) (actor, no dropout, at generation time)
ref_logprobs       [B, T−1]   log π_ref(action)
value              [B, T−1]   critic values V_old of the state before each action
rewards            [B]        reward-model score of the answer
valid              [B]        1 = kept, 0 = dropped (answer with ≤ 1 real token)
answer_len         [B]        real answer tokens (before the first EOS)
=================  =========  ================================================================

Dropped answers stay in the batch with an all-zero action mask: they add nothing to
any loss or statistic, and every rank keeps the same number of micro-batches.
"""
from __future__ import annotations

import contextlib
import time

import torch

from utils.rl_math import (actor_loss, answer_action_mask, approx_kl, causal_lm_loss, count_real_answer_tokens,
                           critic_loss, ema_update, gae_advantages_and_returns, gather_log_probs,
                           kl_penalized_rewards, sequence_action_mask)
from utils.distributed import get_all_reduce_mean, get_world_size


class MiniDataset:
    """Collects ``max_size`` large batches, then cuts them into micro-batches of ``small_batch_size``.

    ``add(batch)`` returns None until the ``max_size``-th batch arrives, then the list of
    micro-batches (and empties itself). A batch is a dict / list / tuple of batch-first
    tensors (or lists), or a single tensor.
    """

    def __init__(self, max_size: int, small_batch_size: int):
        self.dataset = []
        self.max_size = max_size
        self.small_batch_size = small_batch_size

    @staticmethod
    def _size(batch) -> int:
        if isinstance(batch, dict):
            return len(next(iter(batch.values())))
        if isinstance(batch, (list, tuple)):
            return len(batch[0])
        return len(batch)

    def _slice(self, batch, i: int):
        s = slice(i, i + self.small_batch_size)
        if isinstance(batch, dict):
            return {k: v[s] for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return [x[s] for x in batch]
        return batch[s]

    def separate(self) -> list:
        small = [self._slice(batch, i) for batch in self.dataset
                 for i in range(0, self._size(batch), self.small_batch_size)]
        self.free()
        return small

    def add(self, data):
        if len(self.dataset) >= self.max_size:
            raise ValueError("MiniDataset is full: separate() should have emptied it")
        self.dataset.append(data)
        return self.separate() if len(self.dataset) == self.max_size else None

    def free(self) -> None:
        self.dataset = []


class ExponentialMovingAverage:
    """The reference's reward EMA: ``ema ← α·ema + (1−α)·x`` (first value taken as is)."""

    def __init__(self, alpha: float = 0.9):
        self.alpha, self.ema = alpha, None

    def update(self, value: float) -> float:
        prev = value if self.ema is None else self.ema
        self.ema = self.alpha * prev + (1.0 - self.alpha) * value
        return self.ema



@contextlib.contextmanager
def deterministic(*modules):
    """Put ``modules`` in eval mode (no dropout) for the block, then restore their modes.

    Used for the experience forwards: the engines stay in train mode (so a hybrid
    engine uses its training modules, as in the reference) while dropout is off, so
    log π_old and V_old are exact.
    """
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def pad_to_length(seq: torch.Tensor, length: int, pad_token_id: int) -> torch.Tensor:
    """Right-pad ``seq [B, T]`` with ``pad_token_id`` to ``[B, length]`` (``T ≤ length``)."""
    if seq.shape[1] >= length:
        return seq[:, :length]
    pad = seq.new_full((seq.shape[0], length - seq.shape[1]), pad_token_id)
    return torch.cat([seq, pad], dim=1)


def summarize_experience(exp: dict) -> dict:
    """Per-rank sums for logging: kept rows, and reward, KL and answer-length sums over kept rows."""
    valid = exp["valid"].float()
    kl = approx_kl(exp["logprobs"], exp["ref_logprobs"], exp["action_mask"])
    return {"kept": valid.sum(), "reward_sum": (exp["rewards"].float() * valid).sum(),
            "kl_sum": (kl.float() * valid).sum(), "answer_len_sum": (exp["answer_len"].float() * valid).sum()}


class DeepSpeedPPOTrainer:
    """PPO on a :class:`~step3_rlhf_finetuning.rlhf_engine.DeepSpeedRLHFEngine` (or anything with the same fields).

    ``ppo`` (:class:`~step3_rlhf_finetuning.config.PPOConfig`) holds the update's constants, ``generation``
    (:class:`~step3_rlhf_finetuning.config.GenerationConfig`) how answers are generated.
    """

    def __init__(self, rlhf_engine, ppo, generation, log=None):
        from utils.distributed import print_rank_0

        self.log = log or print_rank_0  # main passes its TrainLogger's info
        self.rlhf_engine = rlhf_engine
        self.actor_model = rlhf_engine.actor
        self.critic_model = rlhf_engine.critic
        self.ref_model = rlhf_engine.ref
        self.reward_model = rlhf_engine.reward
        self.tokenizer = rlhf_engine.tokenizer
        self.ppo = ppo
        self.generation = generation
        self.max_answer_seq_len = generation.max_answer_seq_len
        self.pad_token_id = self.tokenizer.pad_token_id
        # the tokens that end an answer: the EOS, and --eot_token when --add_eot_token added it
        self.end_token_ids = end_of_answer_token_ids(self.tokenizer, generation.eot_token)
        self.actor_zero_stage = self.actor_model.zero_optimization_stage()
        self.z3_enabled = self.actor_zero_stage == 3
        self.hybrid_engine = getattr(rlhf_engine, "hybrid_engine_active", False)
        self.generator = self._make_generator(generation.backend)
        # log-probs are those of the distribution answers are sampled from (logits / temperature; as TRL)
        self.temperature = generation.logprob_temperature
        self.dropped_total = 0  # answers dropped so far, all ranks
        # timing of the last generate_experience call (seconds; tokens actually generated per row)
        self.generate_time = self.experience_time = 0.0
        self.generated_tokens = 0

    # ------------------------------------------------------------------ experience

    def _make_generator(self, requested: str):
        """The actor's generation path, chosen once (and said once): DeepSpeed's hybrid engine when it is
        active, else :func:`utils.generation.choose_backend` — a :class:`StaticGenerator` or None (plain
        ``generate``)."""
        from utils.generation import StaticGenerator, choose_backend

        if self.hybrid_engine:
            self.generation_backend = "hybrid-engine"
            self.log("generation: DeepSpeed hybrid engine")
            return None
        backend, why = choose_backend(requested, self.actor_model.module, self.actor_zero_stage)
        self.generation_backend = backend
        self.log(f"generation: {backend} backend" + (f" ({why})" if why else ""))
        if backend == "hf":
            return None
        return StaticGenerator(self.actor_model.module, self.generation.max_prompt_seq_len, self.max_answer_seq_len,
                               self.end_token_ids, self.pad_token_id, use_cuda_graph=backend == "cuda-graph",
                               log=self.log)

    def _generate_sequence(self, prompts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, P + A]``: the actor's answers after the prompts, right padded with the pad id."""
        gen = self.generation
        with torch.no_grad():
            if self.generator is not None:
                seq = self.generator.generate(prompts, mask, do_sample=gen.do_sample, temperature=gen.temperature,
                                              top_k=gen.top_k, top_p=gen.top_p)
            else:
                kwargs = dict(attention_mask=mask, max_new_tokens=self.max_answer_seq_len,
                              pad_token_id=self.pad_token_id, eos_token_id=list(self.end_token_ids),
                              synced_gpus=self.z3_enabled, use_cache=True, do_sample=gen.do_sample)
                if gen.do_sample:
                    kwargs.update(temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p)
                else:
                    kwargs.update(temperature=None, top_k=None, top_p=None)
                # the module's generate, as DeepSpeed-Chat: an active hybrid engine has replaced it with its own
                seq = self.actor_model.module.generate(prompts, **kwargs)
        self.generated_tokens = seq.shape[1] - prompts.shape[1]
        return pad_to_length(seq, prompts.shape[1] + self.max_answer_seq_len, self.pad_token_id)

    def _print_answers(self, prompts, answers, step: int) -> None:
        gen = self.generation
        if gen.print_answers and step % max(gen.print_answers_interval, 1) == 0:
            decode = self.tokenizer.batch_decode
            self.log(f"--- prompt --> step={step}, {decode(prompts, skip_special_tokens=True)}")
            self.log(f"--- ans    --> step={step}, {decode(answers, skip_special_tokens=True)}")

    def generate_experience(self, prompts: torch.Tensor, mask: torch.Tensor, step: int):
        """Generate answers for ``prompts [B, P]`` and score them; the experience dict (module docstring).

        Answers with ≤ 1 real token (before the first EOS) are dropped (masked out and
        counted in ``self.dropped_total``). Returns None when every answer on every rank
        was dropped: the caller skips the step.
        """
        start = time.time()
        self.eval()
        seq = self._generate_sequence(prompts, mask)
        self.generate_time = time.time() - start
        self.train()

        P = prompts.shape[1]
        answers = seq[:, P:]
        self._print_answers(prompts, answers, step)
        answer_len = count_real_answer_tokens(answers, self.end_token_ids)
        valid = (answer_len > 1).long()
        counts = get_all_reduce_mean(torch.stack([valid.sum(), (1 - valid).sum()]).double()) * get_world_size()
        kept, dropped = (int(round(c)) for c in counts.tolist())
        self.dropped_total += dropped
        if kept == 0:  # the same on every rank: all skip the step
            self.experience_time = time.time() - start
            return None

        attention_mask = torch.cat([mask.long(), answer_action_mask(answers, self.end_token_ids)], dim=1)
        action_mask = sequence_action_mask(seq, P, self.end_token_ids) * valid[:, None]
        with torch.no_grad(), deterministic(self.actor_model.module, self.critic_model.module):
            logprobs = self._action_log_probs(self.actor_model, seq, attention_mask)
            ref_logprobs = self._action_log_probs(self.ref_model, seq, attention_mask)
            reward = self.reward_model.forward_value(seq, attention_mask, prompt_length=P)["chosen_end_scores"]
            values = self.critic_model.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
        self.experience_time = time.time() - start
        return {"prompts": prompts, "input_ids": seq, "attention_mask": attention_mask, "action_mask": action_mask,
                "logprobs": logprobs, "ref_logprobs": ref_logprobs, "value": values.float().detach(),
                "rewards": reward.float().detach(), "valid": valid, "answer_len": answer_len}

    def _action_log_probs(self, model, seq: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T−1]`` log-probs of the taken actions ``seq[:, 1:]`` under ``model`` (at the sampling temperature)."""
        logits = model(seq, attention_mask=attention_mask, use_cache=False).logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return gather_log_probs(logits[:, :-1], seq[:, 1:])

    # ------------------------------------------------------------------ training

    def compute_rewards(self, exp: dict) -> torch.Tensor:
        """``[B, T−1]`` per-action rewards: −kl_ctl·(logπ_old − logπ_ref), clipped score on the last action."""
        return kl_penalized_rewards(exp["logprobs"], exp["ref_logprobs"], exp["rewards"], exp["action_mask"],
                                    self.ppo.kl_ctl, self.ppo.clip_reward_value)

    def train_rlhf(self, inputs: dict):
        """One PPO update of actor and critic on an experience micro-batch; returns (actor_loss, critic_loss)."""
        ppo = self.ppo
        seq, attention_mask, action_mask = inputs["input_ids"], inputs["attention_mask"], inputs["action_mask"]
        start = inputs["prompts"].shape[1] - 1
        old_values = inputs["value"]
        with torch.no_grad():
            rewards = self.compute_rewards(inputs)
            advantages, returns = gae_advantages_and_returns(old_values, rewards, action_mask, ppo.gamma, ppo.lam,
                                                             start)
        mask = action_mask[:, start:]

        logprobs = self._action_log_probs(self.actor_model, seq, attention_mask)
        policy_loss = actor_loss(logprobs[:, start:], inputs["logprobs"][:, start:], advantages, mask, ppo.cliprange)
        self.actor_model.backward(policy_loss)
        if not ppo.align_overflow:
            self.actor_model.step()

        values = self.critic_model.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
        value_loss = critic_loss(values[:, start:], old_values[:, start:], returns, mask, ppo.cliprange_value)
        self.critic_model.backward(value_loss)
        if ppo.align_overflow:
            self._align_overflow()
            self.actor_model.step()
        self.critic_model.step()
        return policy_loss.detach(), value_loss.detach()

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
        self.actor_model.train()
        self.critic_model.train()

    def eval(self) -> None:
        for model in (self.actor_model, self.critic_model, self.ref_model, self.reward_model):
            model.eval()


class DeepSpeedPPOTrainerUnsupervised(DeepSpeedPPOTrainer):
    """PPO plus the actor's LM loss on unsupervised text (``--unsupervised_dataset_name``)."""

    def train_unsupervised(self, inputs: dict) -> torch.Tensor:
        """One LM step of the actor on ``{"input_ids", "attention_mask", "labels"}``, weighted by
        ``ppo.unsup_coef``; returns the (unscaled) loss."""
        logits = self.actor_model(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                  use_cache=False).logits
        loss = causal_lm_loss(logits, inputs["labels"])
        self.actor_model.backward(self.ppo.unsup_coef * loss)
        self.actor_model.step()
        return loss.detach()


# ---------------------------------------------------------------------- helpers

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
