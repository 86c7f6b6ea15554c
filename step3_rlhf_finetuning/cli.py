"""Step 3's command line: the parser (:func:`build_parser`, :func:`parse_args`) and every check of the flags that
builds and reads nothing (:func:`validate_flags`: train.py runs it before step 1).

The RL, generation, reward and hybrid-engine knobs are declared once, as fields of the config dataclasses
(:func:`step3_rlhf_finetuning.config.knob`): their flags, defaults, help and ranges come from there. The flags
DeepSpeed-Chat's scripts pass that step 3 has no use for sit in their own help group (:data:`COMPAT_GROUP`).
"""
from __future__ import annotations

import argparse
import math

from step3_rlhf_finetuning.algorithms import estimator_spec
from step3_rlhf_finetuning.config import (CRITIC_ONLY_FLAGS, DATA, DAPO, EMA_BETA, GENERATION, HYBRID, KNOB_CLASSES,
                                          PPO, REWARD, RL, VALUE_HEADS, PPOConfig, RewardConfig, add_knob_args,
                                          knob_ranges)
from utils.arguments import (COMPAT_GROUP, ZERO_STAGES, HelpFormatter, add_checkpoint_args, add_compute_fp32_loss_arg,
                             add_deepspeed_config_args,
                             add_data_args, add_deepspeed_args, add_logging_args, add_num_padding_arg,
                             add_offload_reference_arg, add_only_optimize_lora_arg, add_rlhf_role_args, add_run_args,
                             add_sampling_args, add_test_mode_args, add_trust_remote_code_arg, apply_test_mode,
                             check_sampling_args, validate_common)
from utils.compat import check_zero_combination
from utils.errors import UserInputError
from utils.reward_functions import load_reward_fn


def add_knobs(group, title: str) -> None:
    """The flags of every config knob declared for the help group ``title``."""
    for cls in KNOB_CLASSES:
        add_knob_args(group, cls, title)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        description="Step 3: RL fine-tuning of the step-1 actor: PPO against the step-2 reward model, or a "
                    "critic-free estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++) with a reward model and/or a reward "
                    "function.")
    add_data_args(parser, max_seq_len=False)
    g = parser.add_argument_group(DATA)
    g.add_argument("--unsupervised_dataset_name", type=str, default=None,
                   help="Text mixed into the actor's training (InstructGPT's PPO-ptx): a local .txt file or "
                        "folder of .txt files, a .json/.jsonl/.parquet/.csv file, or a hub dataset name.")
    g.add_argument("--unsupervised_dataset_config_name", type=str, default=None,
                   help="Configuration of a hub --unsupervised_dataset_name (e.g. wikitext-2-raw-v1).")
    g.add_argument("--per_device_unsup_batch_size", type=int, default=None,
                   help="Rows of --unsupervised_dataset_name text in the LM step paired with each RL micro-batch "
                        "(default: --per_device_training_batch_size, one text row per answer, as DeepSpeed-Chat). "
                        "Fewer rows make the LM step cheaper and lighter on memory; the LM loss is a mean over its "
                        "tokens, so --unsup_coef keeps its meaning.")
    add_knobs(g, DATA)

    g = parser.add_argument_group("models")
    g.add_argument("--actor_model_name_or_path", type=str, required=True, help="Step-1 output (or any causal LM).")
    g.add_argument("--critic_model_name_or_path", type=str, default=None,
                   help="Step-2 output folder: initialises the critic (PPO) and the reward model. Not needed "
                        "(and refused) with a critic-free --advantage_estimator and --reward_fn alone.")
    g.add_argument("--critic_value_head", choices=VALUE_HEADS, default="reward_model",
                   help="Where the critic's value head starts (gae): reward_model = the step-2 model's, as "
                        "DeepSpeed-Chat; zero = values 0 until the critic learns them (its backbone still the step-2 "
                        "model's). bench/bench_ppo_advantages.py measures which gives advantages that carry the "
                        "reward.")
    add_num_padding_arg(g)
    g.add_argument("--allow_vocab_mismatch", action="store_true",
                   help="Run even when the actor's and the reward model's tokenizers differ (the reward model "
                        "then reads the actor's token ids as its own; refused by default).")
    add_trust_remote_code_arg(g)
    add_rlhf_role_args(parser, "actor", learning_rate=9.65e-6)
    add_rlhf_role_args(parser, "critic", learning_rate=5e-6)
    for title in (REWARD, RL, DAPO):
        add_knobs(parser.add_argument_group(title), title)

    g = parser.add_argument_group(PPO)
    g.add_argument("--per_device_generation_batch_size", type=int, default=16, help="Prompts per generation batch.")
    g.add_argument("--per_device_training_batch_size", type=int, default=16,
                   help="Micro batch (answers) of the RL update.")
    add_knobs(g, PPO)
    add_run_args(g, unit="RL steps", output="actor/, critic/ and actor_ema/ are")
    add_test_mode_args(g)
    add_only_optimize_lora_arg(g)
    g.add_argument("--enable_ema", action="store_true",
                   help=f"Keep (and save) an EMA copy of the actor (β = {EMA_BETA}).")

    g = parser.add_argument_group(GENERATION)
    add_sampling_args(g)
    add_knobs(g, GENERATION)

    add_deepspeed_args(parser, zero_stage=False)
    g = parser.add_argument_group(HYBRID)
    add_knobs(g, HYBRID)
    add_offload_reference_arg(g)
    g.add_argument("--offload_reward_model", action="store_true", help="ZeRO-Offload the reward model.")
    add_logging_args(parser, tensorboard_path="step3_tensorboard", print_loss=False)
    add_checkpoint_args(parser, unit="RL steps")

    g = parser.add_argument_group(COMPAT_GROUP)
    g.add_argument("--preprocessing_num_workers", type=int, default=None,
                   help="Accepted for compatibility (tokenisation here is one batched pass).")
    g.add_argument("--max_seq_len", type=int, default=512,
                   help="Refused when given: step 3's lengths are --max_prompt_seq_len and --max_answer_seq_len.")
    g.add_argument("--zero_stage", type=int, default=0, choices=ZERO_STAGES,
                   help="Refused when given: step 3's stages are --actor_zero_stage and --critic_zero_stage.")
    g.add_argument("--print_loss", action="store_true",
                   help="Refused when given: step 3 logs its losses every step.")
    add_compute_fp32_loss_arg(g)
    add_deepspeed_config_args(g)
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
    validate_common(args, ranges=knob_ranges())  # with the ranges the knobs declare
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
    check_sampling_args(args)
    validate_rl(args)


def validate_generation_dtype(args) -> None:
    """``--generation_dtype``: a copy of the actor's whole weights, in a dtype the actor does not already have.
    Under ZeRO-3 too: the copy's weights are gathered from the partitions once per rollout
    (:class:`utils.generation.GenerationCopy`)."""
    flag = f"--generation_dtype {args.generation_dtype}"
    if args.enable_hybrid_engine:
        raise UserInputError(f"{flag} and --enable_hybrid_engine both choose how the actor generates; give one")
    if args.dtype == args.generation_dtype and not args.torch_autocast:
        raise UserInputError(f"{flag} with --dtype {args.dtype}: the actor's weights are {args.dtype} already "
                             "(the copy pays with fp32 weights: --torch_autocast, or --dtype fp32)")


# flags of the shared groups (or DeepSpeed-Chat's scripts) that step 3 has no use for: refused when given
REFUSED_FLAGS = {
    "max_seq_len": "step 3's lengths are --max_prompt_seq_len and --max_answer_seq_len",
    "zero_stage": "step 3's ZeRO stages are --actor_zero_stage and --critic_zero_stage",
    "print_loss": "step 3 logs its losses (and rewards) every step",
}

# flags that act only together with another: (the flags, what they need, whether the run has it)
DEPENDENT_FLAGS = (
    (("unpin_actor_parameters", "release_inference_cache", "tp_gather_partition_size"), "--enable_hybrid_engine",
     lambda args: args.enable_hybrid_engine),
    (("print_answers_interval",), "--print_answers", lambda args: args.print_answers),
    (("unsup_coef", "per_device_unsup_batch_size"), "--unsupervised_dataset_name",
     lambda args: bool(args.unsupervised_dataset_name)),
)


def check_flags_apply(args) -> None:
    """A flag step 3 would not use in this run is refused, naming it, instead of being silently ignored: each of
    :data:`REFUSED_FLAGS` (the shared --max_seq_len, --zero_stage, --print_loss), and each of
    :data:`DEPENDENT_FLAGS` without the flag it needs (``--preprocessing_num_workers``, accepted for DeepSpeed-Chat's
    scripts, is named in the log instead: :func:`main`)."""
    for name, why in REFUSED_FLAGS.items():
        if _explicit(args, [name]):
            raise UserInputError(f"--{name} {getattr(args, name)} would not be used: {why}")
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


