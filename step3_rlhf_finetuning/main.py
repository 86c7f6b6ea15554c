#!/usr/bin/env python
"""Step 3: RL fine-tuning of the step-1 actor: PPO against the step-2 reward model (DeepSpeed-Chat's step 3), or a
critic-free estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++) against a reward model and/or a reward function.

    deepspeed main.py --actor_model_name_or_path out/actor --critic_model_name_or_path out/reward ...
    python main.py --actor_model_name_or_path out/actor --critic_model_name_or_path out/reward \\
        --data_path builtin/preference --output_dir out/step3 --max_prompt_seq_len 32 --max_answer_seq_len 24
    python main.py --actor_model_name_or_path out/actor --advantage_estimator grpo --n_samples_per_prompt 4 \\
        --do_sample --reward_fn builtin_rule --data_path builtin/preference --output_dir out/grpo

parse → distributed set-up → tokenizer → phase-3 prompts (+ unsupervised text) →
:class:`DeepSpeedRLHFEngine` (actor, ref, EMA; critic for PPO; reward model unless a reward
function alone scores) → for every ``--generation_batches`` prompt batches: **generate**
``--n_samples_per_prompt`` answers per prompt, **score** them, estimate **advantages** on the
whole round, **optimise** for ``--ppo_epochs`` (actor, critic for PPO; + LM loss on the
unsupervised text, + EMA update) → save ``actor/`` (and ``critic/``, ``actor_ema/``) under
``--output_dir``. Sequence lengths are ``--max_prompt_seq_len`` and ``--max_answer_seq_len``
(the shared ``--max_seq_len`` is refused here). The command line and its checks: :mod:`step3_rlhf_finetuning.cli`.

With ``--save_interval N`` a resumable checkpoint is written every N RL steps (actor and critic
engines, the EMA actor, RNG states, prompt position, reward EMA, history); rerunning the
command resumes from it (:mod:`utils.checkpoint`; DeepSpeed-Chat has no step-3 resume).
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import math
import time
from dataclasses import asdict

from step3_rlhf_finetuning import cli
from step3_rlhf_finetuning.config import Step3Config
from step3_rlhf_finetuning.metrics import (Progress, StepReporter, algorithm_line, parameter_checksum,  # noqa: F401
                                           summarize_run, unchanged_actor_reason)
from step3_rlhf_finetuning.ppo_trainer import DeepSpeedPPOTrainer, old_logprobs_from_training_pass
from step3_rlhf_finetuning.rlhf_engine import DeepSpeedRLHFEngine
from step3_rlhf_finetuning.rollout import RoundCollector, WholeSteps
from utils.checkpoint import CheckpointManager, ModuleState, resumable_loader, run_inputs
from utils.data.chat_template import training_format_file
from utils.data.data_utils import DataCollatorRLHF, create_prompt_dataset
from utils.data.unsupervised import get_unsupervised_data
from utils.distributed import gather_per_rank, get_rank
from utils.entrypoint import run_main
from utils.errors import UserInputError
from utils.finite import check_weights_finite
from utils.model.critic import save_reward_model
from utils.model.model_utils import has_dropout, save_hf_format
from utils.preflight import preflight
from utils.reward_functions import check_rows, load_reward_fn
from utils.runtime import to_device
from utils.training import (answer_end_token, check_steps_ran, epoch_batches, epochs, load_tokenizer,
                            refuse_no_optimizer_step, schedule_note, start_run)

# step 3's command line lives in cli.py; the names tests, bench and train.py (step_module.validate_flags) use from here
(DEPENDENT_FLAGS, REFUSED_FLAGS, build_parser, check_flags_apply, parse_args, validate_dapo, validate_flags,
 validate_generation_dtype, validate_rl, validate_step3) = (
    cli.DEPENDENT_FLAGS, cli.REFUSED_FLAGS, cli.build_parser, cli.check_flags_apply, cli.parse_args, cli.validate_dapo,
    cli.validate_flags, cli.validate_generation_dtype, cli.validate_rl, cli.validate_step3)


def check_data(args) -> None:
    """What step 3 would refuse about its data, checked on the untokenised phase-3 rows (no model needed, so
    train.py runs it before step 1): a built-in ``--reward_fn`` whose columns the rows lack, and fewer phase-3 rows in
    all than one round's prompts on one rank (the length filter only removes more)."""
    from utils.data.data_utils import phase_prompts

    rows = phase_prompts(args.data_path, args.data_split, args.data_output_path, 3, args.seed)["train"]
    if args.reward_fn:
        check_rows(args.reward_fn, [p for p, _ in rows], [r for _, r in rows])
    needed = args.per_device_generation_batch_size * args.generation_batches
    if len(rows) < needed:
        raise UserInputError(f"--data_path {' '.join(args.data_path)}: {len(rows)} phase-3 prompt(s) (--data_split "
                             f"{args.data_split}), fewer than one round's --per_device_generation_batch_size "
                             f"{args.per_device_generation_batch_size} × --generation_batches {args.generation_batches}")


def micro_batches_per_round(args) -> int:
    """Micro-batches of the RL update in one round, on each rank."""
    answers = args.per_device_generation_batch_size * args.n_samples_per_prompt * args.generation_batches
    return math.ceil(answers / args.per_device_training_batch_size)


def unsup_batch_size(args) -> int:
    """Rows of unsupervised text in the LM step paired with each RL micro-batch (``--per_device_unsup_batch_size``;
    default ``--per_device_training_batch_size``: one row per answer, as DeepSpeed-Chat)."""
    return args.per_device_unsup_batch_size or args.per_device_training_batch_size


def unsup_rows_per_batch(args) -> int:
    """Rows of unsupervised text drawn with each generation batch: ``--per_device_unsup_batch_size`` per
    ``--per_device_training_batch_size`` answers, rounded up, so that a round's text, cut into micro-batches of
    :func:`unsup_batch_size` rows, gives every RL micro-batch its LM step (the last may be shorter, like the RL one).
    """
    answers = args.per_device_generation_batch_size * args.n_samples_per_prompt
    return math.ceil(answers * unsup_batch_size(args) / args.per_device_training_batch_size)


def create_datasets(args, tokenizer, log):
    """(prompt dataset, prompt loader, unsupervised loader or None, RL steps, total optimizer steps per model)."""
    prompts, _ = create_prompt_dataset(args.local_rank, args.data_path, args.data_split, args.data_output_path, 3,
                                       args.seed, tokenizer, args.max_prompt_seq_len,
                                       end_of_conversation_token=args.eot_token, log=log.info,
                                       apply_chat_template=args.apply_chat_template)
    # shuffled per (seed, epoch); a checkpoint restores their position
    prompt_loader = resumable_loader(prompts, args.per_device_generation_batch_size, args.seed,
                                     collate_fn=DataCollatorRLHF(args.max_prompt_seq_len, tokenizer.pad_token_id))
    batches = len(prompt_loader)
    unsup_loader = None
    if args.unsupervised_dataset_name:
        text = get_unsupervised_data(args.unsupervised_dataset_name, args.unsupervised_dataset_config_name, tokenizer,
                                     args.max_prompt_seq_len + args.max_answer_seq_len, log=log.info)
        # --per_device_unsup_batch_size blocks of text per RL micro-batch, which pair up one to one
        text_per_batch = unsup_rows_per_batch(args)
        unsup_loader = resumable_loader(text, text_per_batch, args.seed, drop_last=True)
        batches = min(batches, len(unsup_loader))
        if batches == 0:
            raise UserInputError(f"--unsupervised_dataset_name {args.unsupervised_dataset_name}: {len(text)} "
                                 f"blocks, fewer than one batch of {text_per_batch}")
    steps_per_epoch = batches // args.generation_batches
    if steps_per_epoch == 0:
        raise UserInputError(f"{len(prompts)} phase-3 prompts per rank give {batches} generation batches, fewer than "
                             f"--generation_batches {args.generation_batches}")
    rl_steps = args.num_train_epochs * steps_per_epoch
    if args.max_steps:
        rl_steps = min(rl_steps, args.max_steps)
    micro = rl_steps * micro_batches_per_round(args) * args.ppo_epochs  # RL micro-batches per rank, in all
    refuse_no_optimizer_step(micro, args.gradient_accumulation_steps,
                             f"{rl_steps} RL step(s) × {micro_batches_per_round(args)} micro-batch(es) a round × "
                             f"--ppo_epochs {args.ppo_epochs}, per rank")
    total_iters = max(1, math.ceil(micro / args.gradient_accumulation_steps))
    return prompts, prompt_loader, unsup_loader, rl_steps, total_iters


def save_models(args, engine, tokenizer, log, folder) -> None:
    """``critic/`` for PPO, ``actor_ema/`` with ``--enable_ema`` and ``actor/`` under ``--output_dir``, in the order
    the run's folder (:meth:`~utils.run_folder.RunFolder.save_final`) decides; all or none (non-finite weights)."""
    trained_in = training_format_file(args.apply_chat_template)  # chat.py answers in the training format
    saves = []  # (folder, how to save it there), in saving order
    if engine.critic is not None:
        saves.append(("critic", lambda path: save_reward_model(engine.critic, tokenizer, path,
                                                                args.critic_zero_stage)))
    if engine.actor_ema is not None:
        saves.append(("actor_ema", lambda path: save_hf_format(engine.actor_ema, tokenizer, path,
                                                                args.actor_zero_stage, trained_in)))
    saves.append(("actor", lambda path: save_hf_format(engine.actor, tokenizer, path, args.actor_zero_stage,
                                                        trained_in)))
    check_weights_finite("the step-3 models", engine.actor, engine.critic, engine.actor_ema)  # all or nothing
    log.info(f"saving {', '.join(f'{name}/' for name, _ in saves)} to {args.output_dir}")
    folder.save_final(saves)


def main(args):
    # ---- fail fast on bad flags, model folders and data, before any set-up
    validate_flags(args)
    folder = preflight(args, causal_lms={"--actor_model_name_or_path": args.actor_model_name_or_path},
                       reward_models={"--critic_model_name_or_path": args.critic_model_name_or_path}
                       if args.critic_model_name_or_path else {}, phase=3,
                       length=(args.max_prompt_seq_len + args.max_answer_seq_len,
                               "--max_prompt_seq_len + --max_answer_seq_len"))
    with folder:  # a failure before the first step leaves the folder as it was
        return run(args, folder)


def run(args, folder):
    """Set-up, RL and the final save, in the output folder ``folder`` that :func:`main` took."""
    reward_fn = load_reward_fn(args.reward_fn) if args.reward_fn else None

    # ---- set-up: distributed, precision, seed, logger; the configuration of engines, RL and generation
    device, log = start_run(args, "step3_model")
    tokenizer = load_tokenizer(args, args.actor_model_name_or_path)
    config = Step3Config.from_args(args, answer_end_token(args, tokenizer, args.actor_model_name_or_path))
    ppo, zero_stage = config.ppo, config.engine.actor.zero_stage
    if args.preprocessing_num_workers is not None:
        log.warning(f"--preprocessing_num_workers {args.preprocessing_num_workers} is not used: tokenisation here "
                    "is one batched pass (accepted for DeepSpeed-Chat's scripts)")
    if args.align_overflow and not ppo.align_overflow:
        log.warning(f"--align_overflow only matters with --dtype fp16 (now {args.dtype}); ignored")

    # ---- data (prompts, their rows for the reward function, text to mix in), models
    prompts, prompt_loader, unsup_loader, rl_steps, total_iters = create_datasets(args, tokenizer, log)
    if args.reward_fn:
        check_rows(args.reward_fn, [s["prompt"] for s in prompts.samples], [s["row"] for s in prompts.samples])
    if note := schedule_note(args.lr_scheduler_type, args.num_warmup_steps, total_iters):
        log.warning(note)
    engine = DeepSpeedRLHFEngine(config.engine, tokenizer, num_total_iters=total_iters)
    # the RL micro-batches per optimizer step (the actor's engine counts twice as many with mixing: + the LM's)
    on_policy = old_logprobs_from_training_pass(ppo, micro_batches_per_round(args), args.gradient_accumulation_steps,
                                                has_dropout(engine.actor.module))
    trainer = DeepSpeedPPOTrainer(engine, ppo, config.generation, log.info, config.reward, reward_fn, on_policy,
                                  warn=log.warning)
    ref_checksum = parameter_checksum(engine.ref, zero_stage)
    input_checksum = parameter_checksum(engine.actor, zero_stage)  # the input model's, as built
    reporter = StepReporter(log, engine, config.engine, rl_steps, args.max_answer_seq_len, config.generation.dtype)

    # ---- resume (automatic when --output_dir holds a valid checkpoint); the reference model is never
    # trained, so it is rebuilt from the step-1 folder instead of being saved
    inputs = run_inputs(prompts, actor_model_name_or_path=args.actor_model_name_or_path,
                        critic_model_name_or_path=args.critic_model_name_or_path)
    ckpt = CheckpointManager.from_args(args, log, inputs, folder)
    engines = {name: model for name, model in (("actor", engine.actor), ("critic", engine.critic)) if model}
    if engine.actor_ema is not None:
        engines["actor_ema"] = ModuleState(engine.actor_ema)
    saved = ckpt.resume(engines)
    progress = Progress.from_checkpoint(saved)
    # micro-batches waiting for the rest of their optimizer step (a step that spans rounds), saved with the checkpoint
    waiting = (saved or {}).get("waiting")  # one list per rank
    steps = WholeSteps.from_state(args.gradient_accumulation_steps, waiting[get_rank()] if waiting else None, device)

    # ---- train: experience -> collect a round -> advantages -> optimise -> report (and checkpoint)
    log.info(f"***** Running RL ({ppo.advantage_estimator}{', critic-free' if engine.critic is None else ''}, "
             f"{ppo.n_samples_per_prompt} answer(s) per prompt): {rl_steps} RL steps, {total_iters} optimizer steps "
             f"per model, unsupervised mixing "
             f"{f'on ({unsup_batch_size(args)} text rows a micro-batch)' if config.unsupervised else 'off'} *****")
    log.info(algorithm_line(ppo))
    rounds = RoundCollector(ppo, args.per_device_generation_batch_size, log=log.warning)
    for epoch in epochs(progress, args):
        for batch, text in epoch_batches((prompt_loader, unsup_loader), progress, args, log, f"step3 epoch {epoch + 1}",
                                         args.generation_batches):
            progress.gen_step += 1
            rollout = trainer.experience(to_device(batch, device), progress.gen_step)
            progress.dropped_total += rollout.info["dropped"]
            ready = rounds.collect(rollout, to_device(text, device) if text is not None else None)
            if ready is None:  # --generation_batches batches (with --dynamic_sampling: their groups) not there yet
                continue
            round_, texts = ready
            trainer.compute_advantages(round_)  # on the whole round: every group (and REINFORCE++'s batch) intact
            progress.rl_step += 1
            train_start = time.time()
            stats = trainer.optimise(round_, texts, steps, args.per_device_training_batch_size, unsup_batch_size(args))
            reporter.report(progress, round_, stats, time.time() - train_start)
            ckpt.step_done(progress.rl_step, engines,
                           lambda: dict(asdict(progress), waiting=gather_per_rank(steps.state())))
    if steps.waiting:
        log.info(f"{len(steps.waiting)} micro-batch(es) of the last round(s) make no whole optimizer step of "
                 f"--gradient_accumulation_steps {args.gradient_accumulation_steps} and were not trained (DeepSpeed "
                 "steps no unfinished accumulation)")

    # ---- summary and save (not when no RL step ran: the models would be their inputs)
    check_steps_ran("RL step", progress.rl_step, rl_steps, [engine.actor, engine.critic],
                    why=f"{progress.dropped_total} answers had ≤ 1 token and were dropped"
                    + (", and --dynamic_sampling found no group with different scores" if ppo.dynamic_sampling else ""))
    if parameter_checksum(engine.actor, zero_stage) == input_checksum:  # rule: no empty success
        raise UserInputError(f"{progress.rl_step} RL step(s) ran but the actor is the input model, weight for weight ("
                             + unchanged_actor_reason(progress.history, ppo, args.max_answer_seq_len,
                                                      engine.critic is not None, total_iters, args.num_warmup_steps)
                             + "); nothing is saved")
    ref_unchanged = None if engine.ref is None else parameter_checksum(engine.ref, zero_stage) == ref_checksum
    result = summarize_run(log, progress, ref_unchanged)
    if args.output_dir is not None:
        save_models(args, engine, tokenizer, log, folder)
    log.close()
    return result


if __name__ == "__main__":
    run_main(main, parse_args())
