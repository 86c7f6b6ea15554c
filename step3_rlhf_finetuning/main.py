#!/usr/bin/env python
"""Step 3: RLHF fine-tuning of the step-1 actor with PPO against the step-2 reward model.

    deepspeed main.py --actor_model_name_or_path out/actor --critic_model_name_or_path out/reward ...
    python main.py --actor_model_name_or_path out/actor --critic_model_name_or_path out/reward \\
        --data_path builtin/preference --output_dir out/step3 --max_prompt_seq_len 32 --max_answer_seq_len 24

parse → distributed set-up → tokenizer → phase-3 prompts (+ unsupervised text) →
:class:`DeepSpeedRLHFEngine` (actor, ref, EMA, critic, reward) → for every
``--generation_batches`` prompt batches: generate experience, then ``--ppo_epochs`` of
PPO (+ LM loss on the unsupervised text, + EMA update) → save ``actor/``, ``critic/``
and ``actor_ema/`` under ``--output_dir``. Sequence lengths are ``--max_prompt_seq_len``
and ``--max_answer_seq_len`` (the shared ``--max_seq_len`` is not used here).

With ``--save_interval N`` a resumable checkpoint is written every N PPO steps (actor
and critic engines, the EMA actor, RNG states, prompt position, reward EMA, history);
rerunning the command resumes from it (:mod:`utils.checkpoint`; DeepSpeed-Chat has no
step-3 resume).
"""
import argparse
import math
import os
import random
import time

import torch

from step3_rlhf_finetuning.config import Step3Config
from step3_rlhf_finetuning.ppo_trainer import (DeepSpeedPPOTrainer, DeepSpeedPPOTrainerUnsupervised,
                                               ExponentialMovingAverage, MiniDataset, summarize_experience)
from step3_rlhf_finetuning.rlhf_engine import DeepSpeedRLHFEngine
from utils.arguments import (HelpFormatter, add_checkpoint_args, add_data_args, add_deepspeed_args, add_logging_args,
                             add_num_padding_arg, add_offload_reference_arg, add_only_optimize_lora_arg,
                             add_rlhf_role_args, add_run_args, add_sampling_args, add_trust_remote_code_arg,
                             check_sampling_args, validate_common)
from utils.checkpoint import CheckpointManager, ModuleState, resumable_loader
from utils.compat import check_zero_combination
from utils.data.data_utils import DataCollatorRLHF, create_prompt_dataset
from utils.data.unsupervised import get_unsupervised_data
from utils.distributed import get_all_reduce_mean, get_world_size
from utils.entrypoint import run_main
from utils.errors import UserInputError, check_finite
from utils.generation import BACKENDS
from utils.model.critic import save_reward_model
from utils.model.model_utils import save_hf_format
from utils.perf import count_parameters, model_shape, step3_throughput, throughput_due, throughput_lines
from utils.preflight import preflight
from utils.runtime import to_device
from utils.summary import head_tail_window
from utils.training import load_tokenizer, start_run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        description="Step 3: RLHF fine-tuning (PPO) of the step-1 actor against the step-2 reward model.")
    add_data_args(parser)
    g = parser.add_argument_group("step 3 data")
    g.add_argument("--unsupervised_dataset_name", type=str, default=None,
                   help="Text mixed into the actor's training (InstructGPT's PPO-ptx): a local .txt file or "
                        "folder of .txt files, a .json/.jsonl/.parquet/.csv file, or a hub dataset name.")
    g.add_argument("--unsupervised_dataset_config_name", type=str, default=None,
                   help="Configuration of a hub --unsupervised_dataset_name (e.g. wikitext-2-raw-v1).")
    g.add_argument("--unsup_coef", type=float, default=27.8, help="γ of InstructGPT's Eq. 2: weight of the LM loss.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None,
                   help="Accepted for compatibility (tokenisation here is one batched pass).")
    g.add_argument("--max_prompt_seq_len", type=int, default=256,
                   help="Prompts are left-padded to this; longer prompts are dropped (with a count).")
    g.add_argument("--max_answer_seq_len", type=int, default=256, help="Tokens generated per answer (at most).")

    g = parser.add_argument_group("models")
    g.add_argument("--actor_model_name_or_path", type=str, required=True, help="Step-1 output (or any causal LM).")
    g.add_argument("--critic_model_name_or_path", type=str, required=True,
                   help="Step-2 output folder: initialises both critic and reward model.")
    add_num_padding_arg(g)
    g.add_argument("--allow_vocab_mismatch", action="store_true",
                   help="Run even when the actor's and the reward model's tokenizers differ (the reward model "
                        "then reads the actor's token ids as its own; refused by default).")
    add_trust_remote_code_arg(g)
    add_rlhf_role_args(parser, "actor", learning_rate=9.65e-6)
    add_rlhf_role_args(parser, "critic", learning_rate=5e-6)

    g = parser.add_argument_group("PPO")
    g.add_argument("--per_device_generation_batch_size", type=int, default=16, help="Prompts per generation batch.")
    g.add_argument("--per_device_training_batch_size", type=int, default=16, help="Micro batch of PPO training.")
    g.add_argument("--generation_batches", type=int, default=1,
                   help="Generation batches collected before each round of PPO training.")
    g.add_argument("--ppo_epochs", type=int, default=1, help="Passes of PPO training over each round's experience.")
    add_run_args(g, unit="PPO steps", output="actor/, critic/ and actor_ema/ are")
    g.add_argument("--kl_ctl", type=float, default=0.1, help="KL penalty coefficient β.")
    g.add_argument("--clip_reward_value", type=float, default=5.0, help="Reward-model scores are clipped to ±this.")
    g.add_argument("--cliprange", type=float, default=0.2, help="PPO ratio clip ε of the actor loss.")
    g.add_argument("--cliprange_value", type=float, default=0.2, help="Value clip of the critic loss.")
    g.add_argument("--gamma", type=float, default=1.0, help="Discount γ.")
    g.add_argument("--lam", type=float, default=0.95, help="GAE λ.")
    add_only_optimize_lora_arg(g)
    g.add_argument("--enable_ema", action="store_true", help="Keep (and save) an EMA copy of the actor (β = 0.992).")
    g.add_argument("--enable_mixed_precision_lora", action="store_true",
                   help="Mixed-precision ZeRO++ for LoRA (needs --actor_lora_dim > 0 and --actor_zero_stage 3).")
    g.add_argument("--align_overflow", action="store_true",
                   help="fp16: skip both actor and critic steps when either overflows.")

    g = parser.add_argument_group("generation")
    add_sampling_args(g)
    g.add_argument("--generation_backend", default="auto", choices=BACKENDS,
                   help="How the actor generates: cuda-graph (static KV cache, decode step replayed as a CUDA "
                        "graph), static (same cache, eager), hf (model.generate); auto = cuda-graph on a GPU, hf on "
                        "CPU. Falls back to hf, saying why, for ZeRO-3 and unchecked architectures.")
    g.add_argument("--print_answers", action="store_true", help="Print prompts and answers during training.")
    g.add_argument("--print_answers_interval", type=int, default=1, help="... every this many generation batches.")

    add_deepspeed_args(parser)
    g = parser.add_argument_group("hybrid engine and offload")
    g.add_argument("--enable_hybrid_engine", action="store_true",
                   help="DeepSpeed hybrid engine for the actor's generation, where DeepSpeed has an inference policy "
                        "for its layers (none for OPT/Llama under transformers 5: step 3 says so and uses "
                        "--generation_backend).")
    g.add_argument("--unpin_actor_parameters", action="store_true",
                   help="Hybrid engine: unpin the actor's parameters during generation (less memory, slower).")
    g.add_argument("--release_inference_cache", action="store_true",
                   help="Hybrid engine: release the inference cache after generation.")
    g.add_argument("--inference_tp_size", type=int, default=1,
                   help="Hybrid engine: tensor-parallel degree of generation (needs --actor_zero_stage 3).")
    g.add_argument("--tp_gather_partition_size", type=int, default=8,
                   help="Hybrid engine: layers gathered at a time for tensor-parallel generation.")
    add_offload_reference_arg(g)
    g.add_argument("--offload_reward_model", action="store_true", help="ZeRO-Offload the reward model.")
    add_logging_args(parser, tensorboard_path="step3_tensorboard")
    add_checkpoint_args(parser, unit="PPO steps")
    parser.set_defaults(num_warmup_steps=100)
    return parser.parse_args(argv)


def validate_step3(args) -> None:
    """DeepSpeed-Chat's step-3 checks (and a few more), as clear errors before anything is built."""
    validate_common(args)
    for name in ("per_device_generation_batch_size", "per_device_training_batch_size", "generation_batches",
                 "ppo_epochs", "max_prompt_seq_len", "max_answer_seq_len", "print_answers_interval",
                 "inference_tp_size"):
        if getattr(args, name) < 1:
            raise UserInputError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    if args.inference_tp_size > 1 and args.actor_zero_stage != 3:
        raise UserInputError("--inference_tp_size > 1 needs --actor_zero_stage 3 "
                             "(tensor sharding in the hybrid engine)")
    if args.inference_tp_size > 1 and not args.enable_hybrid_engine:
        raise UserInputError("--inference_tp_size > 1 needs --enable_hybrid_engine")
    if (args.actor_zero_stage == 2 and args.critic_zero_stage == 2 and args.enable_hybrid_engine and args.offload
            and args.actor_lora_dim == 0):
        raise UserInputError("actor and critic ZeRO-2 + --enable_hybrid_engine + --offload without LoRA is "
                             "unsupported (training instability, as in DeepSpeed-Chat); use LoRA or another stage")
    if args.enable_mixed_precision_lora and (args.actor_lora_dim <= 0 or args.actor_zero_stage != 3):
        raise UserInputError("--enable_mixed_precision_lora needs --actor_lora_dim > 0 and --actor_zero_stage 3")
    if args.only_optimize_lora and args.actor_lora_dim <= 0 and args.critic_lora_dim <= 0:
        raise UserInputError("--only_optimize_lora needs --actor_lora_dim > 0 or --critic_lora_dim > 0")
    if args.unsupervised_dataset_config_name and not args.unsupervised_dataset_name:
        raise UserInputError("--unsupervised_dataset_config_name needs --unsupervised_dataset_name")
    if not math.isfinite(args.unsup_coef):
        raise UserInputError(f"--unsup_coef must be finite, got {args.unsup_coef}")
    check_sampling_args(args)
    for name in ("kl_ctl", "clip_reward_value", "cliprange", "cliprange_value", "gamma", "lam"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            raise UserInputError(f"--{name} must be a finite number ≥ 0, got {getattr(args, name)}")


def create_datasets(args, tokenizer, log):
    """(prompt loader, unsupervised loader or None, PPO steps, total optimizer steps of each model)."""
    prompts, _ = create_prompt_dataset(args.local_rank, args.data_path, args.data_split, args.data_output_path, 3,
                                       args.seed, tokenizer, args.max_prompt_seq_len,
                                       end_of_conversation_token=args.eot_token, log=log.info)

    # shuffled per (seed, epoch); a checkpoint restores their position
    prompt_loader = resumable_loader(prompts, args.per_device_generation_batch_size, args.seed,
                                     collate_fn=DataCollatorRLHF(args.max_prompt_seq_len, tokenizer.pad_token_id))
    batches = len(prompt_loader)
    unsup_loader = None
    if args.unsupervised_dataset_name:
        text = get_unsupervised_data(args.unsupervised_dataset_name, args.unsupervised_dataset_config_name, tokenizer,
                                     args.max_prompt_seq_len + args.max_answer_seq_len, log=log.info)
        unsup_loader = resumable_loader(text, args.per_device_generation_batch_size, args.seed, drop_last=True)
        batches = min(batches, len(unsup_loader))
        if batches == 0:
            raise UserInputError(f"--unsupervised_dataset_name {args.unsupervised_dataset_name}: {len(text)} "
                                 f"blocks, fewer than one batch of {args.per_device_generation_batch_size}")
    steps_per_epoch = batches // args.generation_batches
    if steps_per_epoch == 0:
        raise UserInputError(f"{len(prompts)} phase-3 prompts per rank give {batches} generation batches, fewer than "
                             f"--generation_batches {args.generation_batches}")
    ppo_steps = args.num_train_epochs * steps_per_epoch
    if args.max_steps:
        ppo_steps = min(ppo_steps, args.max_steps)
    micro_batches = math.ceil(args.per_device_generation_batch_size * args.generation_batches
                              / args.per_device_training_batch_size)
    total_iters = max(1, math.ceil(ppo_steps * micro_batches * args.ppo_epochs / args.gradient_accumulation_steps))
    return prompt_loader, unsup_loader, ppo_steps, total_iters


def epoch_batches(batches: int, args, ppo_step: int) -> int:
    """Generation batches the epoch's progress bar counts: ``--max_steps`` can end the epoch early."""
    if args.max_steps:
        return max(0, min(batches, (args.max_steps - ppo_step) * args.generation_batches))
    return batches


def parameter_checksum(engine, zero_stage: int) -> float:
    """Σ|θ| + Σθ² over a model's parameters (float64; ZeRO-3 partitions summed across ranks)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in engine.module.parameters():
        data = p.ds_tensor if zero_stage == 3 and hasattr(p, "ds_tensor") else p
        data = data.detach().double().cpu()
        total += data.abs().sum() + data.pow(2).sum()
    if zero_stage == 3 and torch.distributed.is_initialized():
        total = total.to(next(engine.module.parameters()).device)
        torch.distributed.all_reduce(total)
    return float(total)


def train_on_experience(trainer, exp_dataset, unsup_dataset, ppo_epochs: int) -> dict:
    """``ppo_epochs`` passes over one round's micro-batches; mean losses and trained-row counts (this rank)."""
    actor_sum = critic_sum = unsup_sum = 0.0
    iters = actor_rows = critic_rows = 0
    paired = unsup_dataset if unsup_dataset is not None else [None] * len(exp_dataset)
    for _ in range(ppo_epochs):
        for exp, unsup in zip(exp_dataset, paired):
            actor_loss, critic_loss = trainer.train_rlhf(exp)
            actor_sum, critic_sum = actor_sum + actor_loss.item(), critic_sum + critic_loss.item()
            rows = exp["input_ids"].shape[0]
            actor_rows, critic_rows = actor_rows + rows, critic_rows + rows
            if unsup is not None:
                unsup_sum += trainer.train_unsupervised(unsup).item()
                actor_rows += unsup["input_ids"].shape[0]
            trainer.update_ema()
            iters += 1
        random.shuffle(exp_dataset)
        if unsup_dataset is not None:
            random.shuffle(unsup_dataset)
    return {"actor_loss": actor_sum / iters, "critic_loss": critic_sum / iters, "unsup_loss": unsup_sum / iters,
            "actor_rows": actor_rows, "critic_rows": critic_rows}


def all_reduce_stats(stats: dict, losses: dict) -> dict:
    """Rank-averaged step metrics from per-rank experience sums and losses."""
    from utils.distributed import get_all_reduce_mean

    keys = ("kept", "reward_sum", "kl_sum", "answer_len_sum")
    values = torch.tensor([float(stats[k]) for k in keys] + [losses["actor_loss"], losses["critic_loss"],
                                                              losses["unsup_loss"]], dtype=torch.float64)
    device = stats["kept"].device if torch.is_tensor(stats["kept"]) else "cpu"
    mean = get_all_reduce_mean(values.to(device)).cpu().tolist()
    kept, reward, kl, length, actor, critic, unsup = mean
    kept = max(kept, 1e-12)
    return {"reward": reward / kept, "kl": kl / kept, "answer_len": length / kept, "actor_loss": actor,
            "critic_loss": critic, "unsup_loss": unsup}


def throughput_constants(config, engine) -> dict:
    """FLOP factors (4 with activation checkpointing, reduced by LoRA as in the reference) and model sizes."""
    constants = {"bytes_per_param": 4 if config.dtype == "fp32" else 2}
    for name, role, model in (("actor", config.actor, engine.actor.module), ("critic", config.critic,
                                                                             engine.critic.module)):
        factor = 4.0 if role.gradient_checkpointing else 3.0
        if role.lora_dim > 0:
            factor -= 1 - 2 * role.lora_dim / model_shape(model.config)[1]
        constants.update({f"{name}_factor": factor, f"{name}_params": count_parameters(model)})
    return constants


def _add_stats(total: dict | None, new: dict) -> dict:
    return dict(new) if total is None else {k: total[k] + new[k] for k in total}


def main(args):
    # ---- fail fast on bad flags, model folders and data, before any set-up
    validate_step3(args)
    check_zero_combination(args)
    preflight(args, causal_lms={"--actor_model_name_or_path": args.actor_model_name_or_path},
              reward_models={"--critic_model_name_or_path": args.critic_model_name_or_path}, phase=3,
              length=(args.max_prompt_seq_len + args.max_answer_seq_len,
                      "--max_prompt_seq_len + --max_answer_seq_len"))

    # ---- set-up: distributed, precision, seed, logger; the configuration of engines, PPO and generation
    device, log = start_run(args, "step3_model")
    config = Step3Config.from_args(args)
    if args.align_overflow and not config.ppo.align_overflow:
        log.warning(f"--align_overflow only matters with --dtype fp16 (now {args.dtype}); ignored")

    # ---- tokenizer, data, models
    tokenizer = load_tokenizer(args, args.actor_model_name_or_path)
    prompt_loader, unsup_loader, ppo_steps, total_iters = create_datasets(args, tokenizer, log)
    mixing = config.unsupervised
    engine = DeepSpeedRLHFEngine(config.engine, tokenizer, num_total_iters=total_iters)
    trainer = (DeepSpeedPPOTrainerUnsupervised if mixing else DeepSpeedPPOTrainer)(engine, config.ppo,
                                                                                   config.generation, log.info)
    ref_checksum = parameter_checksum(engine.ref, config.engine.actor.zero_stage)
    exp_mini = MiniDataset(args.generation_batches, args.per_device_training_batch_size)
    unsup_mini = MiniDataset(args.generation_batches, args.per_device_training_batch_size)

    perf_constants = throughput_constants(config.engine, engine)
    ema_reward = ExponentialMovingAverage()
    history, ppo_step, gen_step, dropped_logged = [], 0, 0, 0
    start_epoch, skip_batches = 0, 0
    stats = timing = None

    # ---- resume (automatic when --output_dir holds a valid checkpoint); the reference model is never
    # trained, so it is rebuilt from the step-1 folder instead of being saved
    ckpt = CheckpointManager.from_args(args, log)
    engines = {"actor": engine.actor, "critic": engine.critic}
    if engine.actor_ema is not None:
        engines["actor_ema"] = ModuleState(engine.actor_ema)
    resumed = ckpt.resume(engines)
    if resumed:
        start_epoch, skip_batches = resumed["epoch"], resumed["batches_in_epoch"]
        ppo_step, gen_step, history = resumed["ppo_step"], resumed["gen_step"], resumed["history"]
        ema_reward.ema, dropped_logged = resumed["ema_reward"], resumed["dropped_logged"]
        trainer.dropped_total = resumed["dropped_total"]
        exp_mini.dataset, unsup_mini.dataset = resumed["exp_mini"], resumed["unsup_mini"]
        stats, timing = resumed["stats"], resumed["timing"]

    def trainer_state(epoch: int, batches_in_epoch: int) -> dict:
        """What a resumed run needs besides the engines and RNGs (tensors, numbers and lists only)."""
        return {"epoch": epoch, "batches_in_epoch": batches_in_epoch, "ppo_step": ppo_step, "gen_step": gen_step,
                "history": history, "ema_reward": ema_reward.ema, "dropped_logged": dropped_logged,
                "dropped_total": trainer.dropped_total, "exp_mini": exp_mini.dataset,
                "unsup_mini": unsup_mini.dataset, "stats": stats, "timing": timing}

    # ---- train
    log.info(f"***** Running PPO: {ppo_steps} PPO steps, {total_iters} optimizer steps per model, "
             f"unsupervised mixing {'on' if mixing else 'off'} *****")
    for epoch in range(start_epoch, args.num_train_epochs):
        if args.max_steps and ppo_step >= args.max_steps:
            break
        skip = skip_batches if epoch == start_epoch else 0
        for loader in (prompt_loader, unsup_loader):
            if loader is not None:
                loader.sampler.set_epoch(epoch, skip_batches=skip, batch_size=loader.batch_size)
        batches = zip(prompt_loader, unsup_loader) if mixing else ((b, None) for b in prompt_loader)
        total = epoch_batches(min(len(prompt_loader), len(unsup_loader)) if mixing else len(prompt_loader),
                              args, ppo_step)
        for batch_in_epoch, (batch_prompt, batch_unsup) in enumerate(
                log.progress(batches, desc=f"step3 epoch {epoch + 1}", total=total), start=skip + 1):
            gen_step += 1
            batch_prompt = to_device(batch_prompt, device)
            exp = trainer.generate_experience(batch_prompt["prompt"], batch_prompt["prompt_att_mask"], gen_step)
            step_time = {"experience": trainer.experience_time, "generate": trainer.generate_time,
                         "tokens": trainer.generated_tokens, "sequences": batch_prompt["prompt"].shape[0]}
            timing = _add_stats(timing, step_time)
            if exp is None:
                log.warning(f"generation batch {gen_step}: every answer had ≤ 1 token; skipped "
                            f"({trainer.dropped_total} answers dropped so far)")
                continue
            stats = _add_stats(stats, summarize_experience(exp))
            exp_dataset = exp_mini.add(exp)
            unsup_dataset = unsup_mini.add(to_device(batch_unsup, device)) if mixing else None
            if exp_dataset is None:
                continue

            # ---- one PPO step on the collected experience
            ppo_step += 1
            train_start = time.time()
            losses = train_on_experience(trainer, exp_dataset, unsup_dataset, config.ppo.ppo_epochs)
            train_time = time.time() - train_start
            metrics = all_reduce_stats(stats, losses)
            check_finite(ppo_step, actor_loss=metrics["actor_loss"], critic_loss=metrics["critic_loss"],
                         unsupervised_loss=metrics["unsup_loss"], average_reward=metrics["reward"], kl=metrics["kl"])
            metrics["ema_reward"] = ema_reward.update(metrics["reward"])
            metrics["dropped"], dropped_logged = trainer.dropped_total - dropped_logged, trainer.dropped_total
            metrics["dropped_total"] = trainer.dropped_total
            perf = step3_throughput(
                engine.actor.module.config, engine.critic.module.config, experience_time=timing["experience"],
                generate_time=timing["generate"], train_time=train_time, sequences=timing["sequences"],
                seq_length=args.max_prompt_seq_len + args.max_answer_seq_len, answer_length=args.max_answer_seq_len,
                generated_tokens=timing["tokens"] // args.generation_batches,
                actor_train_samples=losses["actor_rows"], critic_train_samples=losses["critic_rows"],
                world_size=get_world_size(), **perf_constants)
            history.append(metrics)
            log.info(f"Epoch: {epoch} | Step: {ppo_step} | Actor Loss: {metrics['actor_loss']:.4f} | "
                     f"Critic Loss: {metrics['critic_loss']:.4f} | Unsupervised Loss: {metrics['unsup_loss']:.4f} | "
                     f"Average reward: {metrics['reward']:.4f} | EMA reward: {metrics['ema_reward']:.4f} | "
                     f"KL: {metrics['kl']:.4f} | answer length: {metrics['answer_len']:.1f} | "
                     f"dropped: {metrics['dropped']:.0f}")
            if throughput_due(ppo_step, ppo_steps):
                for line in throughput_lines(perf):
                    log.info(line)
            log.scalars(ppo_step, "train", **metrics, actor_lr=engine.actor.get_lr()[0],
                        critic_lr=engine.critic.get_lr()[0],
                        **{k: perf[k] for k in ("e2e_latency", "gen_latency", "train_latency", "e2e_tflops",
                                                "gen_tflops", "train_tflops", "samples_per_sec",
                                                "gen_tokens_per_sec")})
            stats = timing = None
            ckpt.step_done(ppo_step, engines, lambda: trainer_state(epoch, batch_in_epoch))
            if args.max_steps and ppo_step >= args.max_steps:
                break

    # ---- summary
    ref_unchanged = parameter_checksum(engine.ref, config.engine.actor.zero_stage) == ref_checksum
    result = {"steps": ppo_step, "dropped_total": trainer.dropped_total, "ref_unchanged": ref_unchanged}
    if history:
        first, last = history[0], history[-1]
        n = head_tail_window(len(history))  # the summary's rule: one reward pair in the log and the summary
        head, tail = (sum(m["reward"] for m in part) / n for part in (history[:n], history[-n:]))
        log.info(f"average reward: mean of the first {n} steps {head:.4f} -> of the last {n} steps {tail:.4f}")
        log.info(f"mean KL to the reference at the last step: {last['kl']:.4f}; reference model unchanged: "
                 f"{ref_unchanged}")
        result.update(reward_start=first["reward"], reward_end=last["reward"], reward_ema=last["ema_reward"],
                      reward_start_mean=head, reward_end_mean=tail,
                      kl_end=last["kl"], actor_loss=last["actor_loss"], critic_loss=last["critic_loss"],
                      unsup_loss=last["unsup_loss"])
    else:
        log.warning("no PPO step ran (every generated answer was dropped); the models are unchanged")
    log.scalars(ppo_step, "final", ref_unchanged=float(ref_unchanged), dropped_total=trainer.dropped_total,
                reward_start=result.get("reward_start"), reward_end=result.get("reward_end"),
                reward_start_mean=result.get("reward_start_mean"), reward_end_mean=result.get("reward_end_mean"))

    # ---- save
    if args.output_dir is not None:
        log.info(f"saving actor/, critic/{' and actor_ema/' if engine.actor_ema else ''} to {args.output_dir}")
        save_hf_format(engine.actor, tokenizer, os.path.join(args.output_dir, "actor"), args.actor_zero_stage)
        save_reward_model(engine.critic, tokenizer, os.path.join(args.output_dir, "critic"), args.critic_zero_stage)
        if engine.actor_ema is not None:
            save_hf_format(engine.actor_ema, tokenizer, os.path.join(args.output_dir, "actor_ema"),
                           args.actor_zero_stage)
    log.close()
    return result


if __name__ == "__main__":
    run_main(main, parse_args())
