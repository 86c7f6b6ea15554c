"""Step 3's numbers: what one RL step measured, how it is reduced over the ranks, logged and kept, and the run's
summary.

Three records: :class:`PolicyStats` (the actor's ratio, clip fractions and entropy, summed over the micro-batches a
round trains), :class:`TrainStats` (what :meth:`~step3_rlhf_finetuning.ppo_trainer.DeepSpeedPPOTrainer.optimise`
returns: mean losses, rows trained, the policy statistics) and :class:`Progress` (where the loop is and every step's
metrics; a checkpoint saves it). :class:`StepReporter` turns a step's rollout and :class:`TrainStats` into the step's
metrics, all-reduced over the ranks, and writes them to the console, tensorboard and ``metrics.jsonl``.

The step's metrics (docs/outputs.md): ``reward``, ``answer_len``, ``truncated``, ``kl`` (k3, with a reference
model) over the kept answers; the mean of each loss (``actor_loss``, ``critic_loss``, ``kl_loss``, ``unsup_loss``);
``ema_reward``, ``dropped``, ``dropped_total``; ``--dynamic_sampling``'s group counts; and over the counted answer
tokens of every micro-batch trained (:func:`utils.rl_math.ratio_clip_sums`, :func:`utils.rl_math.token_entropy`):
``clip_frac_low``, ``clip_frac_high``, ``ratio_mean``, ``ratio_max``, ``entropy``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from utils.distributed import get_all_reduce_mean, get_world_size
from utils.finite import check_finite
from utils.perf import count_parameters, model_shape, step3_throughput, throughput_due, throughput_lines
from utils.rl_math import approx_kl
from utils.summary import head_tail_window

POLICY_METRICS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "entropy")


def reward_ema(ema: Optional[float], value: float, alpha: float = 0.9) -> float:
    """The reference's reward EMA after ``value``: ``α·ema + (1−α)·value`` (``ema`` None: the first value)."""
    prev = value if ema is None else ema
    return alpha * prev + (1.0 - alpha) * value


@dataclass
class PolicyStats:
    """Sums over the counted answer tokens (action mask 1) of the actor micro-batches a round trained, this rank's:
    :func:`utils.rl_math.ratio_clip_sums`'s five and the entropy's sum. :meth:`metrics` divides them by ``tokens``."""
    tokens: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    entropy_sum: float = 0.0
    batches: int = 0  # micro-batches added

    def add(self, sums: dict, entropy_sum: torch.Tensor) -> None:
        """One micro-batch: ``sums`` from :func:`utils.rl_math.ratio_clip_sums`, ``entropy_sum`` = Σ mask·H."""
        values = torch.stack([sums[k] for k in ("tokens", "clip_low", "clip_high", "ratio_sum", "ratio_max")]
                             + [entropy_sum.double()]).cpu().tolist()
        tokens, low, high, ratio_sum, ratio_max, entropy = values
        self.tokens += tokens
        self.clip_low += low
        self.clip_high += high
        self.ratio_sum += ratio_sum
        self.ratio_max = max(self.ratio_max, ratio_max)
        self.entropy_sum += entropy
        self.batches += 1

    def metrics(self, sums: Optional[dict] = None) -> dict:
        """``{clip_frac_low, clip_frac_high, ratio_mean, ratio_max, entropy}`` of these sums (or of ``sums``, the
        same names reduced over the ranks); 0 without a counted token."""
        s = sums or {name: getattr(self, name) for name in ("tokens", "clip_low", "clip_high", "ratio_sum",
                                                             "ratio_max", "entropy_sum")}
        tokens = max(s["tokens"], 1e-12)
        return {"clip_frac_low": s["clip_low"] / tokens, "clip_frac_high": s["clip_high"] / tokens,
                "ratio_mean": s["ratio_sum"] / tokens, "ratio_max": s["ratio_max"],
                "entropy": s["entropy_sum"] / tokens}


@dataclass
class TrainStats:
    """One round's optimisation, this rank's: the mean of each loss over the micro-batches trained now (none when
    all wait for their optimizer step's others), the rows each model trained on, the micro-batches left waiting, and
    the actor's :class:`PolicyStats`."""
    losses: dict = field(default_factory=dict)  # actor_loss, critic_loss (gae), kl_loss, unsup_loss: floats
    actor_rows: int = 0
    critic_rows: int = 0
    waiting: int = 0
    policy: PolicyStats = field(default_factory=PolicyStats)


def summarize_rollout(rollout) -> dict:
    """Per-rank sums over kept answers for logging: count, reward, answer length, answers cut at the length cap,
    (with a reference model) KL (k3: never negative) and (with ``--overlong_penalty``) the reward before the
    penalty."""
    valid = rollout.valid.float()
    sums = {"kept": valid.sum(), "reward_sum": (rollout.scores.float() * valid).sum(),
            "answer_len_sum": (rollout.answer_len.float() * valid).sum()}
    if rollout.task_scores is not None:
        sums["task_reward_sum"] = (rollout.task_scores.float() * valid).sum()
    if rollout.truncated is not None:
        sums["truncated_sum"] = (rollout.truncated.float() * valid).sum()
    if rollout.ref_logprobs is not None:
        kl = approx_kl(rollout.logprobs, rollout.ref_logprobs, rollout.action_mask, "k3")
        sums["kl_sum"] = (kl.float() * valid).sum()
    return sums


def all_reduce_metrics(rollout, stats: TrainStats) -> dict:
    """Rank-averaged step metrics: reward, answer length, the share cut at the length cap, (with a reference
    model) KL (k3) and (with ``--overlong_penalty``) ``task_reward``, the reward before it, over the kept answers of
    every rank, the mean of each loss, and (when the actor trained) the policy
    statistics over every rank's counted tokens (``ratio_max`` the largest of any rank)."""
    sums = summarize_rollout(rollout)
    names = [k for k in ("kept", "reward_sum", "answer_len_sum", "truncated_sum", "kl_sum", "task_reward_sum")
             if k in sums]
    loss_names = sorted(name for name in stats.losses if name.endswith("_loss"))
    policy = stats.policy
    policy_names = ["tokens", "clip_low", "clip_high", "ratio_sum", "entropy_sum"] if policy.batches else []
    values = torch.stack([sums[k].double().cpu() for k in names]
                         + [torch.tensor(float(stats.losses[n]), dtype=torch.float64) for n in loss_names]
                         + [torch.tensor(float(getattr(policy, n)), dtype=torch.float64) for n in policy_names])
    device = rollout.input_ids.device
    reduced = get_all_reduce_mean(values.to(device)).cpu().tolist()
    mean = dict(zip(names + loss_names, reduced))
    kept = max(mean.pop("kept"), 1e-12)
    metrics = {key[:-len("_sum")]: mean.pop(key) / kept for key in names[1:]}
    metrics.update(mean)
    if policy_names:  # ratios of rank means are ratios of sums
        reduced_policy = dict(zip(policy_names, reduced[len(names) + len(loss_names):]))
        reduced_policy["ratio_max"] = _all_reduce_max(policy.ratio_max, device)
        metrics.update(policy.metrics(reduced_policy))
    return metrics


def _all_reduce_max(value: float, device) -> float:
    """The largest ``value`` of every rank (the value itself with one process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1:
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return float(tensor.item())
    return value


def throughput_constants(config, engine, generation_dtype: str | None = None) -> dict:
    """FLOP factors (4 with activation checkpointing, reduced by LoRA as in the reference), model sizes, and the
    bytes a generated token reads per actor weight (2 from a ``--generation_dtype bf16`` copy)."""
    fp32_weights = (config.dtype == "fp32" or config.autocast) and generation_dtype is None
    constants = {"bytes_per_param": 4 if fp32_weights else 2}
    for name, role, model in (("actor", config.actor, engine.actor.module),
                              ("critic", config.critic, engine.critic.module if engine.critic else None)):
        if model is None:
            continue
        factor = 4.0 if role.gradient_checkpointing else 3.0
        if role.lora_dim > 0:
            factor -= 1 - 2 * role.lora_dim / model_shape(model.config)[1]
        constants.update({f"{name}_factor": factor, f"{name}_params": count_parameters(model)})
    return constants


def algorithm_line(ppo) -> str:
    """The run's policy loss, clip range, aggregation and DAPO's pieces, for the log."""
    parts = [f"policy loss: {ppo.policy_loss} (clip 1 − {ppo.cliprange:g} … 1 + {ppo.cliprange_high:g})",
             f"loss aggregation: {ppo.loss_agg}"]
    if ppo.whiten_advantages != ppo.estimator_spec.whiten:  # --whiten_advantages against the estimator's own
        parts.append("advantages whitened over the batch" if ppo.whiten_advantages else "advantages not whitened")
    if ppo.mask_truncated_answers:
        parts.append("answers cut at the length cap masked out of the losses")
    if ppo.overlong_penalty:
        weight = "" if ppo.overlong_penalty_weight == 1.0 else f", weight {ppo.overlong_penalty_weight:g}"
        parts.append(f"overlong penalty over the last {ppo.overlong_penalty} tokens{weight}")
    if ppo.dynamic_sampling:
        parts.append(f"dynamic sampling (at most {ppo.dynamic_sampling_max_batches} generation batches a round)")
    return "; ".join(parts)


def step_line(epoch: int, step: int, metrics: dict) -> str:
    """The step's log line (DeepSpeed-Chat's, with the losses this run has, and the actor's ratio, clip fractions
    and entropy when it trained)."""
    parts = [f"Epoch: {epoch}", f"Step: {step}"]
    if "actor_loss" in metrics:
        parts.append(f"Actor Loss: {metrics['actor_loss']:.4f}")
    else:  # every micro-batch of the round waits for the next round's (WholeSteps)
        parts.append("Actor Loss: - (the round's micro-batches wait for the optimizer step's others)")
    for key, label in (("critic_loss", "Critic Loss"), ("kl_loss", "KL Loss"), ("unsup_loss", "Unsupervised Loss")):
        if key in metrics:
            parts.append(f"{label}: {metrics[key]:.4f}")
    parts += [f"Average reward: {metrics['reward']:.4f}", f"EMA reward: {metrics['ema_reward']:.4f}"]
    if "task_reward" in metrics:  # --overlong_penalty: the reward before it
        parts.append(f"before the overlong penalty: {metrics['task_reward']:.4f}")
    if "kl" in metrics:
        parts.append(f"KL: {metrics['kl']:.4f}")
    parts += [f"answer length: {metrics['answer_len']:.1f}", f"dropped: {metrics['dropped']:.0f}"]
    if "ratio_mean" in metrics:
        parts.append("ratio: mean {:.4f} max {:.4f}, clipped: low {:.3f} high {:.3f}, entropy: {:.4f}".format(
            *(metrics[k] for k in ("ratio_mean", "ratio_max", "clip_frac_low", "clip_frac_high", "entropy"))))
    if "groups_kept" in metrics:  # --dynamic_sampling
        counts = [metrics[f"groups_{name}"] for name in ("kept", "filtered", "surplus", "filled")]
        parts.append("groups kept: {:.0f} of {:.0f} in {:.0f} batches (all scoring the same: {:.0f}, surplus: {:.0f}, "
                     "filled: {:.0f})".format(counts[0], sum(counts[:3]), metrics["sampled_batches"], *counts[1:]))
    return " | ".join(parts)


@dataclass
class Progress:
    """Where the loop is, and what it logged: what a checkpoint saves besides the engines and RNGs (numbers and
    lists only). Saved right after an RL step, before any batch of the next round is drawn."""
    epoch: int = 0
    batches_in_epoch: int = 0  # generation batches of ``epoch`` consumed
    rl_step: int = 0
    gen_step: int = 0
    dropped_total: int = 0  # answers dropped so far (≤ 1 token), all ranks
    dropped_logged: int = 0
    groups_filtered_total: int = 0  # --dynamic_sampling: groups dropped as all scoring the same, all ranks
    ema_reward: float | None = None
    history: list = field(default_factory=list)  # every step's metrics

    @property
    def step(self) -> int:  # the loop's count (utils.training.epochs / epoch_batches)
        return self.rl_step

    @classmethod
    def from_checkpoint(cls, state: dict | None) -> "Progress":
        """A fresh start (``state`` None) or the saved progress (the checkpoint adds its own keys: ignored; a field an
        older checkpoint lacks keeps its default)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state}) if state else cls()


class StepReporter:
    """All-reduces, checks, logs (console, tensorboard, metrics.jsonl) and records each RL step's metrics: ``log``
    the run's TrainLogger, ``engine`` the :class:`~step3_rlhf_finetuning.rlhf_engine.DeepSpeedRLHFEngine` (its
    learning rates, its models' sizes), ``config`` its :class:`~step3_rlhf_finetuning.config.EngineConfig`,
    ``rl_steps`` the run's (when throughput is due), ``max_answer_seq_len`` the answer cap."""

    def __init__(self, log, engine, config, rl_steps: int, max_answer_seq_len: int,
                 generation_dtype: str | None = None):
        self.log, self.engine, self.rl_steps, self.max_answer_seq_len = log, engine, rl_steps, max_answer_seq_len
        self.perf_constants = throughput_constants(config, engine, generation_dtype)

    def report(self, progress: Progress, rollout, stats: TrainStats, train_time: float) -> dict:
        """One RL step: its metrics (also appended to ``progress.history``)."""
        log, engine = self.log, self.engine
        metrics = all_reduce_metrics(rollout, stats)
        check_finite(progress.rl_step, **{k: metrics[k] for k in sorted(metrics) if k.endswith("_loss") or k == "kl"},
                     average_reward=metrics["reward"])
        progress.ema_reward = reward_ema(progress.ema_reward, metrics["reward"])
        metrics.update(ema_reward=progress.ema_reward, dropped=progress.dropped_total - progress.dropped_logged,
                       dropped_total=progress.dropped_total)
        progress.dropped_logged = progress.dropped_total
        info = rollout.info
        if "groups_kept" in info:  # --dynamic_sampling's counts, every rank's (RoundCollector)
            progress.groups_filtered_total += info["groups_filtered"]
            metrics.update({key: float(info[key]) for key in ("sampled_batches", "groups_kept", "groups_filtered",
                                                              "groups_surplus", "groups_filled")},
                           groups_filtered_total=float(progress.groups_filtered_total))
        perf = step3_throughput(
            engine.actor.module.config, engine.critic.module.config if engine.critic else None,
            experience_time=info["experience"], generate_time=info["generate"], train_time=train_time,
            sequences=info["sequences"], seq_length=rollout.input_ids.shape[1], answer_length=self.max_answer_seq_len,
            generated_tokens=info["generated_tokens"] // max(info["batches"], 1),
            actor_train_samples=stats.actor_rows, critic_train_samples=stats.critic_rows,
            world_size=get_world_size(), **self.perf_constants)
        progress.history.append(metrics)
        log.info(step_line(progress.epoch, progress.rl_step, metrics))
        if throughput_due(progress.rl_step, self.rl_steps):
            for line in throughput_lines(perf):
                log.info(line)
        lrs = {f"{name}_lr": model.get_lr()[0] for name, model in (("actor", engine.actor), ("critic", engine.critic))
               if model is not None}
        log.scalars(progress.rl_step, "train", **metrics, **lrs, tokens=info["tokens"], samples=info["sequences"],
                    **{k: perf[k] for k in ("e2e_latency", "gen_latency", "train_latency", "e2e_tflops", "gen_tflops",
                                            "train_tflops", "samples_per_sec", "gen_tokens_per_sec")})
        return metrics


def summarize_run(log, progress: Progress, ref_unchanged: bool | None) -> dict:
    """The run's result (returned by step 3's ``main``, logged under ``final``): steps, reward first → last, KL
    (with a reference model; ``ref_unchanged`` None without one)."""
    history = progress.history
    result = {"steps": progress.rl_step, "dropped_total": progress.dropped_total, "ref_unchanged": ref_unchanged}
    if history:
        first, last = history[0], history[-1]
        n = head_tail_window(len(history))  # the summary's rule: one reward pair in the log and the summary
        head, tail = (sum(m["reward"] for m in part) / n for part in (history[:n], history[-n:]))
        log.info(f"average reward: mean of the first {n} steps {head:.4f} -> of the last {n} steps {tail:.4f}")
        if "kl" in last:
            log.info(f"mean KL to the reference at the last step (k3 estimate): {last['kl']:.4f}; reference model "
                     f"unchanged: {ref_unchanged}")
            result["kl_end"] = last["kl"]
        result.update(reward_start=first["reward"], reward_end=last["reward"], reward_ema=last["ema_reward"],
                      reward_start_mean=head, reward_end_mean=tail,
                      **{k: last[k] for k in ("actor_loss", "critic_loss", "kl_loss", "unsup_loss") if k in last})
    else:
        log.warning("no RL step ran (every generated answer was dropped); the models are unchanged")
    log.scalars(progress.rl_step, "final", ref_unchanged=None if ref_unchanged is None else float(ref_unchanged),
                dropped_total=progress.dropped_total,
                **{k: result.get(k) for k in ("reward_start", "reward_end", "reward_start_mean", "reward_end_mean")})
    return result


def parameter_checksum(engine, zero_stage: int) -> float | None:
    """Σ|θ| + Σθ² over a model's parameters (float64; ZeRO-3 partitions summed across ranks); None without one."""
    if engine is None:
        return None
    total = torch.zeros((), dtype=torch.float64)
    for p in engine.module.parameters():
        data = p.ds_tensor if zero_stage == 3 and hasattr(p, "ds_tensor") else p
        data = data.detach().double()  # summed where it lives: a scalar crosses to the host, not the weights
        total += (data.abs().sum() + data.pow(2).sum()).cpu()
    if zero_stage == 3 and torch.distributed.is_initialized():
        total = total.to(next(engine.module.parameters()).device)
        torch.distributed.all_reduce(total)
    return float(total)


def unchanged_actor_reason(history: list, ppo, max_answer_seq_len: int, critic: bool,
                           optimizer_steps: int, warmup_steps: int) -> str:
    """Why RL steps left the actor's weights as they were, from the steps' metrics (``history``) and the run's
    optimizer steps and ``--num_warmup_steps``, for the error."""
    if optimizer_steps == 1 and warmup_steps > 0:  # the schedule's first value is the warm-up's 0
        return (f"its one optimizer step ran at learning rate 0, the start of the --num_warmup_steps {warmup_steps} "
                "warm-up; use --num_warmup_steps 0 or more steps")
    if ppo.mask_truncated_answers and history and all(m.get("truncated", 0.0) >= 1.0 for m in history):
        return (f"every answer was cut at --max_answer_seq_len {max_answer_seq_len} and --mask_truncated_answers "
                "leaves those out of every loss; raise --max_answer_seq_len or drop --mask_truncated_answers")
    if not critic:
        return ("every advantage was 0: the answers to each prompt all scored the same; use a reward that tells them "
                "apart, more --n_samples_per_prompt, or --dynamic_sampling")
    return "no update moved a weight (a learning rate too small for the weights' precision?)"
