#!/usr/bin/env python
"""Run the three RLHF steps end to end (DeepSpeed-Chat's ``train.py`` / ``e2e_rlhf.py``).

    python train.py --demo                       # tiny built-in models + data, CPU, a few minutes
    python train.py --actor-model facebook/opt-1.3b --reward-model facebook/opt-350m \\
                    --deployment-type single_gpu  # as in DeepSpeed-Chat
    python train.py --step 3 --actor-model 1.3b --reward-model 350m

Layout (as in the reference)::

    {output}/actor-models/{actor}/    step 1: SFT actor          (+ training.log, metrics.jsonl)
    {output}/reward-models/{reward}/  step 2: reward model       (+ training.log, metrics.jsonl)
    {output}/step3-models/{actor}/    step 3: RL actor (+ critic for PPO)   (+ training.log, metrics.jsonl)
    {output}/summary.json, {output}/training_curves.png

Each step is one child process: a per-size script ``stepN/training_scripts/opt/
{deployment}/run_{size}.sh`` when one exists and GPUs are present (OPT sizes, like
the reference), otherwise a command line built here (``python stepN/main.py`` for
one process, ``deepspeed --num_gpus N`` / ``deepspeed --hostfile H`` for
single_node / multi_node). Its output is streamed to the console and kept in the
step's ``training.log``.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import dataclasses
import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from step3_rlhf_finetuning.algorithms import run_title  # the config and specs are pure: no torch
from step3_rlhf_finetuning.config import (CRITIC_ONLY_FLAGS, KNOB_CLASSES, REWARD, RL, PPOConfig, RewardConfig,
                                          add_knob_args)
from utils.arguments import ZERO_STAGES, HelpFormatter, add_sampling_args, positive_int  # pure: no torch
from utils.errors import BAD_INPUT, DIVERGED, INTERRUPTED, OUT_OF_MEMORY, UserInputError
from utils.run_folder import RUN_LOG, RunFolder
from utils.files import machine_write_failure_line
from utils.preflight import check_output_dir_writable
from utils.launch import deepspeed_launcher, free_port
from utils.model.tiny import CONFIGS as BUILTIN_MODELS

REPO = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Step:
    number: int
    folder: str  # the step's directory in this repository
    kind: str  # output sub-folder prefix: {kind}-models
    title: str
    script: str = "main.py"


STEPS = {
    1: Step(1, "step1_supervised_finetuning", "actor", "supervised fine-tuning (actor)"),
    2: Step(2, "step2_reward_model_finetuning", "reward", "reward model"),
    3: Step(3, "step3_rlhf_finetuning", "step3", "RLHF with PPO"),  # plan_step names the algorithm (step3_title)
}
# Before step 2 with --label-fn: the step-1 actor's sampled answers, ranked by the labelling function
COLLECT = Step(2, "step2_reward_model_finetuning", "comparisons", "comparisons of the step-1 actor's answers",
               "collect_comparisons.py")

# Hyper-parameters of `--demo` (built-in tiny models and data, CPU-friendly), one place to tune.
# They go after train.py's own flags and before --stepN-args, so a user's flags still win.
DEMO_ARGS = {
    # demonstrations of mixed quality (utils/data/builtin.py): the SFT actor imitates their flaws too, so step 3
    # has room to improve it; 10 epochs at 2e-3 without dropout run until the eval perplexity stops improving
    # (the last epoch gains < 0.1 %; seed 7 learns to copy the asked object only in epochs 6-8, and a longer
    # schedule overfits after its 9th epoch)
    1: "--data_path builtin/demonstrations --per_device_train_batch_size 16 --max_seq_len 64 "
       "--learning_rate 2e-3 --num_train_epochs 10 --dropout 0.0",
    # the comparisons of the step-1 actor's own answers (train.py adds --data_path), with the end-score loss
    # (InstructGPT's: DeepSpeed-Chat's span loss compares the tokens of independent answers position by
    # position); starts from the step-1 actor (reward_from_actor), as InstructGPT's reward model
    2: "--per_device_train_batch_size 16 --max_seq_len 64 --learning_rate 1e-3 --dropout 0.0 --num_train_epochs 2 "
       "--reward_loss end --eval_interval 100",
    # 4 answers (sampled from the whole vocabulary) to each of 600 phase-2 prompts, + 100 eval prompts
    "collect": "--num_answers 4 --max_prompts 600 --max_eval_prompts 100 --max_new_tokens 24",
    # sampled answers among the 5 likeliest tokens, actor lr 1e-4, rewards clipped at ±10; KL coefficient 1:
    # the reward model does not see repeated words (its blind spot, docs/reward-gaming.md), and a strong pull
    # to the step-1 actor keeps PPO from drifting into them while it removes what the reward model does see
    3: "--data_path builtin/demonstrations --max_prompt_seq_len 32 "
       "--max_answer_seq_len 24 --do_sample --top_k 5 --max_steps 80 --per_device_generation_batch_size 16 "
       "--per_device_training_batch_size 16 --actor_learning_rate 1e-4 --critic_learning_rate 1e-3 "
       "--kl_ctl 1.0 --clip_reward_value 10 "
       "--actor_dropout 0.0 --critic_dropout 0.0 --num_warmup_steps 0 --lr_scheduler_type constant --enable_ema",
}
DEMO_LABEL_FN = "builtin_preference"  # the demo's "human labeller" (utils/reward_functions.py)
DEMO_QUESTION = "Describe the lamp."
# The demo's actor and reward model (unless --actor-model / --reward-model say otherwise): trained from
# scratch for the same steps, tiny-llama's reward model (rotary positions) learnt to spot a repeated
# word where tiny-opt's stayed near chance; a reward model that misses repeats is what PPO games.
DEMO_MODEL = "tiny-llama"
DEFAULT_MODEL = "tiny-opt"
DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's
# The demo's ~1 M-parameter model runs ~3x faster with one thread per process than with two.
DEMO_CPU_THREADS = "1"

OPT_SIZE = re.compile(r"^(?:facebook/opt-)?(\d+(?:\.\d+)?[mb])$")
REMEDIES = ("  - reduce --per_device_*_batch_size (step 3: --per_device_generation_batch_size / "
            "--per_device_training_batch_size) or --max_seq_len",
            "  - raise the ZeRO stage (--actor-zero-stage / --reward-zero-stage 2 or 3) on several GPUs",
            "  - add --offload, --gradient_checkpointing or --only_optimize_lora (with --lora_dim) "
            "via --stepN-args")


class PlanError(Exception):
    """Something the user can fix before any step is launched."""


# --------------------------------------------------------------------------- models

@dataclass(frozen=True)
class Model:
    name_or_path: str  # what the step's --model_name_or_path receives
    label: str  # folder name under {kind}-models/
    builtin: bool = False
    opt_size: str | None = None  # "1.3b" for facebook/opt-1.3b: selects the per-size script


def parse_model(spec: str) -> Model:
    """``1.3b`` / ``facebook/opt-1.3b`` / a hub name / a local folder / a built-in name -> :class:`Model`."""
    if spec in BUILTIN_MODELS:
        return Model(spec, spec, builtin=True)
    match = OPT_SIZE.match(spec)
    if match:
        return Model(f"facebook/opt-{match.group(1)}", match.group(1), opt_size=match.group(1))
    if os.path.isdir(spec):
        path = os.path.abspath(spec)
        return Model(path, os.path.basename(path.rstrip(os.sep)))
    return Model(spec, spec.rstrip("/").split("/")[-1])


def padding_at_beginning(model: Model) -> str | None:
    """``--num_padding_at_beginning`` for built-in models (OPT-like 1, Llama-like 0); others: the step's default."""
    if model.builtin:
        return "1" if BUILTIN_MODELS[model.name_or_path]["arch"] == "opt" else "0"
    return None


# --------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Run DeepSpeed-Chat's three RLHF steps (SFT -> reward model -> PPO) one after another.",
        formatter_class=HelpFormatter,
        epilog="examples:\n  python train.py --demo\n"
               "  python train.py --actor-model facebook/opt-1.3b --reward-model facebook/opt-350m "
               "--deployment-type single_gpu\n"
               "  python train.py --demo --step 1 2 --step1-args \"--max_steps 3\" --step2-args \"--max_steps 3\"\n"
               "without --demo the steps read Dahoas/rm-static from the Hugging Face hub (network needed)")
    p.add_argument("--step", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3],
                   help="Which steps to run (any subset, run in order).")
    p.add_argument("--actor-model", default=None,
                   help="Actor (steps 1, 3): an OPT size (1.3b, 6.7b, 13b, 66b -> facebook/opt-*), any hub name, "
                        "a local HF folder, or a built-in name (tiny-opt, tiny-llama, small-opt). "
                        f"Default: {DEFAULT_MODEL} ({DEMO_MODEL} with --demo).")
    p.add_argument("--reward-model", default=None,
                   help="Reward model (step 2, critic in step 3): 350m or the same forms as --actor-model. "
                        f"Default: {DEFAULT_MODEL} ({DEMO_MODEL} with --demo).")
    p.add_argument("--actor-zero-stage", type=int, choices=ZERO_STAGES, default=None,
                   help="ZeRO stage of the actor (steps 1, 3); default: the step's (or script's) own.")
    p.add_argument("--reward-zero-stage", type=int, choices=ZERO_STAGES, default=None,
                   help="ZeRO stage of the reward model / critic (steps 2, 3); default: the step's own.")
    p.add_argument("--output-dir", default="./output",
                   help="Results go to {output}/actor-models/, reward-models/, step3-models/.")
    p.add_argument("--deployment-type", default="single_gpu", choices=("single_gpu", "single_node", "multi_node"),
                   help="One GPU (CPU when there is none), all GPUs of this node, or several nodes (--hostfile).")
    p.add_argument("--num-gpus", type=positive_int, default=None,
                   help="single_node: GPUs to use (default: all).")
    p.add_argument("--cpu-ranks", type=cpu_ranks, default=1,
                   help="single_node without GPUs: CPU processes (1 = plain python, >1 = deepspeed launcher).")
    p.add_argument("--hostfile", default=None,
                   help="multi_node: DeepSpeed hostfile (one \"host slots=N\" line per node; default "
                        f"{DEFAULT_HOSTFILE}, DeepSpeed's).")
    for n in STEPS:
        p.add_argument(f"--step{n}-args", default="", metavar="ARGS",
                       help=f"Extra flags for step {n}'s main.py, one quoted string (they win over train.py's).")
    p.add_argument("--label-fn", default=None, metavar="SPEC",
                   help="Before step 2, sample answers from the step-1 actor and rank them with this labelling "
                        "function (built-in builtin_preference, builtin_rule, gsm8k, ifeval, or "
                        "path/to/file.py:function); "
                        f"step 2 trains on those comparisons. Default with --demo: {DEMO_LABEL_FN}.")
    p.add_argument("--collect-args", default="", metavar="ARGS",
                   help="Extra flags for the comparison collector (step2_reward_model_finetuning/"
                        "collect_comparisons.py), one quoted string.")
    p.add_argument("--demo", action="store_true",
                   help="Demo hyper-parameters (built-in data, CPU-friendly sizes); ends with a chatbot answer.")
    p.add_argument("--overwrite", action="store_true",
                   help="Retrain steps whose output folder already holds a finished model (each step deletes its "
                        "old model, checkpoints and metrics.jsonl first); without it such a step is refused.")
    p.add_argument("--dry-run", action="store_true", help="Print the commands without running them.")
    return p


def cpu_ranks(text: str) -> int:
    """argparse type of --cpu-ranks: 1 to this machine's core count (more processes than cores only thrash)."""
    value, cores = int(text), os.cpu_count() or 1
    if not 1 <= value <= cores:
        raise argparse.ArgumentTypeError(f"must be between 1 and {cores} (this machine's cores), got {value}")
    return value


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("step1_args", "step2_args", "step3_args", "collect_args"):
        try:
            shlex.split(getattr(args, name))
        except ValueError as e:  # e.g. "No closing quotation"
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: {e}")
    if args.cpu_ranks > 1 and args.deployment_type != "single_node":
        parser.error(f"--cpu-ranks {args.cpu_ranks} would not be used: CPU ranks are --deployment-type single_node's "
                     f"(got {args.deployment_type})")
    if args.num_gpus is not None and args.deployment_type != "single_node":
        parser.error(f"--num-gpus {args.num_gpus} would not be used: it is --deployment-type single_node's (got "
                     f"{args.deployment_type}: {'one GPU' if args.deployment_type == 'single_gpu' else '--hostfile'})")
    if args.hostfile is not None and args.deployment_type != "multi_node":
        parser.error(f"--hostfile {args.hostfile} would not be used: it is --deployment-type multi_node's (got "
                     f"{args.deployment_type})")
    args.step = sorted(set(args.step))
    args.output_dir = os.path.abspath(args.output_dir)
    args.hostfile = os.path.abspath(args.hostfile or DEFAULT_HOSTFILE)  # the steps run in the repository folder
    args.actor_model = args.actor_model or (DEMO_MODEL if args.demo else DEFAULT_MODEL)
    args.reward_model = args.reward_model or (DEMO_MODEL if args.demo else DEFAULT_MODEL)
    args.actor = parse_model(args.actor_model)
    args.reward = parse_model(args.reward_model)
    args.label_fn = args.label_fn or (DEMO_LABEL_FN if args.demo else None)
    return args


# --------------------------------------------------------------------------- plan

@dataclass
class Launch:
    step: Step
    cmd: list
    out_dir: str
    needs: list = field(default_factory=list)  # (step number, folder) that must hold a model first
    note: str = ""
    tee: bool = True  # False: the per-size script writes training.log itself
    log: str = ""  # where this run logs the step (RunFolder.step_log), once it is launched
    env: dict = field(default_factory=dict)  # set for this step only (a per-size script's HOSTFILE)

    @property
    def size_script(self) -> bool:
        """A DeepSpeed-Chat per-size script runs the step (it tees training.log itself; its own flags are not known
        here)."""
        return not self.tee

    @property
    def log_path(self) -> str:
        return self.log or os.path.join(self.out_dir, RUN_LOG)

    @property
    def command_line(self) -> str:
        """The command as a shell would run it, ``env`` first."""
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.cmd)])


def step_output_dir(args, n: int) -> str:
    model = args.reward if n == 2 else args.actor
    return os.path.join(args.output_dir, f"{STEPS[n].kind}-models", model.label)


def comparisons_dir(args) -> str:
    """Where the comparison collector writes the step-1 actor's ranked answers (``--label-fn``)."""
    return os.path.join(args.output_dir, "comparisons", args.actor.label)


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable torch/CUDA means no GPU
        return 0


def launcher_prefix(args, gpus: int) -> tuple[list, str]:
    """How to start one step's ``main.py``: (command prefix, note for the user)."""
    if args.deployment_type == "multi_node":
        return [deepspeed_launcher(), "--hostfile", args.hostfile], f"multi_node: hosts from {args.hostfile}"
    if gpus == 0:
        ranks = args.cpu_ranks if args.deployment_type == "single_node" else 1
        if ranks > 1:
            return ([deepspeed_launcher(), "--num_gpus", str(ranks), "--master_port", str(free_port())],
                    f"no GPU found: {args.deployment_type} runs {ranks} CPU ranks")
        return [sys.executable], f"no GPU found: {args.deployment_type} runs on the CPU in one process"
    n = 1 if args.deployment_type == "single_gpu" else (args.num_gpus or gpus)
    return [deepspeed_launcher(), "--num_gpus", str(n), "--master_port", str(free_port())], f"{n} GPU(s)"


def reward_from_actor(args) -> bool:
    """Whether step 2 starts from the step-1 actor instead of the bare model (``--demo`` with one model for both).

    As in InstructGPT (the reward model is the SFT model with a value head): the tiny models start
    random, and the SFT actor already knows the answer template and which object was asked about, so
    the reward model learns the object and repeat checks in a few epochs instead of dozens.
    """
    return args.demo and args.reward_model == args.actor_model


class _LenientParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse_step3_knobs(flags: list) -> argparse.Namespace:
    """Step 3's RL, reward and sampling knobs as ``flags`` set them, parsed once with the knobs' own declarations
    (:func:`step3_rlhf_finetuning.config.knob`: no torch). Names are kept as given (step 3's own parser refuses an
    unknown one: :func:`check_step_flags`); flags it cannot parse leave every knob at its default."""
    parser = _LenientParser(add_help=False)
    for title in (RL, REWARD):
        for cls in KNOB_CLASSES:
            add_knob_args(parser, cls, title)
    add_sampling_args(parser)
    for action in parser._actions:
        action.choices = None
    try:
        return parser.parse_known_args(flags)[0]
    except ValueError:
        return parser.parse_known_args([])[0]


def step3_knobs(args) -> argparse.Namespace:
    """:func:`parse_step3_knobs` of this run's step-3 flags (the demo's and ``--step3-args``), parsed once per run;
    :func:`check_step_flags` later keeps step 3's full parse (:func:`step_namespace`)."""
    key = (args.demo, args.step3_args)
    cached = getattr(args, "_step3_knobs", None)
    if cached is None or cached[0] != key:
        flags = (shlex.split(DEMO_ARGS[3]) if args.demo else []) + shlex.split(args.step3_args)
        args._step3_knobs = cached = (key, parse_step3_knobs(flags))
    return cached[1]


def step_namespace(args, n) -> argparse.Namespace | None:
    """Step ``n``'s (or "collect"'s) flags as its own parser read them in :func:`check_step_flags`, or None."""
    return getattr(args, "step_namespaces", {}).get(n)


def _knobs(flags_or_knobs) -> argparse.Namespace:
    return parse_step3_knobs(flags_or_knobs) if isinstance(flags_or_knobs, list) else flags_or_knobs


def step3_models(knobs) -> tuple[bool, bool]:
    """(critic, reward model): which step-2-based models step 3 builds with these knobs (:func:`step3_knobs`, or a
    list of flags). A critic for PPO only; a reward model unless a reward function alone scores (``--reward_fn``
    without ``--reward_fn_weight``)."""
    knobs = _knobs(knobs)
    try:
        critic = PPOConfig(advantage_estimator=knobs.advantage_estimator).uses_critic
    except ValueError:  # an unknown estimator: step 3 refuses it with its own message
        return True, True
    return critic, RewardConfig(fn=knobs.reward_fn, fn_weight=knobs.reward_fn_weight).uses_model


def step3_title(knobs) -> str:
    """Step 3's algorithm as its knobs (:func:`step3_knobs`, or a list of flags) choose it ("PPO", "GRPO", "GRPO with
    GSPO's loss"): train.py's step name and the summary's, so a critic-free run is not called PPO."""
    knobs = _knobs(knobs)
    try:
        return run_title(knobs.advantage_estimator, knobs.policy_loss)
    except ValueError:  # an unknown name: step 3's parser refuses it with its own message
        return run_title(PPOConfig.advantage_estimator, PPOConfig.policy_loss)


def step3_uses_step2(args) -> bool:
    """Whether step 3 reads the step-2 folder (for its critic or its reward model)."""
    return any(step3_models(step3_knobs(args)))


def drop_flags(flags: list, names) -> list:
    """``flags`` without ``--name [value]`` for each of ``names``."""
    out, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        if flag.startswith("--") and flag[2:] in names:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(flag)
    return out


def step_flags(args, n: int) -> list:
    """The flags train.py itself gives step ``n`` (models, output, ZeRO stages, padding)."""
    out = step_output_dir(args, n)
    flags = ["--data_output_path", os.path.join(args.output_dir, "data_files"), "--output_dir", out]
    if n in (1, 2):
        model, zero = (args.actor, args.actor_zero_stage) if n == 1 else (args.reward, args.reward_zero_stage)
        start = step_output_dir(args, 1) if n == 2 and reward_from_actor(args) else model.name_or_path
        flags += ["--model_name_or_path", start]
        if n == 2 and args.label_fn:  # the collected comparisons, all of them for phase 2
            flags += ["--data_path", comparisons_dir(args), "--data_split", "0,1,0"]
        if zero is not None:
            flags += ["--zero_stage", str(zero)]
    else:
        flags += ["--actor_model_name_or_path", step_output_dir(args, 1)]
        if step3_uses_step2(args):
            flags += ["--critic_model_name_or_path", step_output_dir(args, 2)]
        if args.actor_zero_stage is not None:
            flags += ["--actor_zero_stage", str(args.actor_zero_stage)]
        if args.reward_zero_stage is not None:
            flags += ["--critic_zero_stage", str(args.reward_zero_stage)]
    npab = padding_at_beginning(args.reward) if n in (2, 3) else None
    if npab is not None:
        flags += ["--num_padding_at_beginning", npab]
    return flags


def extra_flags(args, n: int) -> list:
    demo = shlex.split(DEMO_ARGS[n]) if args.demo else []
    user = shlex.split(getattr(args, f"step{n}_args"))
    if n == 3 and demo and not step3_models(step3_knobs(args))[0]:  # critic-free: the demo's critic flags go
        demo = drop_flags(demo, CRITIC_ONLY_FLAGS)
    return demo + (["--overwrite"] if args.overwrite else []) + user


def size_script(args, n: int, gpus: int) -> str | None:
    """DeepSpeed-Chat's per-size script for this step, when one applies and exists."""
    size = (args.reward if n == 2 else args.actor).opt_size
    if gpus == 0 or size is None:
        return None
    script = os.path.join(REPO, STEPS[n].folder, "training_scripts", "opt", args.deployment_type, f"run_{size}.sh")
    return script if os.path.isfile(script) else None


def flag_value(flags: list, name: str) -> list:
    """The values given to ``name`` in ``flags`` (the last occurrence wins, as argparse), or []."""
    values = []
    for i, flag in enumerate(flags):
        if flag == name:
            values = []
            for value in flags[i + 1:]:
                if value.startswith("--"):
                    break
                values.append(value)
    return values


def plan_collect(args) -> Launch:
    """The comparison collector before step 2 (``--label-fn``): the step-1 actor answers the phase-2 prompts of
    step 1's ``--data_path``; one process (a GPU when there is one)."""
    out = comparisons_dir(args)
    data = flag_value(extra_flags(args, 1), "--data_path")
    demo = shlex.split(DEMO_ARGS["collect"]) if args.demo else []
    cmd = [sys.executable, os.path.join(REPO, COLLECT.folder, COLLECT.script), "--actor_model_name_or_path",
           step_output_dir(args, 1), "--label_fn", args.label_fn, "--output_dir", out, "--data_output_path",
           os.path.join(args.output_dir, "data_files"), *(["--data_path", *data] if data else []), *demo,
           *(["--overwrite"] if args.overwrite else []), *shlex.split(args.collect_args)]
    return Launch(COLLECT, cmd, out, [(1, step_output_dir(args, 1))], note=f"labelled by {args.label_fn}")


def plan_step(args, n: int, gpus: int) -> Launch:
    step = STEPS[n]
    if n == 3:
        step = dataclasses.replace(step, title=f"RLHF with {step3_title(step3_knobs(args))}")
    out = step_output_dir(args, n)
    needs = [(1, step_output_dir(args, 1))] + ([(2, step_output_dir(args, 2))] if step3_uses_step2(args) else []) \
        if n == 3 else []
    if n == 2 and reward_from_actor(args):
        needs = [(1, step_output_dir(args, 1))]
    script = size_script(args, n, gpus)
    if script is not None:
        zero = lambda z: "" if z is None else str(z)  # noqa: E731 - the scripts take '' for "their default"
        if n == 3:
            positional = [step_output_dir(args, 1), step_output_dir(args, 2), zero(args.actor_zero_stage),
                          zero(args.reward_zero_stage), out]
        else:
            positional = [out, zero(args.actor_zero_stage if n == 1 else args.reward_zero_stage)]
        env = {"HOSTFILE": args.hostfile} if args.deployment_type == "multi_node" else {}
        return Launch(step, ["bash", script, *positional, *extra_flags(args, n)], out, needs,
                      note=f"per-size script {os.path.relpath(script, REPO)}", tee=False, env=env)
    prefix, note = launcher_prefix(args, gpus)
    main_py = os.path.join(REPO, step.folder, "main.py")
    return Launch(step, [*prefix, main_py, *step_flags(args, n), *extra_flags(args, n)], out, needs, note)


def make_plan(args, gpus: int) -> list:
    plan = []
    for n in args.step:
        if n == 2 and args.label_fn:
            plan.append(plan_collect(args))
        plan.append(plan_step(args, n, gpus))
    return plan


# --------------------------------------------------------------------------- checks

def has_model(folder: str) -> bool:
    """A step's output folder holds a finished run (:meth:`utils.run_folder.RunFolder.finished`)."""
    return RunFolder(folder).finished()


def produced(launch: Launch) -> bool:
    """Whether ``launch``'s output folder holds its result: a finished run (the collector's: its comparisons, all
    written; :meth:`utils.run_folder.RunFolder.finished`)."""
    return RunFolder(launch.out_dir).finished(model=launch.step is not COLLECT)


def finished_steps(args, plan: list) -> list:
    """The planned steps whose output folder already holds a finished result."""
    return [launch.step.number for launch in plan if produced(launch)]


def check_inputs(args, plan: list) -> None:
    """Refuse before launching anything when a step's input model is missing and no earlier step makes it,
    or when a step would overwrite a finished model without ``--overwrite``."""
    done = [] if args.overwrite else finished_steps(args, plan)
    if done:
        todo = [launch.step.number for launch in plan if launch.step.number not in done]
        lines = [f"step {launch.step.number}'s output folder {launch.out_dir} already holds a finished "
                 f"{'run' if launch.step is COLLECT else 'model'}" for launch in plan if produced(launch)]
        rest = f", or run only the other steps (--step {' '.join(map(str, todo))})" if todo else ""
        raise PlanError("\n".join(lines) + "\n  pass --overwrite to train it again (its old model, checkpoints "
                        f"and metrics.jsonl are deleted first){rest}, or use another --output-dir")
    will_make = set()
    for launch in plan:
        missing = [(n, folder) for n, folder in launch.needs if n not in will_make and not has_model(folder)]
        if missing:
            lines = [f"step {launch.step.number} needs the step-{n} model, but {folder} holds none"
                     for n, folder in missing]
            steps = " ".join(str(n) for n, _ in missing)
            raise PlanError("\n".join(lines) + f"\n  train it first: python train.py --step {steps} "
                            f"--actor-model {args.actor_model} --reward-model {args.reward_model} "
                            f"--output-dir {args.output_dir}")
        will_make.add(launch.step.number)
    if args.deployment_type == "multi_node" and not os.path.isfile(args.hostfile):
        raise PlanError(f"multi_node needs a DeepSpeed hostfile; {args.hostfile} does not exist (--hostfile)")
    for launch in plan:
        main_py = os.path.join(REPO, launch.step.folder, launch.step.script)
        if not os.path.isfile(main_py):
            raise PlanError(f"step {launch.step.number}: {main_py} is missing from this checkout")


def step_argv(args, launch: Launch) -> list:
    """The flags ``launch``'s script parses: its command after the script (a per-size script's own flags are not
    known here: train.py's flags and the extra ones stand in for them)."""
    if launch.step is COLLECT:
        return launch.cmd[2:]
    n = launch.step.number
    return step_flags(args, n) + extra_flags(args, n)


def check_step_flags(args, plan: list) -> None:
    """Each step's flags are parsed by that step's own parser before anything runs, so an unknown flag or a bad
    value in ``--step3-args`` is refused now rather than after steps 1 and 2 have trained (minutes here, hours on
    real models); so are a ``--label-fn`` or step 3 ``--reward_fn`` file that does not exist or lacks the function,
    and whatever a step's own flag checks (its ``validate_flags``: step 3's) refuse, e.g. GRPO with one answer per
    prompt."""
    import contextlib
    import importlib
    import io

    from utils.data.raw_datasets import from_hub
    from utils.reward_functions import load_reward_fn

    args.step_namespaces = {}  # each step's parse, kept for what train.py derives from its flags (step_namespace)
    for launch in plan:
        module = f"{launch.step.folder}.{launch.step.script.removesuffix('.py')}"
        which = "--collect-args" if launch.step is COLLECT else f"--step{launch.step.number}-args"
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                step_module = importlib.import_module(module)
                parsed = step_module.parse_args([str(a) for a in step_argv(args, launch)])
        except SystemExit as e:
            if not e.code:
                raise
            said = [line.split("error: ", 1)[1] for line in errors.getvalue().splitlines() if "error: " in line]
            raise PlanError(f"step {launch.step.number} ({launch.step.title}) would refuse its flags: "
                            f"{said[-1] if said else errors.getvalue().strip()} (check {which}); nothing was run")
        args.step_namespaces["collect" if launch.step is COLLECT else launch.step.number] = parsed
        for flag in ("label_fn", "reward_fn"):
            spec = getattr(parsed, flag, None)
            if spec:
                named = "--label-fn" if flag == "label_fn" else f"--{flag} (in {which})"
                try:
                    load_reward_fn(spec, flag=named)
                except UserInputError as e:
                    raise PlanError(f"{e}; nothing was run") from None
        # a per-size script's own flags are not known here: the checks could refuse what they would have made right
        if hasattr(step_module, "validate_flags") and not launch.size_script:
            try:
                step_module.validate_flags(parsed)
            except UserInputError as e:
                raise PlanError(f"step {launch.step.number} ({launch.step.title}) would refuse its flags: {e} "
                                f"(check {which}); nothing was run") from None
        # and its data, where it can be read without a model (the rows a built-in reward or labelling function reads);
        # data from the hub are left to the steps (step 1 fetches them first)
        if hasattr(step_module, "check_data") and not launch.size_script \
                and not any(from_hub(name) for name in getattr(parsed, "data_path", [])):
            try:
                step_module.check_data(parsed)
            except UserInputError as e:
                raise PlanError(f"step {launch.step.number} ({launch.step.title}) would refuse its data: {e} "
                                f"(check {which} and its --data_path); nothing was run") from None


# --------------------------------------------------------------------------- running

def run_logged(cmd: list, log_path: str | None, env: dict) -> int:
    """Run ``cmd``, streaming its output (stdout + stderr) to the console and to ``log_path`` (if given)."""
    with open(log_path or os.devnull, "wb") as log:
        log.write(("$ " + shlex.join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        fd, interrupted = proc.stdout.fileno(), False
        while True:
            try:
                while chunk := os.read(fd, 65536):  # raw chunks, so tqdm's \r updates show up live
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                    log.write(chunk)
                    log.flush()
                break
            except KeyboardInterrupt:
                # Ctrl-C in a terminal reaches the step too: give it a moment to stop by itself (and say
                # where it stopped), then pass the interrupt on; a second Ctrl-C ends it at once
                if interrupted:
                    proc.kill()
                    break
                interrupted = True
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.terminate()
            return proc.wait()


def child_env(cpu_threads: str | None = None) -> dict:
    """The steps' environment: unbuffered output, this interpreter's ``python``/``deepspeed`` first on PATH.

    ``cpu_threads`` sets ``OMP_NUM_THREADS`` unless the user already did.
    """
    bin_dir = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)  # works without `pip install -e .`
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHON=sys.executable, PYTHONPATH=path,
               PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    if cpu_threads is not None:
        env.setdefault("OMP_NUM_THREADS", cpu_threads)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a fresh process group per step
        env.pop(key, None)
    return env


def fmt_time(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


OOM_SIGNS = ("out of memory", "OutOfMemoryError", "CUDA error: out of memory", "Cannot allocate memory")


def looks_out_of_memory(launch: Launch, rc: int) -> bool:
    """Killed by the kernel (SIGKILL: the OOM killer) or an out-of-memory message at the end of the log."""
    if rc in (-9, 137):
        return True
    try:
        with open(launch.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(launch.log_path) - 20000))
            tail = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(sign in tail for sign in OOM_SIGNS)


def failure_message(launch: Launch, rc: int) -> str:
    """What failed and where its log is; memory advice only when it looks like memory, not after bad input."""
    lines = [f"error: step {launch.step.number} ({launch.step.title}) failed with exit status {rc}",
             f"  log: {launch.log_path}", f"  command: {launch.command_line}"]
    if rc == BAD_INPUT:
        lines.append("  the step refused its input: see its error line above")
    elif rc == DIVERGED:
        lines.append("  training diverged (a non-finite loss or reward): see its error line above")
    elif rc == OUT_OF_MEMORY or looks_out_of_memory(launch, rc):
        lines += ["  it ran out of memory; try:", *REMEDIES]
    return "\n".join(lines)


def interrupted_message(args, launch: Launch) -> str:
    n = launch.step.number
    rest = " ".join(str(m) for m in args.step if m >= n)
    done = [str(m) for m in args.step if m < n]
    finished = f"step {', '.join(done)} finished; " if done else ""
    return (f"interrupted in step {n} ({launch.step.title}); {finished}to continue, rerun the same command "
            f"with --step {rest} (step {n} resumes from its newest checkpoint, if it saved one)")


def run_step(args, launch: Launch, env: dict) -> float:
    """Launch one step; returns its wall time. Exits (status ≠ 0) when it fails or saves no model.

    ``metrics.jsonl`` is the step's business (a fresh run starts it afresh, a resumed run keeps the
    rows up to the resumed step), the same rule as running the step by hand.
    """
    folder = RunFolder(launch.out_dir)
    earlier_run = folder.run_id()
    if launch.tee:  # beside the folder while it holds an earlier run, so that a refused rerun leaves its log
        launch.log = folder.step_log()
    else:
        os.makedirs(launch.out_dir, exist_ok=True)
    print(f"---=== Running Step {launch.step.number}: {launch.step.title} ({launch.note}) ===---", flush=True)
    print(f"$ {launch.command_line}", flush=True)
    start = time.time()
    rc = run_logged(launch.cmd, launch.log_path if launch.tee else None, {**env, **launch.env})
    elapsed = time.time() - start
    if launch.tee:
        launch.log = folder.adopt_log(launch.log, earlier_run, rc == 0)
    if rc in (INTERRUPTED, -signal.SIGINT):
        print(interrupted_message(args, launch), file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    if rc != 0:
        print(failure_message(launch, rc), file=sys.stderr, flush=True)
        sys.exit(rc if 0 < rc < 256 else 1)
    if not produced(launch):
        print(f"error: step {launch.step.number} exited normally but saved no result in {launch.out_dir}\n"
              f"  log: {launch.log_path}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"---=== Finished Step {launch.step.number} in {fmt_time(elapsed)} ===---", flush=True)
    return elapsed


def model_dir(folder: str) -> str | None:
    """Where a step's output folder holds its model (step 3: ``actor/``), or None."""
    return RunFolder(folder).model_dir()


def chat_once(actor_dir: str, question: str) -> None:
    """Pipe one question into the chatbot (as a user would) and show the answer."""
    print(f"---=== Chatbot ({actor_dir}) ===---\nHuman: {question}", flush=True)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "chat.py"), "--path", actor_dir,
                           "--max_new_tokens", "32"], input=f"{question}\nquit\n", text=True,
                          capture_output=True, cwd=REPO, env=child_env())
    if proc.returncode != 0:
        print(f"warning: the chatbot failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
    else:
        print(proc.stdout.strip(), flush=True)


def builtin_dataset(args) -> str | None:
    """The built-in dataset (``--data_path builtin/...``) the run's steps train on, or None."""
    for n in args.step:
        for value in flag_value(extra_flags(args, n), "--data_path"):
            if value.startswith("builtin/"):
                return value
    return None


def step3_sampling(args) -> dict | None:
    """Step 3's sampling settings ``{"temperature", "top_k", "top_p"}`` from its flags, or None if it ran greedy."""
    if 3 not in args.step:
        return None
    flags = step_namespace(args, 3) or step3_knobs(args)  # step 3's own parse once check_step_flags ran
    return {"temperature": flags.temperature, "top_k": flags.top_k, "top_p": flags.top_p} if flags.do_sample else None


def heldout_check(folders: dict, dataset: str, sampling: dict | None = None) -> dict | None:
    """Rule scores of the step-1/step-3 actors' answers and the RM's accuracy per kind (:mod:`utils.heldout`).

    ``sampling``: step 3's sampling settings (:func:`step3_sampling`), to score sampled answers too.
    A failure is a warning: the steps' results stand without it.
    """
    from utils.heldout import heldout_check as check

    print(f"---=== Held-out check on {dataset} (no reward model for the actors' answers) ===---", flush=True)
    try:
        return check({1: folders[1], 3: folders[3]}, folders[2], dataset, sampling)
    except Exception as e:  # noqa: BLE001 - report and go on to the summary
        print(f"warning: the held-out check failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None


def main(args) -> int:
    gpus = gpu_count()
    plan = make_plan(args, gpus)
    if args.dry_run:
        for launch in plan:
            print(f"# step {launch.step.number}: {launch.step.title} ({launch.note}); log: {launch.log_path}")
            print(launch.command_line)
        return 0
    try:
        check_output_dir_writable(args.output_dir, "--output-dir")
        top = RunFolder(args.output_dir)
        top.lock()  # two train.py runs on one --output-dir would mix their logs (held until this process ends)
        check_inputs(args, plan)
        check_step_flags(args, plan)
    except (PlanError, UserInputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from utils.summary import write_summary

    env = child_env(DEMO_CPU_THREADS if args.demo and gpus == 0 else None)
    times, start = {}, time.time()
    for launch in plan:
        times[launch.step.number] = run_step(args, launch, env)
    total = time.time() - start
    print(f"---=== Finished Steps {args.step} in {fmt_time(total)} ===---", flush=True)
    folders = {n: step_output_dir(args, n) for n in STEPS}
    dataset = builtin_dataset(args)
    heldout = heldout_check(folders, dataset, step3_sampling(args)) if dataset else None
    print(write_summary(args.output_dir, folders, times, heldout,
                        step3_title(step_namespace(args, 3) or step3_knobs(args))), flush=True)
    actor = model_dir(folders[3] if 3 in args.step else folders[1])
    if args.demo and actor:
        chat_once(actor, DEMO_QUESTION)
    elif actor:
        print(f"Chat with the actor: python chat.py --path {actor}")
    return 0


if __name__ == "__main__":
    from utils.interrupt import raise_on_ctrl_c

    try:
        raise_on_ctrl_c()  # the plan starts: Ctrl-C is handled below and in run_logged
        sys.exit(main(parse_args()))
    except KeyboardInterrupt:  # between steps (a running step is handled in run_logged)
        print("\ninterrupted between steps; the steps reported as finished are complete (rerun the others "
              "with --step)", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    except UserInputError as e:  # e.g. the summary could not be written
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    except Exception as e:  # a full disk writing training.log or the summary: one line, not a traceback
        line = machine_write_failure_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
