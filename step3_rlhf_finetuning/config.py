"""Step 3's configuration: explicit objects built once from the flags by :meth:`Step3Config.from_args`.

The engine (:class:`~step3_rlhf_finetuning.rlhf_engine.DeepSpeedRLHFEngine`) reads an
:class:`EngineConfig`, the trainer (:class:`~step3_rlhf_finetuning.ppo_trainer.DeepSpeedPPOTrainer`)
a :class:`PPOConfig`, a :class:`RewardConfig` and a :class:`GenerationConfig`; neither sees the
argparse namespace.

Each step-3 knob is declared once, as a :func:`knob` field: its default, its help text, its flag's name (the
field's unless ``flag=``), its choices, its range and its help group. Step 3's command line
(:mod:`step3_rlhf_finetuning.cli`) adds a flag for each (:func:`add_knob_args`), :meth:`Step3Config.from_args` copies
each back (:func:`from_args_fields`) and the range checks read the declared ranges (:func:`knob_ranges`), so a
test builds ``PPOConfig(kl_ctl=0.2)`` and a new knob is one field.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Callable, NamedTuple

from step3_rlhf_finetuning.algorithms import (ESTIMATOR_ALIASES, ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                                              EstimatorSpec, PolicyLossSpec, default_help, estimator_spec,
                                              policy_loss_spec, run_title)

if TYPE_CHECKING:  # this module stays free of torch: train.py reads the RL rules from it
    from utils.training import OptimConfig


# --------------------------------------------------------------------------- knobs

class Check(NamedTuple):
    """One range check of a knob: ``ok(value)``, else "--FLAG must be ``meaning``, got VALUE"."""
    ok: Callable
    meaning: str


def _finite(v) -> bool:
    return math.isfinite(v)


# SHARED_RANGE: the knob's range sits in utils.arguments.NUMBER_RANGES instead (callers check it with
# utils.arguments.validate_common alone, and utils never imports a step); every other knob declares its range here.
AT_LEAST_1 = (Check(lambda v: v >= 1, "≥ 1"),)
FINITE_AT_LEAST_0 = (Check(lambda v: _finite(v) and v >= 0, "a finite number ≥ 0"),)
UNIT_INTERVAL = FINITE_AT_LEAST_0 + (Check(lambda v: v <= 1, "between 0 and 1"),)  # a discount, GAE's λ


def knob(default, help, *, flag: str | None = None, group: str | None = None, range: tuple = (),
         choices=None, metavar: str | None = None, action=None, negate: bool = False, shared: bool = False):
    """A config field that is a step-3 flag. ``help`` and ``choices`` may be callables (evaluated when the parser is
    built, so this module need not import what they name). ``flag``: the flag's name when it is not the field's;
    ``negate``: the flag is a switch that turns the field off (``--unpin_actor_parameters`` → ``pin_parameters``);
    ``shared``: the flag is declared by a shared helper of :mod:`utils.arguments` (the sampling flags), so the parser
    leaves it out and only :meth:`Step3Config.from_args` reads it; ``range``: :class:`Check` s, in order (a value of
    None, "not given", passes)."""
    return field(default=default, metadata={"knob": True, "help": help, "flag": flag, "group": group,
                                            "range": tuple(range), "choices": choices, "metavar": metavar,
                                            "action": action, "negate": negate, "shared": shared})


def _resolve(value):
    return value() if callable(value) else value


def knob_fields(cls) -> list:
    """The :func:`knob` fields of a config dataclass, in declaration order."""
    return [f for f in fields(cls) if f.metadata.get("knob")]


def flag_name(f) -> str:
    """The flag (its argparse ``dest``) of a :func:`knob` field."""
    return f.metadata["flag"] or f.name


def field_defaults(cls) -> dict:
    """``{field: default}`` of a config dataclass (before ``__post_init__`` resolves any): the flags' defaults."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def add_knob_args(group, cls, group_title: str) -> None:
    """Add to argparse ``group`` one flag for each :func:`knob` of ``cls`` whose help group is ``group_title``: its
    name, type (the field's), default, choices, metavar and help all from the declaration."""
    import argparse

    for f in knob_fields(cls):
        meta = f.metadata
        if meta["shared"] or meta["group"] != group_title:
            continue
        kwargs = {"help": _resolve(meta["help"])}
        kind = f.type.split("|")[0].strip() if isinstance(f.type, str) else f.type.__name__
        if meta["action"] == "boolean_optional":
            kwargs.update(action=argparse.BooleanOptionalAction, default=f.default)
        elif kind == "bool":
            kwargs.update(action="store_true")
        else:
            kwargs.update(default=f.default)
            if meta["choices"] is not None:
                kwargs["choices"] = tuple(_resolve(meta["choices"]))
            elif kind in ("int", "float"):
                kwargs["type"] = {"int": int, "float": float}[kind]
            else:
                kwargs["type"] = str
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
        group.add_argument(f"--{flag_name(f)}", **kwargs)


def from_args_fields(cls, args, **overrides):
    """``cls`` built from the parsed flags: each :func:`knob` field from its flag, the rest from ``overrides``."""
    values = {}
    for f in knob_fields(cls):
        value = getattr(args, flag_name(f))
        values[f.name] = (not value) if f.metadata["negate"] else value
    values.update(overrides)
    return cls(**values)


def knob_ranges(classes=None) -> tuple:
    """``(flag, Check)`` for every declared range of the step-3 knobs (:func:`utils.arguments.check_number_flags`
    applies them with the shared flags' :data:`utils.arguments.NUMBER_RANGES`)."""
    classes = classes or KNOB_CLASSES
    return tuple((flag_name(f), check) for cls in classes for f in knob_fields(cls) for check in f.metadata["range"])


def _builtin_reward_fns() -> str:
    from utils.reward_functions import BUILTIN

    return ", ".join(BUILTIN)


def _generation_backends() -> tuple:
    from utils.generation import BACKENDS

    return BACKENDS


def _kl_estimators() -> tuple:
    from utils.rl_math import KL_ESTIMATORS

    return KL_ESTIMATORS


def _estimator_help() -> str:
    specs = ESTIMATORS.values()
    return ("; ".join(f"{s.name} = {s.title}" + (f" ({', '.join(s.aliases)})" if s.aliases else "") for s in specs)
            + ". Only gae has a critic; " + ", ".join(s.name for s in specs if s.group)
            + " compare the answers of one prompt (--n_samples_per_prompt ≥ 2). docs/algorithms.md.")


# --------------------------------------------------------------------------- the configs

DATA, REWARD, RL, DAPO, PPO, GENERATION, HYBRID = ("step 3 data", "reward", "RL algorithm", "DAPO's pieces", "PPO",
                                                   "generation", "hybrid engine and offload")


@dataclass(frozen=True)
class GenerationConfig:
    """How the actor answers (``--max_*_seq_len``, sampling, ``--generation_backend``, ``--generation_dtype``)."""
    max_prompt_seq_len: int = knob(256, "Prompts are left-padded to this; longer prompts are dropped (with a count).",
                                   group=DATA, range=AT_LEAST_1)
    max_answer_seq_len: int = knob(256, "Tokens generated per answer (at most).", group=DATA, range=AT_LEAST_1)
    do_sample: bool = knob(False, None, shared=True)  # utils.arguments.add_sampling_args (shared with chat.py)
    temperature: float = knob(1.0, None, shared=True)
    top_k: int = knob(0, None, shared=True)
    top_p: float = knob(1.0, None, shared=True)
    backend: str = knob("auto", "How the actor generates: cuda-graph (static KV cache, decode step replayed as a CUDA "
                                "graph), static (same cache, eager), hf (model.generate); auto = cuda-graph on a GPU, "
                                "hf on CPU. Falls back to hf, saying why, for unchecked architectures, and under "
                                "ZeRO-3 when a whole-weight copy of the actor would not fit in memory.",
                        flag="generation_backend", group=GENERATION, choices=_generation_backends)
    dtype: str | None = knob(  # generate from a copy of the actor in this dtype (None: the actor)
        None, "Generate from a bf16 copy of the actor, refreshed from its weights before each generation (default: "
              "the actor itself). With --torch_autocast the actor's weights are fp32 and generation runs the norms "
              "and the KV cache in fp32; the copy is faster. The training pass and its log-probs stay on the actor. "
              "Costs 2 bytes of memory a parameter (under ZeRO-3 only during generation: gathered once per "
              "rollout, freed after it). Not with the hybrid engine.",
        flag="generation_dtype", group=GENERATION, choices=("bf16",))
    eot_token: str | None = None  # the answer-ending token besides the EOS: the chat template's end of turn
    # (--apply_chat_template) or the --eot_token that --add_eot_token added; else None
    print_answers: bool = knob(False, "Print prompts and answers during training.", group=GENERATION)
    print_answers_interval: int = knob(1, "... every this many generation batches.", group=GENERATION,
                                       range=AT_LEAST_1)

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution answers are drawn from (1 when greedy), as TRL."""
        return self.temperature if self.do_sample else 1.0


# Flags only the critic reads: refused when no critic is built (a critic-free --advantage_estimator)
CRITIC_ONLY_FLAGS = ("critic_learning_rate", "critic_weight_decay", "critic_zero_stage", "critic_dropout",
                     "critic_gradient_checkpointing", "critic_lora_dim", "critic_lora_module_name",
                     "critic_lora_learning_rate", "cliprange_value", "lam", "critic_value_head", "align_overflow")
VALUE_HEADS = ("reward_model", "zero")  # --critic_value_head: where the critic's value head starts
DYNAMIC_SAMPLING_BATCHES = 4  # --dynamic_sampling_max_batches left unset: this many times --generation_batches
EMA_BETA = 0.992


@dataclass(frozen=True)
class PPOConfig:
    """The RL update: advantage estimator, policy loss and its aggregation, samples per prompt, KL penalty, clipping,
    GAE, DAPO's pieces, passes, unsupervised mixing, fp16 overflow handling. Fields left None take the defaults of
    the estimator's or the policy loss's spec (:mod:`step3_rlhf_finetuning.algorithms`): ``use_kl_loss``,
    ``kl_estimator``, ``loss_agg`` (the policy loss's where it fixes one, else the estimator's), ``cliprange`` and
    ``cliprange_high`` (``--cliprange`` when only that is given); ``dynamic_sampling_max_batches``:
    :data:`DYNAMIC_SAMPLING_BATCHES` × ``generation_batches``."""
    advantage_estimator: str = knob("gae", _estimator_help, group=RL,
                                    choices=lambda: tuple(ESTIMATORS) + tuple(ESTIMATOR_ALIASES))
    policy_loss: str = knob(
        "ppo", lambda: "The actor's per-token loss, with any estimator: "
                       + "; ".join(f"{s.name} = {s.title}" for s in POLICY_LOSSES.values())
                       + " (ppo: the token ratio's clipped surrogate; gspo: the answer's ratio, clipped per answer; "
                         "cispo: the clipped importance weight, detached, times the log-prob).",
        group=RL, choices=lambda: tuple(POLICY_LOSSES))
    n_samples_per_prompt: int = knob(1, "Answers sampled per prompt (G); they form one group.", group=RL)
    kl_ctl: float = knob(0.1, "KL penalty coefficient β.", group=PPO, range=FINITE_AT_LEAST_0)
    kl_estimator: str | None = knob(
        None, lambda: "KL(actor || reference) estimator: k1 = log-ratio, k2 = ½·log-ratio², k3 = unbiased and ≥ 0 "
                      f"(default: {default_help('kl_estimator')}).", group=RL, choices=_kl_estimators)
    use_kl_loss: bool | None = knob(
        None, lambda: "KL penalty in the loss (β·KL, β = --kl_ctl, aggregated as --loss_agg) instead of in the reward "
                      f"(default: {default_help('use_kl_loss')}, as in their papers).",
        group=RL, action="boolean_optional")
    loss_agg: str | None = knob(
        None, lambda: "How the actor's per-token losses of an optimizer step make its loss (verl's names): "
                      + "; ".join(f"{name} = {text}" for name, text in LOSS_AGGREGATIONS.items())
                      + f". Default: {default_help('loss_agg')}.", group=RL, choices=lambda: tuple(LOSS_AGGREGATIONS))
    clip_reward_value: float = knob(5.0, "Scores are clipped to ±this.", group=PPO)  # range: SHARED_RANGE
    cliprange: float | None = knob(
        None, lambda: "ε_low: the actor loss clips its ratio (cispo: its weight) below at 1 − ε_low (default: "
                      f"{default_help('cliprange')}).", group=PPO, range=FINITE_AT_LEAST_0)
    cliprange_high: float | None = knob(
        None, lambda: "ε_high: the upper clip at 1 + ε_high (DAPO's clip-higher when above --cliprange; default: "
                      f"{default_help('cliprange_high')}).", group=PPO, range=FINITE_AT_LEAST_0)
    cliprange_value: float = knob(0.2, "Value clip of the critic loss (gae).", group=PPO, range=FINITE_AT_LEAST_0)
    gamma: float = knob(1.0, "Discount γ.", group=PPO, range=UNIT_INTERVAL)
    lam: float = knob(0.95, "GAE λ (gae).", group=PPO, range=UNIT_INTERVAL)
    whiten_advantages: bool | None = knob(
        None, lambda: "Whiten the advantages over the batch of every rank (mean 0, std 1) before the update (default: "
                      f"{default_help('whiten')}: gae's as DeepSpeed-Chat).", group=PPO, action="boolean_optional")
    ppo_epochs: int = knob(1, "Passes of training over each round's experience.", group=PPO, range=AT_LEAST_1)
    generation_batches: int = knob(1, "Generation batches collected before each round of training.", group=PPO,
                                   range=AT_LEAST_1)
    mask_truncated_answers: bool = knob(  # answers without an end token (cut at --max_answer_seq_len): no loss
        False, "Answers cut at --max_answer_seq_len (no end token) count in no loss; they keep their place in their "
               "group's statistics.", group=DAPO)
    overlong_penalty: int = knob(  # DAPO's soft length penalty over the last this many tokens before the cap (0: off)
        0, "DAPO's soft overlong penalty, added to the score: 0 up to --max_answer_seq_len − L tokens, then falling "
           "linearly to −1 at --max_answer_seq_len (0 = off; 1 = only the answers cut at the cap pay, a "
           "missing-end-token penalty). The score before it is logged as task_reward.", group=DAPO, metavar="L")
    overlong_penalty_weight: float = knob(  # its weight in the score: −weight at the cap (DAPO: 1)
        1.0, "The overlong penalty's weight in the score: it falls to −W at --max_answer_seq_len (default: DAPO's 1; "
             "TRL's reward_weights for get_soft_overlong_punishment).", group=DAPO, metavar="W",
        range=(Check(lambda v: _finite(v) and v > 0, "a finite number > 0 (--overlong_penalty 0 turns the penalty "
                                                     "off)"),))
    dynamic_sampling: bool = knob(  # DAPO: groups whose scores are all equal are dropped, the round refilled
        False, "Drop the groups whose answers all score the same (no advantage to learn from) and refill the round "
               "from further prompt batches, up to --dynamic_sampling_max_batches; counts logged. Needs "
               "--n_samples_per_prompt ≥ 2.", group=DAPO)
    dynamic_sampling_max_batches: int | None = knob(  # the most generation batches one round may draw
        None, "The most generation batches one round may draw with --dynamic_sampling (default: "
              f"{DYNAMIC_SAMPLING_BATCHES} × --generation_batches); when they give too few groups, the round is "
              "filled with groups masked out of every loss.", group=DAPO)
    unsup_coef: float = knob(27.8, "γ of InstructGPT's Eq. 2: weight of the LM loss.", group=DATA)  # SHARED_RANGE
    align_overflow: bool = knob(  # fp16 only (from_args turns it off, with a warning, for other dtypes)
        False, "fp16: skip both actor and critic steps when either overflows (gae).", group=PPO)
    ema_beta: float = EMA_BETA  # θ_ema ← β·θ_ema + (1 − β)·θ_actor, with --enable_ema

    def __post_init__(self):
        estimator, loss = estimator_spec(self.advantage_estimator), policy_loss_spec(self.policy_loss)
        resolved = {"advantage_estimator": estimator.name}
        if self.use_kl_loss is None:
            resolved["use_kl_loss"] = estimator.kl_in_loss
        if self.kl_estimator is None:
            resolved["kl_estimator"] = estimator.kl_estimator
        if self.whiten_advantages is None:
            resolved["whiten_advantages"] = estimator.whiten
        if self.loss_agg is None:
            resolved["loss_agg"] = loss.loss_agg or estimator.loss_agg
        if self.loss_agg is not None and self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {self.loss_agg!r}")
        if self.cliprange_high is None:
            resolved["cliprange_high"] = (self.cliprange if self.cliprange is not None
                                          else loss.cliprange if loss.cliprange_high is None else loss.cliprange_high)
        if self.cliprange is None:
            resolved["cliprange"] = loss.cliprange
        if self.dynamic_sampling_max_batches is None:
            resolved["dynamic_sampling_max_batches"] = DYNAMIC_SAMPLING_BATCHES * self.generation_batches
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    @property
    def estimator_spec(self) -> EstimatorSpec:
        return ESTIMATORS[self.advantage_estimator]

    @property
    def policy_loss_spec(self) -> PolicyLossSpec:
        return POLICY_LOSSES[self.policy_loss]

    @property
    def uses_critic(self) -> bool:
        """Only PPO (GAE) learns a value function."""
        return self.estimator_spec.critic

    @property
    def title(self) -> str:
        """The run's name: "PPO", "GRPO with GSPO's loss" (:func:`~step3_rlhf_finetuning.algorithms.run_title`)."""
        return run_title(self.advantage_estimator, self.policy_loss)


@dataclass(frozen=True)
class RewardConfig:
    """Where the reward comes from: the reward model (the engine's ``reward``, when it has one), a reward
    function (``--reward_fn``: :mod:`utils.reward_functions`), or both: ``score = RM + fn_weight · fn``."""
    fn: str | None = knob(
        None, lambda: f"Score answers with a function instead of the reward model: built in {_builtin_reward_fns()}, "
                      "or path/to/file.py:function (called with the prompts, the answers and the dataset rows; returns "
                      "one float per answer).", flag="reward_fn", group=REWARD)
    fn_weight: float | None = knob(  # None with fn: the function alone (no reward model is loaded)
        None, "Add the function's score, times this, to the reward model's (default: the function alone, and no "
              "reward model is loaded).", flag="reward_fn_weight", group=REWARD)

    @property
    def uses_model(self) -> bool:
        return self.fn is None or self.fn_weight is not None


@dataclass(frozen=True)
class RoleConfig:
    """One trained model (actor or critic) and the frozen copies built from the same folder."""
    model_name_or_path: str
    optim: OptimConfig
    zero_stage: int = 0
    dropout: float | None = None
    lora_dim: int = 0
    lora_module_name: str = "decoder.layers."
    gradient_checkpointing: bool = False
    grad_accum: int = 1  # micro-batches per optimizer step (the actor's doubles with unsupervised mixing)
    value_head: str = "reward_model"  # the critic's (--critic_value_head): the step-2 model's, or "zero"
    offload_frozen: bool = False  # --offload_reference_model (actor: ref and EMA) / --offload_reward_model


@dataclass(frozen=True)
class HybridEngineConfig:
    """DeepSpeed's hybrid engine for the actor (used only where DeepSpeed has a policy for its layers)."""
    enabled: bool = knob(False, "DeepSpeed hybrid engine for the actor's generation, where DeepSpeed has an inference "
                                "policy for its layers (none for OPT/Llama under transformers 5: step 3 says so and "
                                "uses --generation_backend).", flag="enable_hybrid_engine", group=HYBRID)
    pin_parameters: bool = knob(True, "Hybrid engine: unpin the actor's parameters during generation (less memory, "
                                      "slower).", flag="unpin_actor_parameters", negate=True, group=HYBRID)
    release_inference_cache: bool = knob(False, "Hybrid engine: release the inference cache after generation.",
                                         group=HYBRID)
    inference_tp_size: int = knob(1, "Hybrid engine: tensor-parallel degree of generation (needs --actor_zero_stage "
                                     "3).", group=HYBRID, range=AT_LEAST_1)
    tp_gather_partition_size: int = knob(8, "Hybrid engine: layers gathered at a time for tensor-parallel "
                                            "generation.", group=HYBRID)  # SHARED_RANGE
    mixed_precision_lora: bool = knob(False, "Mixed-precision ZeRO++ for LoRA (needs --actor_lora_dim > 0 and "
                                             "--actor_zero_stage 3).", flag="enable_mixed_precision_lora", group=PPO)


@dataclass(frozen=True)
class RewardModelConfig:
    """The frozen step-2 reward model: ZeRO 3 iff the model it sits beside (critic, else actor) uses 3."""
    model_name_or_path: str
    zero_stage: int = 0
    offload: bool = False  # --offload_reward_model
    dropout: float | None = None


@dataclass(frozen=True)
class EngineConfig:
    """The models of step 3 (see :mod:`step3_rlhf_finetuning.rlhf_engine`): no critic for the critic-free
    estimators, no reward model when a reward function alone scores the answers."""
    actor: RoleConfig
    critic: RoleConfig | None
    reward_model: RewardModelConfig | None
    dtype: str
    micro_batch: int  # --per_device_training_batch_size
    max_seq_len: int  # prompt + answer
    offload: bool = False
    only_optimize_lora: bool = False
    enable_ema: bool = False
    reference: bool = True  # the frozen step-1 copy for the KL term; not built with --kl_ctl 0
    num_padding_at_beginning: int = 1
    trust_remote_code: bool = False
    tensorboard_path: str | None = None  # DeepSpeed's own tensorboard logs (--enable_tensorboard)
    hybrid: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    autocast: bool = False  # --torch_autocast: fp32 weights, the forward passes under torch.autocast (bf16)


@dataclass(frozen=True)
class Step3Config:
    engine: EngineConfig
    ppo: PPOConfig
    reward: RewardConfig
    generation: GenerationConfig
    unsupervised: bool  # --unsupervised_dataset_name given: the actor also trains on text (PPO-ptx)

    @classmethod
    def from_args(cls, args, eot_token: str | None = None) -> "Step3Config":
        """From step 3's parsed flags, after :func:`utils.training.start_run` resolved ``--dtype``; no I/O.
        ``eot_token``: what ends an answer besides the EOS (:func:`utils.training.answer_end_token` of the run's
        tokenizer)."""
        from utils.training import OptimConfig

        dtype, unsupervised = args.dtype, bool(args.unsupervised_dataset_name)
        if dtype is None:
            raise ValueError("Step3Config.from_args needs --dtype resolved (utils.training.start_run does it)")

        def role(name: str, offload_frozen: bool, grad_accum: int) -> RoleConfig:
            return RoleConfig(model_name_or_path=getattr(args, f"{name}_model_name_or_path"),
                              optim=OptimConfig.from_args(args, role=name),
                              zero_stage=getattr(args, f"{name}_zero_stage"), dropout=getattr(args, f"{name}_dropout"),
                              lora_dim=getattr(args, f"{name}_lora_dim"),
                              lora_module_name=getattr(args, f"{name}_lora_module_name"),
                              gradient_checkpointing=getattr(args, f"{name}_gradient_checkpointing"),
                              grad_accum=grad_accum, offload_frozen=offload_frozen,
                              **({"value_head": args.critic_value_head} if name == "critic" else {}))

        ppo = from_args_fields(PPOConfig, args, align_overflow=args.align_overflow and dtype == "fp16")
        reward = from_args_fields(RewardConfig, args)
        # with mixing, a micro-batch's PPO and LM gradients share one actor update (as DeepSpeed-Chat)
        actor_accum = args.gradient_accumulation_steps * (2 if unsupervised else 1)
        critic = role("critic", args.offload_reward_model, args.gradient_accumulation_steps) \
            if ppo.uses_critic else None
        reward_model = RewardModelConfig(
            model_name_or_path=args.critic_model_name_or_path,
            zero_stage=critic.zero_stage if critic else args.actor_zero_stage, offload=args.offload_reward_model,
            dropout=critic.dropout if critic else None) if reward.uses_model else None
        engine = EngineConfig(
            actor=role("actor", args.offload_reference_model, actor_accum), critic=critic,
            reward_model=reward_model, dtype=dtype, autocast=args.torch_autocast,
            micro_batch=args.per_device_training_batch_size,
            max_seq_len=args.max_prompt_seq_len + args.max_answer_seq_len, offload=args.offload,
            only_optimize_lora=args.only_optimize_lora, enable_ema=args.enable_ema, reference=args.kl_ctl > 0,
            num_padding_at_beginning=args.num_padding_at_beginning, trust_remote_code=args.trust_remote_code,
            tensorboard_path=args.tensorboard_path if args.enable_tensorboard else None,
            hybrid=from_args_fields(HybridEngineConfig, args))
        generation = from_args_fields(GenerationConfig, args, eot_token=eot_token)
        return cls(engine=engine, ppo=ppo, reward=reward, generation=generation, unsupervised=unsupervised)


KNOB_CLASSES = (GenerationConfig, RewardConfig, PPOConfig, HybridEngineConfig)  # the configs that declare flags
