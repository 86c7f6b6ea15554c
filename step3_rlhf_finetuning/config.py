"""Step 3's configuration: explicit objects built once from the flags by :meth:`Step3Config.from_args`.

The engine (:class:`~step3_rlhf_finetuning.rlhf_engine.DeepSpeedRLHFEngine`) reads an
:class:`EngineConfig`, the trainer (:class:`~step3_rlhf_finetuning.ppo_trainer.DeepSpeedPPOTrainer`)
a :class:`PPOConfig`, a :class:`RewardConfig` and a :class:`GenerationConfig`; neither sees the
argparse namespace. The dataclasses hold the defaults: the flags take theirs from here (a test
checks that they agree), so a test builds ``PPOConfig(kl_ctl=0.2)`` and nothing else.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING

from step3_rlhf_finetuning.algorithms import (ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, EstimatorSpec,
                                              PolicyLossSpec, estimator_spec, policy_loss_spec, run_title)

if TYPE_CHECKING:  # this module stays free of torch: train.py reads the RL rules from it
    from utils.training import OptimConfig


@dataclass(frozen=True)
class GenerationConfig:
    """How the actor answers (``--max_*_seq_len``, sampling, ``--generation_backend``, ``--generation_dtype``)."""
    max_prompt_seq_len: int = 256
    max_answer_seq_len: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    backend: str = "auto"
    dtype: str | None = None  # --generation_dtype: generate from a copy of the actor in this dtype (None: the actor)
    eot_token: str | None = None  # the answer-ending token besides the EOS: the chat template's end of turn
    # (--apply_chat_template) or the --eot_token that --add_eot_token added; else None
    print_answers: bool = False
    print_answers_interval: int = 1

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution answers are drawn from (1 when greedy), as TRL."""
        return self.temperature if self.do_sample else 1.0


def field_defaults(cls) -> dict:
    """``{field: default}`` of a config dataclass (before ``__post_init__`` resolves any): the flags' defaults."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


# Flags only the critic reads: refused when no critic is built (a critic-free --advantage_estimator)
CRITIC_ONLY_FLAGS = ("critic_learning_rate", "critic_weight_decay", "critic_zero_stage", "critic_dropout",
                     "critic_gradient_checkpointing", "critic_lora_dim", "critic_lora_module_name",
                     "critic_lora_learning_rate", "cliprange_value", "lam", "align_overflow")
DYNAMIC_SAMPLING_BATCHES = 4  # --dynamic_sampling_max_batches left unset: this many times --generation_batches


@dataclass(frozen=True)
class PPOConfig:
    """The RL update: advantage estimator, policy loss and its aggregation, samples per prompt, KL penalty, clipping,
    GAE, DAPO's pieces, passes, unsupervised mixing, fp16 overflow handling. Fields left None take the defaults of
    the estimator's or the policy loss's spec (:mod:`step3_rlhf_finetuning.algorithms`): ``use_kl_loss``,
    ``kl_estimator``, ``loss_agg`` (the policy loss's where it fixes one, else the estimator's), ``cliprange`` and
    ``cliprange_high`` (``--cliprange`` when only that is given); ``dynamic_sampling_max_batches``:
    :data:`DYNAMIC_SAMPLING_BATCHES` × ``generation_batches``."""
    advantage_estimator: str = "gae"
    policy_loss: str = "ppo"
    n_samples_per_prompt: int = 1
    kl_ctl: float = 0.1
    kl_estimator: str | None = None
    use_kl_loss: bool | None = None
    loss_agg: str | None = None
    clip_reward_value: float = 5.0
    cliprange: float | None = None
    cliprange_high: float | None = None
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    ppo_epochs: int = 1
    generation_batches: int = 1
    mask_truncated_answers: bool = False  # answers without an end token (cut at --max_answer_seq_len): no loss
    overlong_penalty: int = 0  # DAPO's soft length penalty over the last this many tokens before the cap (0: off)
    overlong_penalty_weight: float = 1.0  # its weight in the score: −weight at the cap (DAPO: 1)
    dynamic_sampling: bool = False  # DAPO: groups whose scores are all equal are dropped, the round refilled
    dynamic_sampling_max_batches: int | None = None  # the most generation batches one round may draw
    unsup_coef: float = 27.8
    align_overflow: bool = False  # fp16 only (from_args turns it off, with a warning, for other dtypes)
    ema_beta: float = 0.992  # θ_ema ← β·θ_ema + (1 − β)·θ_actor, with --enable_ema

    def __post_init__(self):
        estimator, loss = estimator_spec(self.advantage_estimator), policy_loss_spec(self.policy_loss)
        resolved = {"advantage_estimator": estimator.name}
        if self.use_kl_loss is None:
            resolved["use_kl_loss"] = estimator.kl_in_loss
        if self.kl_estimator is None:
            resolved["kl_estimator"] = estimator.kl_estimator
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
    fn: str | None = None
    fn_weight: float | None = None  # None with fn: the function alone (no reward model is loaded)

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
    offload_frozen: bool = False  # --offload_reference_model (actor: ref and EMA) / --offload_reward_model


@dataclass(frozen=True)
class HybridEngineConfig:
    """DeepSpeed's hybrid engine for the actor (used only where DeepSpeed has a policy for its layers)."""
    enabled: bool = False
    inference_tp_size: int = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = 8
    mixed_precision_lora: bool = False


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
                              grad_accum=grad_accum, offload_frozen=offload_frozen)

        ppo = PPOConfig(advantage_estimator=args.advantage_estimator, policy_loss=args.policy_loss,
                        n_samples_per_prompt=args.n_samples_per_prompt, kl_ctl=args.kl_ctl,
                        kl_estimator=args.kl_estimator, use_kl_loss=args.use_kl_loss, loss_agg=args.loss_agg,
                        clip_reward_value=args.clip_reward_value, cliprange=args.cliprange,
                        cliprange_high=args.cliprange_high, cliprange_value=args.cliprange_value, gamma=args.gamma,
                        lam=args.lam, ppo_epochs=args.ppo_epochs, generation_batches=args.generation_batches,
                        mask_truncated_answers=args.mask_truncated_answers, overlong_penalty=args.overlong_penalty,
                        overlong_penalty_weight=args.overlong_penalty_weight, dynamic_sampling=args.dynamic_sampling,
                        dynamic_sampling_max_batches=args.dynamic_sampling_max_batches,
                        unsup_coef=args.unsup_coef, align_overflow=args.align_overflow and dtype == "fp16")
        reward = RewardConfig(fn=args.reward_fn, fn_weight=args.reward_fn_weight)
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
            hybrid=HybridEngineConfig(enabled=args.enable_hybrid_engine, inference_tp_size=args.inference_tp_size,
                                      release_inference_cache=args.release_inference_cache,
                                      pin_parameters=not args.unpin_actor_parameters,
                                      tp_gather_partition_size=args.tp_gather_partition_size,
                                      mixed_precision_lora=args.enable_mixed_precision_lora))
        generation = GenerationConfig(max_prompt_seq_len=args.max_prompt_seq_len,
                                      max_answer_seq_len=args.max_answer_seq_len, do_sample=args.do_sample,
                                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                      backend=args.generation_backend, dtype=args.generation_dtype,
                                      eot_token=eot_token,
                                      print_answers=args.print_answers,
                                      print_answers_interval=args.print_answers_interval)
        return cls(engine=engine, ppo=ppo, reward=reward, generation=generation, unsupervised=unsupervised)
