"""Command-line argument groups shared by the steps, declared once.

Each ``add_*_args(parser)`` adds one group with DeepSpeed-Chat's flag names and
defaults; a step overrides a default with ``parser.set_defaults(...)`` (step 2's
learning rate is 5e-5, say) instead of re-declaring the flag.
"""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every flag's default; descriptions and epilogs keep their line breaks."""


SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
DTYPES = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)
# The help group of the flags an entry point accepts only for DeepSpeed-Chat's scripts: each is refused when given
# (it would do nothing), or has no effect by design (its help says why); tests/test_flags_used.py holds every other
# flag to be read by the entry point's code.
COMPAT_GROUP = "compatibility (DeepSpeed-Chat's flags, not used here)"


def single_model_parser(description: str, tensorboard_path: str) -> argparse.ArgumentParser:
    """The parser of a step that trains one model (1, 2, DPO) with the shared groups: data, model,
    optimisation, LoRA, ZeRO and precision, logging, checkpoints; the step adds its own group."""
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter, description=description)
    add_data_args(parser)
    add_model_args(parser)
    add_training_args(parser)
    add_lora_args(parser)
    add_deepspeed_args(parser)
    add_logging_args(parser, tensorboard_path=tensorboard_path)
    add_checkpoint_args(parser)
    add_compat_args(parser)
    return parser


def add_data_args(parser: argparse.ArgumentParser, max_seq_len: bool = True):
    g = parser.add_argument_group("data")
    g.add_argument("--data_path", nargs="*", default=["Dahoas/rm-static"],
                   help="Datasets: hub names (Dahoas/rm-static …), local/jsonfile, a local .json/.jsonl/.parquet "
                        "file or save_to_disk folder, or builtin/preference (offline demo data). Several are blended.")
    g.add_argument("--data_split", type=str, default="2,4,4",
                   help="Shares of each dataset for phases 1,2,3, e.g. 2,4,4 (step 1 uses the first share).")
    g.add_argument("--sft_only_data_path", nargs="*", default=[],
                   help="Datasets used whole for phase 1 (SFT) only.")
    g.add_argument("--data_output_path", type=str, default="/tmp/data_files/",
                   help="Where split indices and tokenised data are cached (a local, not shared, folder).")
    if max_seq_len:  # step 3's lengths are its own (it refuses --max_seq_len in its compatibility group)
        g.add_argument("--max_seq_len", type=int, default=512, help="Maximum sequence length (tokens).")
    g.add_argument("--add_eot_token", action="store_true",
                   help="Add --eot_token to the tokenizer as a special token.")
    g.add_argument("--eot_token", type=str, default="<|endoftext|>",
                   help="End-of-text token appended to every chosen and rejected text of step 2 and DPO (step 1 "
                        "appends the tokenizer's EOS token instead, as DeepSpeed-Chat does); with --add_eot_token "
                        "step 3's answers also end at it.")
    add_chat_template_arg(g)
    return g


def add_chat_template_arg(group, auto: bool = False) -> None:
    """``--apply_chat_template`` (:mod:`utils.data.chat_template`): off by default in the training steps,
    prompt_eval and rw_eval (DeepSpeed-Chat's text, so every reference command keeps its meaning); with
    ``auto`` (chat.py) on when the model has a template, ``--no-apply_chat_template`` turning it off."""
    what = ("Format prompts and answers with the tokenizer's chat template (prompts end with its generation "
            "prompt, answers with its end-of-turn token, where the reward score sits)")
    if auto:
        group.add_argument("--apply_chat_template", action=argparse.BooleanOptionalAction, default=None,
                           help=what + "; default: when the model has one, else DeepSpeed-Chat's ' Human: … "
                                       "Assistant:' text.")
    else:
        group.add_argument("--apply_chat_template", action="store_true",
                           help=what + " instead of DeepSpeed-Chat's ' Human: … Assistant:' text.")


def add_model_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("model")
    g.add_argument("--model_name_or_path", type=str, default="tiny-opt",
                   help="Hub name (facebook/opt-1.3b), local HF folder, or built-in tiny-opt / tiny-llama / small-opt.")
    g.add_argument("--dropout", type=float, default=None, help="Override the model's dropout fields.")
    g.add_argument("--gradient_checkpointing", action="store_true", help="Enable activation checkpointing.")
    add_trust_remote_code_arg(g)
    return g


def add_trust_remote_code_arg(group) -> None:
    """``--trust_remote_code``: off unless asked for (a hub/model folder's own Python code is never run by default)."""
    group.add_argument("--trust_remote_code", action="store_true",
                       help="Allow model folders to run their own Python code (off by default).")


def add_training_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("optimisation")
    g.add_argument("--per_device_train_batch_size", type=int, default=16, help="Micro batch size per device (train).")
    g.add_argument("--per_device_eval_batch_size", type=int, default=16, help="Batch size per device (eval).")
    g.add_argument("--learning_rate", type=float, default=1e-3, help="Initial learning rate (after warm-up).")
    g.add_argument("--weight_decay", type=float, default=0.0, help="Weight decay.")
    add_run_args(g)
    return g


ADAM_BETAS = (0.9, 0.95)  # DeepSpeed-Chat's (its create_optimizer); transformers' Trainer: (0.9, 0.999)


def add_run_args(group, unit: str = "optimizer steps", output: str = "the model") -> None:
    """The run's length, schedule, seed, Adam betas, output folder and loss precision: steps 1, 2 and DPO through
    :func:`add_training_args`; step 3 directly, counting in PPO steps."""
    group.add_argument("--num_train_epochs", type=int, default=1, help="Passes over the training data.")
    group.add_argument("--max_steps", type=int, default=0,
                       help=f"Stop after this many {unit} (0 = no limit; for smoke tests and demos).")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Micro batches per optimizer step.")
    group.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULERS,
                       help="Learning-rate schedule.")
    group.add_argument("--num_warmup_steps", type=int, default=0, help="Warm-up steps of the schedule.")
    group.add_argument("--output_dir", type=str, default=None, help=f"Where {output} is saved.")
    group.add_argument("--seed", type=seed_int, default=1234, help="Random seed (DeepSpeed-Chat defaults to none).")
    group.add_argument("--adam_betas", type=adam_beta, nargs=2, default=list(ADAM_BETAS), metavar=("BETA1", "BETA2"),
                       help="AdamW's betas, of every trained model (DeepSpeed-Chat's 0.9 0.95; transformers' and "
                            "TRL's default is 0.9 0.999).")


def add_compat_args(parser: argparse.ArgumentParser):
    """The :data:`COMPAT_GROUP` of steps 1, 2 and DPO: ``--compute_fp32_loss`` and DeepSpeed's own config flags
    (step 3 adds its own group, with them)."""
    g = parser.add_argument_group(COMPAT_GROUP)
    add_compute_fp32_loss_arg(g)
    add_deepspeed_config_args(g)
    return g


# DeepSpeed's add_config_arguments flags: the DeepSpeed config is built from the flags, so a config file is refused
DEEPSPEED_CONFIG_FLAGS = ("deepspeed_config", "deepscale", "deepscale_config")


def add_deepspeed_config_args(group) -> None:
    """The flags ``deepspeed.add_config_arguments`` adds, declared here: ``--deepspeed`` (DeepSpeed-Chat's scripts
    pass it; DeepSpeed always runs) is accepted; a config file (``--deepspeed_config``, the deprecated
    ``--deepscale*``) is refused when given (:func:`validate_common`): the config is built from the flags."""
    group.add_argument("--deepspeed", action="store_true",
                       help="Accepted for DeepSpeed-Chat's scripts; no effect: DeepSpeed always runs.")
    group.add_argument("--deepspeed_config", type=str, default=None,
                       help="Refused when given: the DeepSpeed config is built from the flags.")
    group.add_argument("--deepscale", action="store_true",
                       help="Refused when given: deprecated DeepSpeed switch (the config is built from the flags).")
    group.add_argument("--deepscale_config", type=str, default=None,
                       help="Refused when given: deprecated DeepSpeed config file (the config is built from the flags).")


def add_compute_fp32_loss_arg(group) -> None:
    group.add_argument("--compute_fp32_loss", action="store_true",
                       help="Accepted for DeepSpeed-Chat's scripts; no effect: every loss is computed in fp32 "
                            "(logits are upcast, as in transformers 5's own loss, which DeepSpeed-Chat's steps use).")


def add_test_mode_args(group) -> None:
    """DeepSpeed-Chat's step-3 test switches, which its ``tests/test_training.py`` passes through the step-3 sweep
    script (``--enable_test_mode --test_stop_step N``); :func:`apply_test_mode` maps them onto the run length."""
    group.add_argument("--enable_test_mode", action="store_true",
                       help="DeepSpeed-Chat's test mode: stop after --test_stop_step generation batches and after the "
                            "first epoch (the same as --max_steps N/--generation_batches --num_train_epochs 1).")
    group.add_argument("--test_stop_step", type=int, default=0,
                       help="With --enable_test_mode: the generation batch to stop after, as DeepSpeed-Chat counts "
                            "(RL steps: this // --generation_batches; 0 = the end of the first epoch).")


def apply_test_mode(args) -> None:
    """``--enable_test_mode``: one epoch at most, and when ``--test_stop_step`` N > 0 at most the rounds that N
    generation batches complete (DeepSpeed-Chat counts its loop's generation batches: N // ``--generation_batches``
    RL steps; the smaller of that and ``--max_steps`` when both are given). Bad values are refused by
    :func:`validate_common` and step 3's checks (fewer batches than one round)."""
    if args.enable_test_mode:
        args.num_train_epochs = min(args.num_train_epochs, 1)
        rounds = args.test_stop_step // max(getattr(args, "generation_batches", 1), 1)
        if rounds > 0:
            args.max_steps = min(args.max_steps, rounds) if args.max_steps else rounds


def add_deepspeed_args(parser: argparse.ArgumentParser, zero_stage: bool = True):
    g = parser.add_argument_group("ZeRO and precision")
    g.add_argument("--local_rank", type=int, default=-1, help="Set by the launcher.")
    g.add_argument("--offload", action="store_true", help="ZeRO-Offload parameters/optimizer to CPU.")
    g.add_argument("--dtype", type=str, default=None, choices=DTYPES,
                   help="Training precision (default fp16 on a GPU, fp32 on CPU; fp16 needs a GPU).")
    g.add_argument("--torch_autocast", action="store_true",
                   help="With --dtype bf16: keep the weights (and what is saved) in fp32 and run the forward passes "
                        "under torch.autocast, matmuls in bf16 (DeepSpeed's torch_autocast), instead of bf16 "
                        "weights, so that small updates are not rounded away in the weights the model runs with "
                        "(as transformers' bf16=True); slower than bf16 weights.")
    if zero_stage:  # step 3's stages are per role (it refuses --zero_stage in its compatibility group)
        g.add_argument("--zero_stage", type=int, default=0, choices=ZERO_STAGES, help="ZeRO optimisation stage.")
    return g


def add_lora_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("lora")
    g.add_argument("--lora_dim", type=int, default=0, help="LoRA rank; > 0 enables LoRA.")
    g.add_argument("--lora_module_name", type=str, default="decoder.layers.",
                   help="LoRA wraps nn.Linear layers whose name contains this.")
    add_only_optimize_lora_arg(g)
    g.add_argument("--lora_learning_rate", type=float, default=5e-4, help="Learning rate of the LoRA factors.")
    return g


def add_only_optimize_lora_arg(group) -> None:
    group.add_argument("--only_optimize_lora", action="store_true",
                       help="Train only the LoRA factors (a reward model or critic: and its value head).")


def non_negative_int(text: str) -> int:
    """argparse type: an integer ≥ 0 (argparse's own one-line error otherwise)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1 (argparse's own one-line error otherwise)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def seed_int(text: str) -> int:
    """argparse type: a seed numpy and torch accept, 0 … 2**32 − 1."""
    value = int(text)
    if not 0 <= value < 2 ** 32:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**32 - 1, got {value}")
    return value


def adam_beta(text: str) -> float:
    """argparse type: one of Adam's betas, in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def add_num_padding_arg(group) -> None:
    """Steps 2 and 3: where a reward model reads its score depends on the tokenizer's leading pads."""
    group.add_argument("--num_padding_at_beginning", type=non_negative_int, default=1,
                       help="Pad-id tokens every sequence starts with: 1 for OPT (its BOS = pad), 0 for most others.")


def add_eval_args(group) -> None:
    """Steps 2 and DPO: periodic evaluation on the eval split."""
    group.add_argument("--eval_interval", type=int, default=0,
                       help="Evaluate every this many optimizer steps (0 = only before training and after each "
                            "epoch).")
    group.add_argument("--eval_iters", type=int, default=100, help="Maximum eval batches per evaluation (0 = the whole eval split).")


def add_sampling_args(group, do_sample_help: str = "Sample answers (exploration); default greedy, like "
                                                   "DeepSpeed-Chat.") -> None:
    """Sampling flags of step 3 and chat.py (train.py reads step 3's, for the held-out check of sampled answers)."""
    group.add_argument("--do_sample", action="store_true", help=do_sample_help)
    group.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (with --do_sample).")
    group.add_argument("--top_k", type=int, default=0, help="Top-k sampling (0 = off; with --do_sample).")
    group.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling (1 = off; with --do_sample).")


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def check_sampling_args(args) -> None:
    """A finite ``--temperature`` > 0, 0 < ``--top_p`` ≤ 1, ``--top_k`` ≥ 0 (0 = off); and without ``--do_sample``
    (greedy decoding) none of them changed: it would not be used."""
    import math

    from utils.errors import UserInputError

    if not (math.isfinite(args.temperature) and args.temperature > 0 and 0 < args.top_p <= 1 and args.top_k >= 0):
        raise UserInputError("sampling needs --temperature > 0, 0 < --top_p ≤ 1 and --top_k ≥ 0 (got --temperature "
                             f"{args.temperature}, --top_p {args.top_p}, --top_k {args.top_k})")
    if not args.do_sample:
        unused = [f"--{name} {getattr(args, name)}" for name, default in SAMPLING_DEFAULTS.items()
                  if getattr(args, name) != default]
        if unused:
            raise UserInputError(f"{', '.join(unused)} would not be used: without --do_sample answers are greedy "
                                 f"(add --do_sample, or drop {'it' if len(unused) == 1 else 'them'})")


def add_offload_reference_arg(group) -> None:
    """DPO and step 3: the frozen reference model (step 3: and the EMA actor) on the CPU."""
    group.add_argument("--offload_reference_model", action="store_true",
                       help="ZeRO-Offload the frozen reference model (step 3: and the EMA actor) to CPU.")


TENSORBOARD_PATHS = ("step1_tensorboard", "step2_tensorboard", "step3_tensorboard")  # each step's default


def add_logging_args(parser: argparse.ArgumentParser, tensorboard_path: str, print_loss: bool = True):
    g = parser.add_argument_group("logging")
    g.add_argument("--enable_tensorboard", action="store_true", help="Write tensorboard scalars.")
    g.add_argument("--tensorboard_path", type=str, default=tensorboard_path, help="Tensorboard folder.")
    if print_loss:  # step 3 logs its losses every step (it refuses --print_loss in its compatibility group)
        g.add_argument("--print_loss", action="store_true", help="Print the loss of every step.")
    return g


def add_checkpoint_args(parser: argparse.ArgumentParser, unit: str = "optimizer steps"):
    """Resumable checkpoints under ``<output_dir>/checkpoints`` (:mod:`utils.checkpoint`).

    Resume is automatic: rerunning a command whose ``--output_dir`` holds a valid
    checkpoint continues from it. ``--resume`` makes "no checkpoint" an error.
    """
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save_interval", type=int, default=0,
                   help=f"Save a resumable checkpoint every this many {unit} into <output_dir>/checkpoints "
                        "(0 = none). Rerunning the same command resumes from the newest valid one.")
    g.add_argument("--resume", action="store_true",
                   help="Require resuming from a checkpoint in <output_dir>/checkpoints (an error if there is "
                        "none). Without it, a valid checkpoint is still resumed from automatically.")
    g.add_argument("--max_checkpoints", type=int, default=2, help="Keep only the newest this many checkpoints.")
    g.add_argument("--overwrite", action="store_true",
                   help="Start afresh in an --output_dir that holds an earlier run: its model, checkpoints and "
                        "metrics.jsonl are set aside, deleted after the first training step (put back if the run "
                        "fails before). "
                        "Without it a finished run's folder is refused.")
    g.add_argument("--trust_checkpoint", action="store_true",
                   help="Resume from a checkpoint whose files would import Python objects beyond tensors, plain "
                        "data and DeepSpeed's own records (refused otherwise: unpickling them can run code). Only "
                        "for checkpoints you made yourself.")
    return g


def validate_checkpoint_args(args) -> None:
    """``--save_interval`` ≥ 0, ``--max_checkpoints`` ≥ 1; ``--resume`` needs a checkpoint folder to exist
    (and excludes ``--overwrite``)."""
    import os
    import re

    from utils.errors import UserInputError

    if args.save_interval < 0:
        raise UserInputError(f"--save_interval must be ≥ 0 (0 = no checkpoints), got {args.save_interval}")
    if args.max_checkpoints < 1:
        raise UserInputError(f"--max_checkpoints must be ≥ 1, got {args.max_checkpoints}")
    if args.resume and getattr(args, "overwrite", False):
        raise UserInputError("--overwrite starts afresh and --resume continues a run: give one of them")
    if args.resume:
        root = os.path.join(args.output_dir or "", "checkpoints")
        names = os.listdir(root) if args.output_dir and os.path.isdir(root) else []
        if not any(re.match(r"^step-\d{8}$", n) for n in names):
            raise UserInputError(f"--resume: no checkpoint in {root} (drop --resume to start a fresh run)")


# The meaningful range of every shared numeric flag, declared once: (how the flag's name matches, the test, what the
# error says after "--NAME must be "). A flag is found by its exact name or, for "*suffix", by its name's end, so
# step 3's per-role flags (--actor_learning_rate, --critic_dropout …) and every entry point share one table;
# check_number_flags applies it (None, a flag's "not given", is always accepted). Step 3's knobs declare their ranges
# on their config fields (step3_rlhf_finetuning.config.knob), and step 3 passes those along (validate_common's ranges).
def _finite(v):
    import math

    return math.isfinite(v)


NUMBER_RANGES = (
    ("*learning_rate", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    ("*lora_dim", lambda v: v >= 0, "≥ 0 (0 = no LoRA)"),
    ("*weight_decay", lambda v: _finite(v) and v >= 0, "a finite number ≥ 0"),
    ("eval_iters", lambda v: v >= 0, "≥ 0 (0 = the whole eval split)"),
    ("eval_interval", lambda v: v >= 0, "≥ 0 (0 = only before training and after each epoch)"),
    ("num_warmup_steps", lambda v: v >= 0, "≥ 0"),
    ("*dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("beta", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    # step-3 knobs whose range callers check with validate_common alone (the knob's field says so; no other range)
    ("unsup_coef", lambda v: _finite(v) and v >= 0, "a finite number ≥ 0 (0 = no LM loss)"),
    ("clip_reward_value", lambda v: _finite(v) and v > 0, "a finite number > 0 (scores are clipped to ±it: 0 would "
                                                            "make every reward 0)"),
    ("tp_gather_partition_size", lambda v: v >= 1, "≥ 1"),
    ("label_smoothing", lambda v: 0 <= v < 0.5, "in [0, 0.5) (conservative DPO: 0.5 would make the loss constant)"),
    ("preprocessing_num_workers", lambda v: v >= 1, "≥ 1"),
    ("per_device_generation_batch_size", lambda v: v >= 1, "≥ 1"),
    ("per_device_training_batch_size", lambda v: v >= 1, "≥ 1"),
    ("per_device_unsup_batch_size", lambda v: v >= 1, "≥ 1"),
)


def check_number_flags(args, ranges=()) -> None:
    """Every numeric flag of :data:`NUMBER_RANGES` and of ``ranges`` (``(name, (ok, meaning))`` pairs: step 3 passes
    the ranges its knobs declare, :func:`step3_rlhf_finetuning.config.knob_ranges`) within its range: one :class:`UserInputError` line naming the flag and the value otherwise.
    A negative LoRA rank would silently train without LoRA; a negative or NaN
    learning rate would fail deep inside the optimizer; a negative --eval_interval evaluates every step.
    """
    from utils.errors import UserInputError

    for name, value in sorted(vars(args).items()):
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for pattern, ok, meaning in NUMBER_RANGES:
            if (name.endswith(pattern[1:]) if pattern.startswith("*") else name == pattern) and not ok(value):
                raise UserInputError(f"--{name} must be {meaning}, got {value}")
        for flag, (ok, meaning) in ranges:
            if flag == name and not ok(value):
                raise UserInputError(f"--{name} must be {meaning}, got {value}")


LORA_DEFAULTS = {"lora_module_name": "decoder.layers.", "lora_learning_rate": 5e-4}


def check_lora_flags_apply(args) -> None:
    """``--lora_module_name`` / ``--lora_learning_rate`` (step 3: each role's) act only with a LoRA rank > 0: set
    without one, they would be silently ignored."""
    from utils.errors import UserInputError

    for role in ("", "actor_", "critic_"):
        if getattr(args, f"{role}lora_dim", None) != 0:
            continue
        unused = [f"--{role}{name}" for name, default in LORA_DEFAULTS.items()
                  if getattr(args, f"{role}{name}", default) != default]
        if unused:
            raise UserInputError(f"{', '.join(unused)} would not be used: --{role}lora_dim is 0 (no LoRA); give "
                                 f"--{role}lora_dim > 0, or drop {'it' if len(unused) == 1 else 'them'}")


def validate_common(args, ranges=()) -> None:
    """Checks every step shares: a clear error instead of a crash deep inside DeepSpeed. ``ranges``: more
    :func:`check_number_flags` ranges (step 3's knobs')."""
    from utils.data.split import parse_data_split
    from utils.errors import UserInputError

    if getattr(args, "data_split", None) is not None:
        parse_data_split(args.data_split)
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "max_seq_len", "num_train_epochs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserInputError(f"--{name} must be ≥ 1, got {value}")
    if getattr(args, "max_seq_len", None) == 1:
        raise UserInputError("--max_seq_len must be ≥ 2, got 1: a one-token sequence leaves no next token to "
                             "predict (the loss would be NaN)")
    if getattr(args, "test_stop_step", 0) < 0:
        raise UserInputError(f"--test_stop_step must be ≥ 0, got {args.test_stop_step}")
    if getattr(args, "test_stop_step", 0) and not args.enable_test_mode:
        raise UserInputError("--test_stop_step needs --enable_test_mode")
    if getattr(args, "max_steps", 0) < 0:
        raise UserInputError(f"--max_steps must be ≥ 0 (0 = no limit), got {args.max_steps}")
    check_number_flags(args, ranges)
    for name in DEEPSPEED_CONFIG_FLAGS:
        if getattr(args, name, None):
            raise UserInputError(f"--{name} {getattr(args, name)} would not be used: the DeepSpeed config is built "
                                 "from the flags")
    if getattr(args, "add_eot_token", False) and not args.eot_token.strip():
        raise UserInputError("--add_eot_token needs a non-empty --eot_token")
    check_lora_flags_apply(args)
    if not getattr(args, "enable_tensorboard", True) and \
            getattr(args, "tensorboard_path", TENSORBOARD_PATHS[0]) not in TENSORBOARD_PATHS:
        raise UserInputError(f"--tensorboard_path {args.tensorboard_path} would not be used without "
                             "--enable_tensorboard; add it, or drop --tensorboard_path")
    if getattr(args, "only_optimize_lora", False) and getattr(args, "lora_dim", 1) <= 0:
        raise UserInputError("--only_optimize_lora needs --lora_dim > 0")
    if getattr(args, "output_dir", "x") is None:
        raise UserInputError("--output_dir is required")
    if hasattr(args, "save_interval"):
        validate_checkpoint_args(args)


def add_rlhf_role_args(parser: argparse.ArgumentParser, role: str, learning_rate: float):
    """Step 3's per-model flags, once for each role (``actor`` / ``critic``) instead of copy-pasted.

    Adds ``--{role}_learning_rate`` (default ``learning_rate``), ``--{role}_weight_decay``,
    ``--{role}_zero_stage``, ``--{role}_dropout``, ``--{role}_gradient_checkpointing``,
    ``--{role}_lora_dim``, ``--{role}_lora_module_name`` and ``--{role}_lora_learning_rate``
    with DeepSpeed-Chat's defaults.
    """
    g = parser.add_argument_group(role)
    g.add_argument(f"--{role}_learning_rate", type=float, default=learning_rate,
                   help=f"Initial {role} learning rate (after warm-up).")
    g.add_argument(f"--{role}_weight_decay", type=float, default=0.0, help=f"{role} weight decay.")
    g.add_argument(f"--{role}_zero_stage", type=int, default=0, choices=ZERO_STAGES,
                   help=f"ZeRO stage of the {role} (its frozen copy — "
                        f"{'reference/EMA' if role == 'actor' else 'reward'} model — uses 3 if this is 3, else 0).")
    g.add_argument(f"--{role}_dropout", type=float, default=None,
                   help=f"Override the {role}'s dropout fields (default: keep the model's).")
    g.add_argument(f"--{role}_gradient_checkpointing", action="store_true",
                   help=f"Activation checkpointing for the {role}.")
    g.add_argument(f"--{role}_lora_dim", type=int, default=0, help=f"LoRA rank of the {role}; > 0 enables LoRA.")
    g.add_argument(f"--{role}_lora_module_name", type=str, default="decoder.layers.",
                   help=f"LoRA wraps the {role}'s nn.Linear layers whose name contains this.")
    g.add_argument(f"--{role}_lora_learning_rate", type=float, default=5e-4,
                   help=f"Learning rate of the {role}'s LoRA factors.")
    return g
