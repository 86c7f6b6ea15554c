"""The five models of PPO, each wrapped in a DeepSpeed engine.

==========  ======================  =========================================================
model       built from              engine
==========  ======================  =========================================================
actor       step-1 folder           train: ``--actor_zero_stage``, ``--offload``, optimizer +
                                    scheduler, hybrid-engine fields, LoRA / dropout / ckpting
ref         step-1 folder           eval: ZeRO 3 iff the actor's is 3, else 0;
                                    ``--offload_reference_model``
actor_ema   step-1 folder           eval, like ref (``--enable_ema``); LoRA like the actor
critic      step-2 folder           train: ``--critic_zero_stage``, ``--offload``
reward      step-2 folder           eval: ZeRO 3 iff the critic's is 3, else 0;
                                    ``--offload_reward_model``
==========  ======================  =========================================================

With unsupervised mixing the actor accumulates twice as many micro-batches per
optimizer step (``args.gradient_accumulation_steps_actor``), so the PPO and the LM
gradient of a micro-batch share one update, as in DeepSpeed-Chat.

``--enable_hybrid_engine`` turns DeepSpeed's hybrid engine on only where it can
accelerate the actor (:func:`hybrid_engine_support`); otherwise step 3 says why once
and the trainer generates with the project's own path (:mod:`utils.generation`).
"""
from __future__ import annotations

import inspect
import time

from utils.ds_utils import create_optimizer, get_eval_ds_config, get_train_ds_config, set_batch_sizes
from utils.errors import UserInputError
from utils.utils import get_world_size, on_cpu, print_rank_0


def _log_init(name: str, start: float | None = None) -> float:
    if start is None:
        print_rank_0(f"[start] initializing {name} model")
    else:
        print_rank_0(f"[end] initialized {name} model ({time.time() - start:.2f}s)")
    return time.time()


def enable_gradient_checkpointing(engine) -> None:
    """Activation checkpointing of an engine's model (HF model or RewardModel)."""
    engine.module.gradient_checkpointing_enable()


def hybrid_engine_support(model) -> tuple[bool, str]:
    """``(usable, reason)``: can DeepSpeed's hybrid engine accelerate ``model``'s generation?

    The hybrid engine swaps each decoder layer whose class one of DeepSpeed's
    ``replace_policies`` names for a fused inference kernel. Those kernels implement
    the legacy tuple KV cache: a layer whose ``forward`` takes transformers' ``Cache``
    API (``past_key_values`` / ``cache_position`` — every OPT and Llama layer under
    transformers 5) cannot be swapped. DeepSpeed 0.19 skips OPT for that reason and
    then crashes in ``generate`` (no ``_generate``); for Llama it would inject kernels
    fed the wrong cache. Usable only when a policy matches a layer of the legacy kind.
    """
    import deepspeed
    from deepspeed.module_inject.replace_policy import replace_policies

    present = {type(m) for m in model.modules()}
    for policy in replace_policies:
        policy(None)  # resolves policy._orig_layer_class against the installed transformers
        classes = policy._orig_layer_class
        for cls in classes if isinstance(classes, list) else [classes]:
            if cls is None or cls not in present:
                continue
            params = inspect.signature(cls.forward).parameters
            if "past_key_values" in params or "cache_position" in params:
                return False, (f"DeepSpeed {deepspeed.__version__}'s {policy.__name__} kernels use the legacy tuple "
                               f"KV cache but {cls.__name__} takes transformers' Cache API")
            return True, f"DeepSpeed inference policy {policy.__name__} for {cls.__name__}"
    return False, f"DeepSpeed {deepspeed.__version__} has no inference policy for {type(model).__name__}"


class DeepSpeedRLHFEngine:
    """Builds ``actor``, ``ref``, ``actor_ema`` (or None), ``critic`` and ``reward`` engines (see module docstring)."""

    def __init__(self, actor_model_name_or_path, critic_model_name_or_path, tokenizer, args, num_total_iters):
        self.args = args
        self.tokenizer = tokenizer
        self.num_total_iters = num_total_iters
        self.hybrid_engine_active = False  # set by _init_actor
        self.actor = self._init_actor(actor_model_name_or_path)
        self.ref = self._init_frozen_actor(actor_model_name_or_path, "ref", lora=False)
        self.actor_ema = (self._init_frozen_actor(actor_model_name_or_path, "EMA", lora=True)
                          if args.enable_ema else None)
        self.critic = self._init_critic(critic_model_name_or_path)
        self.reward = self._init_reward(critic_model_name_or_path)

    # ------------------------------------------------------------------ helpers

    def _batch(self, ds_config: dict, grad_accum: int) -> dict:
        return set_batch_sizes(ds_config, self.args.per_device_training_batch_size, get_world_size(), grad_accum)

    def _lora(self, model, role: str, force_optimize=()):
        """Role's LoRA (``--{role}_lora_dim``) and ``--only_optimize_lora``."""
        from utils.module.lora import (convert_linear_layer_to_lora, make_model_gradient_checkpointing_compatible,
                                       only_optimize_lora_parameters)

        dim = getattr(self.args, f"{role}_lora_dim")
        if dim > 0:
            convert_linear_layer_to_lora(model, getattr(self.args, f"{role}_lora_module_name"), dim)
            if self.args.only_optimize_lora:
                only_optimize_lora_parameters(model, force_optimize)
                make_model_gradient_checkpointing_compatible(model)
        return model

    def _initialize(self, model, ds_config: dict, role: str | None = None):
        """``deepspeed.initialize``; with ``role``, also the role's optimizer and LR schedule."""
        import deepspeed
        from transformers import get_scheduler

        optimizer = lr_scheduler = None
        if role is not None:
            args = self.args
            optimizer = create_optimizer(model, getattr(args, f"{role}_weight_decay"),
                                         getattr(args, f"{role}_learning_rate"),
                                         getattr(args, f"{role}_lora_learning_rate"), args.offload)
            lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                                         num_warmup_steps=args.num_warmup_steps,
                                         num_training_steps=self.num_total_iters)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                          config=ds_config)
        return engine

    def _check_length(self, model) -> None:
        needed = self.args.max_prompt_seq_len + self.args.max_answer_seq_len
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and needed > limit:
            raise UserInputError(f"--max_prompt_seq_len + --max_answer_seq_len = {needed} exceeds the actor's "
                                 f"max_position_embeddings ({limit})")

    # ------------------------------------------------------------------ models

    def _init_actor(self, path: str):
        from transformers import AutoModelForCausalLM

        from utils.model.model_utils import create_hf_model

        start, args = _log_init("actor"), self.args
        ds_config = get_train_ds_config(
            offload=args.offload, dtype=args.dtype, stage=args.actor_zero_stage,
            enable_hybrid_engine=args.enable_hybrid_engine, inference_tp_size=args.inference_tp_size,
            release_inference_cache=args.release_inference_cache, pin_parameters=not args.unpin_actor_parameters,
            tp_gather_partition_size=args.tp_gather_partition_size,
            max_out_tokens=args.max_prompt_seq_len + args.max_answer_seq_len,
            enable_tensorboard=args.enable_tensorboard, enable_mixed_precision_lora=args.enable_mixed_precision_lora,
            tb_path=args.tensorboard_path, tb_name="step3_actor")
        self._batch(ds_config, args.gradient_accumulation_steps_actor)
        model = create_hf_model(AutoModelForCausalLM, path, self.tokenizer, ds_config, dropout=args.actor_dropout,
                                trust_remote_code=args.trust_remote_code)
        self._check_length(model)
        if args.enable_hybrid_engine:
            usable, why = hybrid_engine_support(model)
            if usable and on_cpu():
                usable, why = False, f"{why}, but its kernels need a GPU"
            self.hybrid_engine_active = usable
            ds_config["hybrid_engine"]["enabled"] = usable
            print_rank_0(f"--enable_hybrid_engine: {why}; "
                         + ("generating with DeepSpeed's inference kernels" if usable else
                            "generating with the project's own path instead (--generation_backend)"))
        engine = self._initialize(self._lora(model, "actor"), ds_config, role="actor")
        if args.enable_mixed_precision_lora:
            engine.optimizer.quantize_nontrainable_params()
            print_rank_0("Mixed Precision ZeRO++ enabled")
        if args.actor_gradient_checkpointing:
            enable_gradient_checkpointing(engine)
        _log_init("actor", start)
        return engine

    def _init_frozen_actor(self, path: str, name: str, lora: bool):
        """The reference model or the EMA copy: an eval engine of the step-1 model."""
        from transformers import AutoModelForCausalLM

        from utils.model.model_utils import create_hf_model

        start, args = _log_init(name), self.args
        stage = 3 if args.actor_zero_stage == 3 else 0
        ds_config = self._batch(get_eval_ds_config(args.offload_reference_model, args.dtype, stage),
                                args.gradient_accumulation_steps_actor)
        model = create_hf_model(AutoModelForCausalLM, path, self.tokenizer, ds_config,
                                trust_remote_code=args.trust_remote_code)
        if lora and args.actor_lora_dim > 0:  # same parameter list as the actor, for the EMA update
            self._lora(model, "actor")
        engine = self._initialize(model, ds_config)
        _log_init(name, start)
        return engine

    def _init_critic(self, path: str):
        from utils.model.critic import create_critic_model

        start, args = _log_init("critic"), self.args
        ds_config = self._batch(get_train_ds_config(offload=args.offload, dtype=args.dtype,
                                                    stage=args.critic_zero_stage,
                                                    enable_tensorboard=args.enable_tensorboard,
                                                    tb_path=args.tensorboard_path, tb_name="step3_critic"),
                                args.gradient_accumulation_steps)
        model_config = self._batch(get_eval_ds_config(False, args.dtype, args.critic_zero_stage),
                                   args.gradient_accumulation_steps)
        model = create_critic_model(path, self.tokenizer, model_config, args.num_padding_at_beginning,
                                    rlhf_training=True, dropout=args.critic_dropout,
                                    zero_stage=args.critic_zero_stage, trust_remote_code=args.trust_remote_code)
        # unlike the reference, --only_optimize_lora keeps the value head trainable
        engine = self._initialize(self._lora(model, "critic", force_optimize=("v_head",)), ds_config, role="critic")
        if args.critic_gradient_checkpointing:
            enable_gradient_checkpointing(engine)
        _log_init("critic", start)
        return engine

    def _init_reward(self, path: str):
        from utils.model.critic import create_critic_model

        start, args = _log_init("reward"), self.args
        stage = 3 if args.critic_zero_stage == 3 else 0
        ds_config = self._batch(get_eval_ds_config(args.offload_reward_model, args.dtype, stage),
                                args.gradient_accumulation_steps)
        model = create_critic_model(path, self.tokenizer, ds_config, args.num_padding_at_beginning,
                                    rlhf_training=True, dropout=args.critic_dropout, zero_stage=stage,
                                    trust_remote_code=args.trust_remote_code)
        engine = self._initialize(model, ds_config)
        _log_init("reward", start)
        return engine
