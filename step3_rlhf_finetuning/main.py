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
(the shared ``--max_seq_len`` is not used here).

With ``--save_interval N`` a resumable checkpoint is written every N RL steps (actor and critic
engines, the EMA actor, RNG states, prompt position, reward EMA, history); rerunning the
command resumes from it (:mod:`utils.checkpoint`; DeepSpeed-Chat has no step-3 resume).
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields

import torch

from step3_rlhf_finetuning.algorithms import (ESTIMATOR_ALIASES, ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                                              default_help, estimator_spec)
from step3_rlhf_finetuning.config import (CRITIC_ONLY_FLAGS, DYNAMIC_SAMPLING_BATCHES, GenerationConfig, PPOConfig,
                                          RewardConfig, Step3Config, field_defaults)
from step3_rlhf_finetuning.ppo_trainer import (DeepSpeedPPOTrainer, Rollout, RoundCollector, WholeSteps, cut_batches,
                                               old_logprobs_from_training_pass, reward_ema, summarize_rollout)
from step3_rlhf_finetuning.rlhf_engine import DeepSpeedRLHFEngine
from utils.arguments import (HelpFormatter, add_checkpoint_args, add_data_args, add_deepspeed_args, add_logging_args,
                             add_num_padding_arg, add_offload_reference_arg, add_only_optimize_lora_arg,
                             add_rlhf_role_args, add_run_args, add_sampling_args, add_test_mode_args,
                             add_trust_remote_code_arg, apply_test_mode, check_sampling_args, validate_common)
from utils.checkpoint import CheckpointManager, run_inputs, ModuleState, resumable_loader
from utils.compat import check_zero_combination
from utils.data.chat_template import training_format_file
from utils.data.data_utils import DataCollatorRLHF, create_prompt_dataset
from utils.data.unsupervised import get_unsupervised_data
from utils.distributed import gather_per_rank, get_all_reduce_mean, get_rank, get_world_size
from utils.entrypoint import run_main
from utils.errors import UserInputError
from utils.finite import check_finite, check_weights_finite
from utils.generation import BACKENDS
from utils.model.critic import save_reward_model
from utils.model.model_utils import has_dropout, save_hf_format
from utils.perf import count_parameters, model_shape, step3_throughput, throughput_due, throughput_lines
from utils.preflight import preflight
from utils.reward_functions import BUILTIN as BUILTIN_REWARD_FNS
from utils.reward_functions import check_rows, load_reward_fn
from utils.rl_math import KL_ESTIMATORS
from utils.runtime import to_device
from utils.summary import head_tail_window
from utils.training import (answer_end_token, check_steps_ran, epoch_batches, epochs, load_tokenizer,
                            refuse_no_optimizer_step, schedule_note, start_run)


def build_parser() -> argparse.ArgumentParser:
    ppo, gen = field_defaults(PPOConfig), field_defaults(GenerationConfig)  # the defaults live in the dataclasses
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        description="Step 3: RL fine-tuning of the step-1 actor: PPO against the step-2 reward model, or a "
                    "critic-free estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++) with a reward model and/or a reward "
                    "function.")
    add_data_args(parser)
    g = parser.add_argument_group("step 3 data")
    g.add_argument("--unsupervised_dataset_name", type=str, default=None,
                   help="Text mixed into the actor's training (InstructGPT's PPO-ptx): a local .txt file or "
                        "folder of .txt files, a .json/.jsonl/.parquet/.csv file, or a hub dataset name.")
    g.add_argument("--unsupervised_dataset_config_name", type=str, default=None,
                   help="Configuration of a hub --unsupervised_dataset_name (e.g. wikitext-2-raw-v1).")
    g.add_argument("--unsup_coef", type=float, default=ppo["unsup_coef"],
                   help="γ of InstructGPT's Eq. 2: weight of the LM loss.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None,
                   help="Accepted for compatibility (tokenisation here is one batched pass).")
    g.add_argument("--max_prompt_seq_len", type=int, default=gen["max_prompt_seq_len"],
                   help="Prompts are left-padded to this; longer prompts are dropped (with a count).")
    g.add_argument("--max_answer_seq_len", type=int, default=gen["max_answer_seq_len"],
                   help="Tokens generated per answer (at most).")

    g = parser.add_argument_group("models")
    g.add_argument("--actor_model_name_or_path", type=str, required=True, help="Step-1 output (or any causal LM).")
    g.add_argument("--critic_model_name_or_path", type=str, default=None,
                   help="Step-2 output folder: initialises the critic (PPO) and the reward model. Not needed "
                        "(and refused) with a critic-free --advantage_estimator and --reward_fn alone.")
    add_num_padding_arg(g)
    g.add_argument("--allow_vocab_mismatch", action="store_true",
                   help="Run even when the actor's and the reward model's tokenizers differ (the reward model "
                        "then reads the actor's token ids as its own; refused by default).")
    add_trust_remote_code_arg(g)
    add_rlhf_role_args(parser, "actor", learning_rate=9.65e-6)
    add_rlhf_role_args(parser, "critic", learning_rate=5e-6)

    g = parser.add_argument_group("reward")
    g.add_argument("--reward_fn", type=str, default=RewardConfig.fn,
                   help=f"Score answers with a function instead of the reward model: built in "
                        f"{', '.join(BUILTIN_REWARD_FNS)}, or path/to/file.py:function (called with the prompts, "
                        "the answers and the dataset rows; returns one float per answer).")
    g.add_argument("--reward_fn_weight", type=float, default=RewardConfig.fn_weight,
                   help="Add the function's score, times this, to the reward model's (default: the function "
                        "alone, and no reward model is loaded).")

    g = parser.add_argument_group("RL algorithm")
    specs = ESTIMATORS.values()
    g.add_argument("--advantage_estimator", default=ppo["advantage_estimator"],
                   choices=tuple(ESTIMATORS) + tuple(ESTIMATOR_ALIASES),
                   help="; ".join(f"{s.name} = {s.title}" + (f" ({', '.join(s.aliases)})" if s.aliases else "")
                                  for s in specs)
                        + ". Only gae has a critic; " + ", ".join(s.name for s in specs if s.group)
                        + " compare the answers of one prompt (--n_samples_per_prompt ≥ 2). docs/algorithms.md.")
    g.add_argument("--policy_loss", default=ppo["policy_loss"], choices=tuple(POLICY_LOSSES),
                   help="The actor's per-token loss, with any estimator: "
                        + "; ".join(f"{s.name} = {s.title}" for s in POLICY_LOSSES.values())
                        + " (ppo: the token ratio's clipped surrogate; gspo: the answer's ratio, clipped per answer; "
                          "cispo: the clipped importance weight, detached, times the log-prob).")
    g.add_argument("--loss_agg", default=ppo["loss_agg"], choices=tuple(LOSS_AGGREGATIONS),
                   help="How the actor's per-token losses of an optimizer step make its loss (verl's names): "
                        + "; ".join(f"{name} = {text}" for name, text in LOSS_AGGREGATIONS.items())
                        + f". Default: {default_help('loss_agg')}.")
    g.add_argument("--n_samples_per_prompt", type=int, default=ppo["n_samples_per_prompt"],
                   help="Answers sampled per prompt (G); they form one group.")
    g.add_argument("--kl_estimator", default=ppo["kl_estimator"], choices=KL_ESTIMATORS,
                   help="KL(actor || reference) estimator: k1 = log-ratio, k2 = ½·log-ratio², k3 = unbiased and "
                        f"≥ 0 (default: {default_help('kl_estimator')}).")
    g.add_argument("--use_kl_loss", default=ppo["use_kl_loss"], action=argparse.BooleanOptionalAction,
                   help="KL penalty in the loss (β·KL, β = --kl_ctl, aggregated as --loss_agg) instead of in the "
                        f"reward (default: {default_help('use_kl_loss')}, as in their papers).")

    g = parser.add_argument_group("DAPO's pieces")
    g.add_argument("--mask_truncated_answers", action="store_true",
                   help="Answers cut at --max_answer_seq_len (no end token) count in no loss; they keep their place "
                        "in their group's statistics.")
    g.add_argument("--overlong_penalty", type=int, default=ppo["overlong_penalty"], metavar="L",
                   help="DAPO's soft overlong penalty, added to the score: 0 up to --max_answer_seq_len − L tokens, "
                        "then falling linearly to −1 at --max_answer_seq_len (0 = off).")
    g.add_argument("--overlong_penalty_weight", type=float, default=ppo["overlong_penalty_weight"], metavar="W",
                   help="The overlong penalty's weight in the score: it falls to −W at --max_answer_seq_len "
                        "(default: DAPO's 1; TRL's reward_weights for get_soft_overlong_punishment).")
    g.add_argument("--dynamic_sampling", action="store_true",
                   help="Drop the groups whose answers all score the same (no advantage to learn from) and refill the "
                        "round from further prompt batches, up to --dynamic_sampling_max_batches; counts logged. "
                        "Needs --n_samples_per_prompt ≥ 2.")
    g.add_argument("--dynamic_sampling_max_batches", type=int, default=ppo["dynamic_sampling_max_batches"],
                   help="The most generation batches one round may draw with --dynamic_sampling (default: "
                        f"{DYNAMIC_SAMPLING_BATCHES} × --generation_batches); when they give too few groups, the "
                        "round is filled with groups masked out of every loss.")

    g = parser.add_argument_group("PPO")
    g.add_argument("--per_device_generation_batch_size", type=int, default=16, help="Prompts per generation batch.")
    g.add_argument("--per_device_training_batch_size", type=int, default=16,
                   help="Micro batch (answers) of the RL update.")
    g.add_argument("--generation_batches", type=int, default=ppo["generation_batches"],
                   help="Generation batches collected before each round of training.")
    g.add_argument("--ppo_epochs", type=int, default=ppo["ppo_epochs"],
                   help="Passes of training over each round's experience.")
    add_run_args(g, unit="RL steps", output="actor/, critic/ and actor_ema/ are")
    add_test_mode_args(g)
    g.add_argument("--kl_ctl", type=float, default=ppo["kl_ctl"], help="KL penalty coefficient β.")
    g.add_argument("--clip_reward_value", type=float, default=ppo["clip_reward_value"],
                   help="Scores are clipped to ±this.")
    g.add_argument("--cliprange", type=float, default=ppo["cliprange"],
                   help="ε_low: the actor loss clips its ratio (cispo: its weight) below at 1 − ε_low (default: "
                        f"{default_help('cliprange')}).")
    g.add_argument("--cliprange_high", type=float, default=ppo["cliprange_high"],
                   help="ε_high: the upper clip at 1 + ε_high (DAPO's clip-higher when above --cliprange; default: "
                        f"{default_help('cliprange_high')}).")
    g.add_argument("--cliprange_value", type=float, default=ppo["cliprange_value"],
                   help="Value clip of the critic loss (gae).")
    g.add_argument("--gamma", type=float, default=ppo["gamma"], help="Discount γ.")
    g.add_argument("--lam", type=float, default=ppo["lam"], help="GAE λ (gae).")
    add_only_optimize_lora_arg(g)
    g.add_argument("--enable_ema", action="store_true",
                   help=f"Keep (and save) an EMA copy of the actor (β = {ppo['ema_beta']}).")
    g.add_argument("--enable_mixed_precision_lora", action="store_true",
                   help="Mixed-precision ZeRO++ for LoRA (needs --actor_lora_dim > 0 and --actor_zero_stage 3).")
    g.add_argument("--align_overflow", action="store_true",
                   help="fp16: skip both actor and critic steps when either overflows (gae).")

    g = parser.add_argument_group("generation")
    add_sampling_args(g)
    g.add_argument("--generation_backend", default=gen["backend"], choices=BACKENDS,
                   help="How the actor generates: cuda-graph (static KV cache, decode step replayed as a CUDA "
                        "graph), static (same cache, eager), hf (model.generate); auto = cuda-graph on a GPU, hf on "
                        "CPU. Falls back to hf, saying why, for ZeRO-3 and unchecked architectures.")
    g.add_argument("--generation_dtype", default=gen["dtype"], choices=["bf16"],
                   help="Generate from a bf16 copy of the actor, refreshed from its weights before each generation "
                        "(default: the actor itself). With --torch_autocast the actor's weights are fp32 and "
                        "generation runs the norms and the KV cache in fp32; the copy is faster. The training pass "
                        "and its log-probs stay on the actor. Costs 2 bytes of memory a parameter. Not with ZeRO-3 "
                        "or the hybrid engine.")
    g.add_argument("--print_answers", action="store_true", help="Print prompts and answers during training.")
    g.add_argument("--print_answers_interval", type=int, default=gen["print_answers_interval"],
                   help="... every this many generation batches.")

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
    add_checkpoint_args(parser, unit="RL steps")
    parser.set_defaults(num_warmup_steps=100)
    return parser


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    args.advantage_estimator = estimator_spec(args.advantage_estimator).name
    apply_test_mode(args)
    return args


def _explicit(args, names) -> list:
    """The flags among ``names`` whose value differs from the parser's default."""
    parser = build_parser()
    return [f"--{name}" for name in names if getattr(args, name) != parser.get_default(name)]


def validate_rl(args) -> None:
    """The RL algorithm and the reward source: a clear error for every combination that cannot work or would
    silently ignore a flag."""
    estimator, G = args.advantage_estimator, args.n_samples_per_prompt
    if G < 1:
        raise UserInputError(f"--n_samples_per_prompt must be ≥ 1, got {G}")
    if estimator_spec(estimator).group and G < 2:
        raise UserInputError(f"--advantage_estimator {estimator} compares the answers of one prompt: it needs "
                             f"--n_samples_per_prompt ≥ 2 (got {G}); e.g. --n_samples_per_prompt 4 --do_sample")
    if G > 1 and not args.do_sample:
        raise UserInputError(f"--n_samples_per_prompt {G} needs --do_sample: greedy decoding gives the same answer "
                             f"{G} times")
    validate_dapo(args)
    if args.reward_fn_weight is not None and not (args.reward_fn and math.isfinite(args.reward_fn_weight)):
        raise UserInputError("--reward_fn_weight needs --reward_fn and must be a finite number")
    config = PPOConfig(advantage_estimator=estimator)
    uses_model = RewardConfig(fn=args.reward_fn, fn_weight=args.reward_fn_weight).uses_model
    needs_folder = config.uses_critic or uses_model
    if needs_folder and not args.critic_model_name_or_path:
        why = "the critic (--advantage_estimator gae)" if config.uses_critic else "the reward model"
        raise UserInputError(f"--critic_model_name_or_path (a step-2 folder) is required: it initialises {why}; "
                             "or score with a reward function alone (--reward_fn) and a critic-free "
                             "--advantage_estimator")
    if not needs_folder and args.critic_model_name_or_path:
        raise UserInputError(f"--critic_model_name_or_path {args.critic_model_name_or_path} would not be used: "
                             f"--advantage_estimator {estimator} has no critic and --reward_fn {args.reward_fn} "
                             "alone scores the answers (drop the flag, or add --reward_fn_weight W to add the reward "
                             "model's score)")
    unused = [] if config.uses_critic else _explicit(args, CRITIC_ONLY_FLAGS)
    if not uses_model and args.offload_reward_model:
        unused.append("--offload_reward_model")
    if unused:
        what = "no critic" if config.uses_critic is False else "no reward model"
        raise UserInputError(f"{', '.join(unused)} would not be used: --advantage_estimator {estimator}"
                             f"{' with --reward_fn alone' if not uses_model else ''} builds {what}"
                             f"{' and no reward model' if not uses_model and not config.uses_critic else ''}; drop "
                             f"{'it' if len(unused) == 1 else 'them'}")
    if args.reward_fn:
        load_reward_fn(args.reward_fn)  # unknown name, missing file or function: refused before any set-up


def validate_dapo(args) -> None:
    """DAPO's pieces: the overlong buffer fits in the answer, dynamic sampling has groups to compare and a limit it
    can reach."""
    if not 0 <= args.overlong_penalty <= args.max_answer_seq_len:
        raise UserInputError(f"--overlong_penalty {args.overlong_penalty}: the penalised tokens must be between 0 "
                             f"(off) and --max_answer_seq_len {args.max_answer_seq_len}")
    if args.overlong_penalty_weight != 1.0 and not args.overlong_penalty:
        raise UserInputError(f"--overlong_penalty_weight {args.overlong_penalty_weight} weighs the overlong penalty: "
                             "it needs --overlong_penalty L")
    if args.dynamic_sampling and args.n_samples_per_prompt < 2:
        raise UserInputError("--dynamic_sampling drops the groups whose answers all score the same: it needs "
                             f"--n_samples_per_prompt ≥ 2 (got {args.n_samples_per_prompt}), or every group is dropped")
    if args.dynamic_sampling_max_batches is not None:
        if not args.dynamic_sampling:
            raise UserInputError("--dynamic_sampling_max_batches needs --dynamic_sampling")
        if args.dynamic_sampling_max_batches < args.generation_batches:
            raise UserInputError(f"--dynamic_sampling_max_batches {args.dynamic_sampling_max_batches} is below "
                                 f"--generation_batches {args.generation_batches}: a round draws at least that many")


def validate_step3(args) -> None:
    """DeepSpeed-Chat's step-3 checks (and a few more), as clear errors before anything is built."""
    validate_common(args)
    for name in ("per_device_generation_batch_size", "per_device_training_batch_size", "generation_batches",
                 "ppo_epochs", "max_prompt_seq_len", "max_answer_seq_len", "print_answers_interval",
                 "inference_tp_size"):
        if getattr(args, name) < 1:
            raise UserInputError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    if args.max_answer_seq_len < 2:
        raise UserInputError(f"--max_answer_seq_len {args.max_answer_seq_len}: answers of one token are dropped "
                             "(as in DeepSpeed-Chat), so no RL step could run; use 2 or more")
    if args.enable_test_mode and 0 < args.test_stop_step < args.generation_batches:
        raise UserInputError(f"--test_stop_step {args.test_stop_step} counts generation batches, as DeepSpeed-Chat's: "
                             f"fewer than one round of --generation_batches {args.generation_batches}, so no RL step "
                             "would run")
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
    if args.generation_dtype:
        validate_generation_dtype(args)
    if args.only_optimize_lora and args.actor_lora_dim <= 0 and args.critic_lora_dim <= 0:
        raise UserInputError("--only_optimize_lora needs --actor_lora_dim > 0 or --critic_lora_dim > 0")
    if args.unsupervised_dataset_config_name and not args.unsupervised_dataset_name:
        raise UserInputError("--unsupervised_dataset_config_name needs --unsupervised_dataset_name")
    check_flags_apply(args)
    if not math.isfinite(args.unsup_coef):
        raise UserInputError(f"--unsup_coef must be finite, got {args.unsup_coef}")
    check_sampling_args(args)
    for name in ("kl_ctl", "clip_reward_value", "cliprange", "cliprange_high", "cliprange_value", "gamma", "lam"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UserInputError(f"--{name} must be a finite number ≥ 0, got {value}")
    for name in ("gamma", "lam"):  # a discount and GAE's λ weigh future terms: above 1 the returns blow up
        if getattr(args, name) > 1:
            raise UserInputError(f"--{name} must be between 0 and 1, got {getattr(args, name)}")
    validate_rl(args)


def validate_generation_dtype(args) -> None:
    """``--generation_dtype``: a copy of the actor's whole weights, in a dtype the actor does not already have."""
    flag = f"--generation_dtype {args.generation_dtype}"
    if args.actor_zero_stage == 3:
        raise UserInputError(f"{flag} copies the actor's whole weights: ZeRO-3 partitions them; use "
                             "--actor_zero_stage 0, 1 or 2, or leave the flag out")
    if args.enable_hybrid_engine:
        raise UserInputError(f"{flag} and --enable_hybrid_engine both choose how the actor generates; give one")
    if args.dtype == args.generation_dtype and not args.torch_autocast:
        raise UserInputError(f"{flag} with --dtype {args.dtype}: the actor's weights are {args.dtype} already "
                             "(the copy pays with fp32 weights: --torch_autocast, or --dtype fp32)")


# flags that act only together with another: (the flags, what they need, whether the run has it)
DEPENDENT_FLAGS = (
    (("unpin_actor_parameters", "release_inference_cache", "tp_gather_partition_size"), "--enable_hybrid_engine",
     lambda args: args.enable_hybrid_engine),
    (("print_answers_interval",), "--print_answers", lambda args: args.print_answers),
    (("unsup_coef",), "--unsupervised_dataset_name", lambda args: bool(args.unsupervised_dataset_name)),
)


def check_flags_apply(args) -> None:
    """A flag step 3 would not use in this run is refused, naming it, instead of being silently ignored: the shared
    --max_seq_len (step 3's lengths are --max_prompt_seq_len and --max_answer_seq_len), and each of
    :data:`DEPENDENT_FLAGS` without the flag it needs (``--preprocessing_num_workers``, accepted for DeepSpeed-Chat's
    scripts, is named in the log instead: :func:`main`)."""
    if _explicit(args, ["max_seq_len"]):
        raise UserInputError(f"--max_seq_len {args.max_seq_len} would not be used: step 3's lengths are "
                             "--max_prompt_seq_len and --max_answer_seq_len")
    for names, needed, present in DEPENDENT_FLAGS:
        unused = _explicit(args, names)
        if unused and not present(args):
            raise UserInputError(f"{', '.join(unused)} would not be used without {needed}; add it, or drop "
                                 f"{'it' if len(unused) == 1 else 'them'}")


def validate_flags(args) -> None:
    """Every check of step 3's flags that builds and reads nothing: :func:`main` runs it first, and train.py before
    step 1, so a run is refused before earlier steps spend their time."""
    validate_step3(args)
    check_zero_combination(args)


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
    answers_per_batch = args.per_device_generation_batch_size * args.n_samples_per_prompt
    unsup_loader = None
    if args.unsupervised_dataset_name:
        text = get_unsupervised_data(args.unsupervised_dataset_name, args.unsupervised_dataset_config_name, tokenizer,
                                     args.max_prompt_seq_len + args.max_answer_seq_len, log=log.info)
        # one block of text per answer: the LM and the RL micro-batches pair up one to one
        unsup_loader = resumable_loader(text, answers_per_batch, args.seed, drop_last=True)
        batches = min(batches, len(unsup_loader))
        if batches == 0:
            raise UserInputError(f"--unsupervised_dataset_name {args.unsupervised_dataset_name}: {len(text)} "
                                 f"blocks, fewer than one batch of {answers_per_batch}")
    steps_per_epoch = batches // args.generation_batches
    if steps_per_epoch == 0:
        raise UserInputError(f"{len(prompts)} phase-3 prompts per rank give {batches} generation batches, fewer than "
                             f"--generation_batches {args.generation_batches}")
    rl_steps = args.num_train_epochs * steps_per_epoch
    if args.max_steps:
        rl_steps = min(rl_steps, args.max_steps)
    refuse_no_optimizer_step(rl_steps * micro_batches_per_round(args) * args.ppo_epochs, args.gradient_accumulation_steps,
                             f"{rl_steps} RL step(s) × {micro_batches_per_round(args)} micro-batch(es) a round × "
                             f"--ppo_epochs {args.ppo_epochs}, per rank")
    total_iters = max(1, math.ceil(rl_steps * micro_batches_per_round(args) * args.ppo_epochs
                                  / args.gradient_accumulation_steps))
    return prompts, prompt_loader, unsup_loader, rl_steps, total_iters


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


def unchanged_actor_reason(history: list, ppo: PPOConfig, max_answer_seq_len: int, critic: bool,
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


def optimise(trainer, rollout: Rollout, unsup_batches: list | None, micro_batch: int, ppo_epochs: int,
             steps: WholeSteps) -> dict:
    """``ppo_epochs`` passes over the round's micro-batches (actor, critic for gae; + LM loss on the text, + EMA),
    reshuffled after each pass, as DeepSpeed-Chat; trained in whole optimizer steps (``steps``: micro-batches that do
    not fill one wait for the next round), each micro-batch's actor loss normalised over its optimizer step
    (``--loss_agg``, :meth:`DeepSpeedPPOTrainer.loss_normalizers`). Returns the mean of each loss over the micro-batches
    trained now (none when all wait) and the rows each model trained on (this rank)."""
    micro = rollout.micro_batches(micro_batch)
    unsup = cut_batches(unsup_batches, micro_batch) if unsup_batches else [None] * len(micro)
    schedule = []  # (micro-batch, text) in training order
    for _ in range(ppo_epochs):
        schedule += list(zip(micro, unsup))
        random.shuffle(micro)
        random.shuffle(unsup)
    schedule = steps.take(schedule)
    normalizers = trainer.loss_normalizers([batch for batch, _ in schedule], steps.per_step)
    sums, rows = {}, {"actor_rows": 0, "critic_rows": 0}
    for (batch, text), normalizer in zip(schedule, normalizers):
        losses = trainer.train_step(batch, normalizer)
        rows["actor_rows"] += len(batch)
        rows["critic_rows"] += len(batch) if "critic_loss" in losses else 0
        if text is not None:
            losses["unsup_loss"] = trainer.train_unsupervised(text)
            rows["actor_rows"] += text["input_ids"].shape[0]
        for name, value in losses.items():
            sums[name] = sums.get(name, 0.0) + value.item()
        trainer.update_ema()
    return {**{name: total / len(schedule) for name, total in sums.items()}, **rows, "waiting": len(steps.waiting)}


def all_reduce_metrics(rollout: Rollout, losses: dict) -> dict:
    """Rank-averaged step metrics: reward, answer length, the share cut at the length cap and (with a reference
    model) KL (k3) over the kept answers of every rank, and the mean of each loss."""
    sums = summarize_rollout(rollout)
    names = [k for k in ("kept", "reward_sum", "answer_len_sum", "truncated_sum", "kl_sum") if k in sums]
    loss_names = sorted(name for name in losses if name.endswith("_loss"))
    values = torch.stack([sums[k].double().cpu() for k in names]
                         + [torch.tensor(float(losses[n]), dtype=torch.float64) for n in loss_names])
    mean = dict(zip(names + loss_names, get_all_reduce_mean(values.to(rollout.input_ids.device)).cpu().tolist()))
    kept = max(mean.pop("kept"), 1e-12)
    metrics = {key[:-len("_sum")]: mean.pop(key) / kept for key in names[1:]}
    metrics.update(mean)
    return metrics


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


def algorithm_line(ppo: PPOConfig) -> str:
    """The run's policy loss, clip range, aggregation and DAPO's pieces, for the log."""
    parts = [f"policy loss: {ppo.policy_loss} (clip 1 − {ppo.cliprange:g} … 1 + {ppo.cliprange_high:g})",
             f"loss aggregation: {ppo.loss_agg}"]
    if ppo.mask_truncated_answers:
        parts.append("answers cut at the length cap masked out of the losses")
    if ppo.overlong_penalty:
        weight = "" if ppo.overlong_penalty_weight == 1.0 else f", weight {ppo.overlong_penalty_weight:g}"
        parts.append(f"overlong penalty over the last {ppo.overlong_penalty} tokens{weight}")
    if ppo.dynamic_sampling:
        parts.append(f"dynamic sampling (at most {ppo.dynamic_sampling_max_batches} generation batches a round)")
    return "; ".join(parts)


def step_line(epoch: int, step: int, metrics: dict) -> str:
    """The step's log line (DeepSpeed-Chat's, with the losses this run has)."""
    parts = [f"Epoch: {epoch}", f"Step: {step}"]
    if "actor_loss" in metrics:
        parts.append(f"Actor Loss: {metrics['actor_loss']:.4f}")
    else:  # every micro-batch of the round waits for the next round's (WholeSteps)
        parts.append("Actor Loss: - (the round's micro-batches wait for the optimizer step's others)")
    for key, label in (("critic_loss", "Critic Loss"), ("kl_loss", "KL Loss"), ("unsup_loss", "Unsupervised Loss")):
        if key in metrics:
            parts.append(f"{label}: {metrics[key]:.4f}")
    parts += [f"Average reward: {metrics['reward']:.4f}", f"EMA reward: {metrics['ema_reward']:.4f}"]
    if "kl" in metrics:
        parts.append(f"KL: {metrics['kl']:.4f}")
    parts += [f"answer length: {metrics['answer_len']:.1f}", f"dropped: {metrics['dropped']:.0f}"]
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


def report_step(log, progress: Progress, rollout: Rollout, losses: dict, train_time: float, context: dict) -> dict:
    """All-reduce, check, log (console, tensorboard, metrics.jsonl) and record one RL step's metrics."""
    args, engine = context["args"], context["engine"]
    metrics = all_reduce_metrics(rollout, losses)
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
        sequences=info["sequences"], seq_length=rollout.input_ids.shape[1],
        answer_length=args.max_answer_seq_len, generated_tokens=info["generated_tokens"] // max(info["batches"], 1),
        actor_train_samples=losses["actor_rows"], critic_train_samples=losses["critic_rows"],
        world_size=get_world_size(), **context["perf_constants"])
    progress.history.append(metrics)
    log.info(step_line(progress.epoch, progress.rl_step, metrics))
    if throughput_due(progress.rl_step, context["rl_steps"]):
        for line in throughput_lines(perf):
            log.info(line)
    lrs = {f"{name}_lr": model.get_lr()[0] for name, model in (("actor", engine.actor), ("critic", engine.critic))
           if model is not None}
    log.scalars(progress.rl_step, "train", **metrics, **lrs, tokens=info["tokens"], samples=info["sequences"],
                **{k: perf[k] for k in ("e2e_latency", "gen_latency", "train_latency", "e2e_tflops", "gen_tflops",
                                        "train_tflops", "samples_per_sec", "gen_tokens_per_sec")})
    return metrics


def summarize_run(log, progress: Progress, ref_unchanged: bool | None) -> dict:
    """The run's result (returned by :func:`main`, logged under ``final``): steps, reward first → last, KL (with a
    reference model; ``ref_unchanged`` None without one)."""
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
    if args.preprocessing_num_workers is not None:
        log.warning(f"--preprocessing_num_workers {args.preprocessing_num_workers} is not used: tokenisation here "
                    "is one batched pass (accepted for DeepSpeed-Chat's scripts)")
    if args.align_overflow and not config.ppo.align_overflow:
        log.warning(f"--align_overflow only matters with --dtype fp16 (now {args.dtype}); ignored")

    # ---- data (prompts, their rows for the reward function, text to mix in), models
    prompts, prompt_loader, unsup_loader, rl_steps, total_iters = create_datasets(args, tokenizer, log)
    if args.reward_fn:
        check_rows(args.reward_fn, [s["prompt"] for s in prompts.samples], [s["row"] for s in prompts.samples])
    if note := schedule_note(args.lr_scheduler_type, args.num_warmup_steps, total_iters):
        log.warning(note)
    engine = DeepSpeedRLHFEngine(config.engine, tokenizer, num_total_iters=total_iters)
    # the RL micro-batches per optimizer step (the actor's engine counts twice as many with mixing: + the LM's)
    on_policy = old_logprobs_from_training_pass(config.ppo, micro_batches_per_round(args),
                                                args.gradient_accumulation_steps, has_dropout(engine.actor.module))
    trainer = DeepSpeedPPOTrainer(engine, config.ppo, config.generation, log.info, config.reward, reward_fn, on_policy)
    ref_checksum = parameter_checksum(engine.ref, config.engine.actor.zero_stage)
    input_checksum = parameter_checksum(engine.actor, config.engine.actor.zero_stage)  # the input model's, as built
    context = {"args": args, "engine": engine, "rl_steps": rl_steps,
               "perf_constants": throughput_constants(config.engine, engine, config.generation.dtype)}

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

    # ---- train: generate -> score -> collect a round -> advantages -> optimise
    ppo = config.ppo
    log.info(f"***** Running RL ({ppo.advantage_estimator}{', critic-free' if engine.critic is None else ''}, "
             f"{ppo.n_samples_per_prompt} answer(s) per prompt): {rl_steps} RL steps, {total_iters} optimizer steps "
             f"per model, unsupervised mixing {'on' if config.unsupervised else 'off'} *****")
    log.info(algorithm_line(ppo))
    rounds = RoundCollector(ppo, args.per_device_generation_batch_size)
    for epoch in epochs(progress, args):
        for batch, text in epoch_batches((prompt_loader, unsup_loader), progress, args, log, f"step3 epoch {epoch + 1}",
                                         args.generation_batches):
            progress.gen_step += 1
            batch = to_device(batch, device)
            rollout = trainer.generate(batch["prompt"], batch["prompt_att_mask"], batch["prompt_text"], batch["rows"],
                                       progress.gen_step)
            progress.dropped_total += rollout.info["dropped"]
            if rollout.info["kept"] == 0:
                log.warning(f"generation batch {progress.gen_step}: every answer had ≤ 1 token; nothing to score "
                            f"({progress.dropped_total} answers dropped so far)")
            else:
                rollout.scores = trainer.score(rollout)
            ready = rounds.add(rollout, to_device(text, device) if text is not None else None)
            if ready is None:  # --generation_batches batches (with --dynamic_sampling: their groups) not there yet
                continue
            rollout, texts = ready
            if rollout.info.get("groups_kept") == 0:
                log.warning(f"--dynamic_sampling: no group with different scores in {rollout.info['sampled_batches']} "
                            "generation batches (--dynamic_sampling_max_batches); no RL step on them")
                continue
            trainer.compute_advantages(rollout)  # on the whole round: every group (and REINFORCE++'s batch) intact
            progress.rl_step += 1
            train_start = time.time()
            losses = optimise(trainer, rollout, texts, args.per_device_training_batch_size, ppo.ppo_epochs, steps)
            report_step(log, progress, rollout, losses, time.time() - train_start, context)
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
    if parameter_checksum(engine.actor, config.engine.actor.zero_stage) == input_checksum:  # rule: no empty success
        raise UserInputError(f"{progress.rl_step} RL step(s) ran but the actor is the input model, weight for weight ("
                             + unchanged_actor_reason(progress.history, ppo, args.max_answer_seq_len,
                                                      engine.critic is not None, total_iters, args.num_warmup_steps)
                             + "); nothing is saved")
    ref_unchanged = None if engine.ref is None else \
        parameter_checksum(engine.ref, config.engine.actor.zero_stage) == ref_checksum
    result = summarize_run(log, progress, ref_unchanged)
    if args.output_dir is not None:
        save_models(args, engine, tokenizer, log, folder)
    log.close()
    return result


if __name__ == "__main__":
    run_main(main, parse_args())
