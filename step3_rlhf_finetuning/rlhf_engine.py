"""The models of step 3, each wrapped in a DeepSpeed engine (five for PPO; three or four critic-free).

==========  ======================  =========================================================
model       built from              engine
==========  ======================  =========================================================
actor       step-1 folder           train: ``--actor_zero_stage``, ``--offload``, optimizer +
                                    scheduler, hybrid-engine fields, LoRA / dropout / ckpting
ref         step-1 folder           eval: ZeRO 3 iff the actor's is 3, else 0;
                                    ``--offload_reference_model``; absent without a KL
                                    term (``--kl_ctl 0``): nothing would read it
actor_ema   step-1 folder           eval, like ref (``--enable_ema``); LoRA like the actor
critic      step-2 folder           train: ``--critic_zero_stage``, ``--offload``; PPO (``gae``) only
reward      step-2 folder           eval: ZeRO 3 iff the critic's (critic-free: the actor's) is 3,
                                    else 0; ``--offload_reward_model``; absent when a reward
                                    function alone scores the answers (``--reward_fn``)
==========  ======================  =========================================================

With unsupervised mixing the actor accumulates twice as many micro-batches per
optimizer step (:attr:`RoleConfig.grad_accum <step3_rlhf_finetuning.config.RoleConfig>`),
so the PPO and the LM gradient of a micro-batch share one update, as in DeepSpeed-Chat.
The frozen copies' stage follows :func:`utils.training.frozen_stage`.

``--enable_hybrid_engine`` turns DeepSpeed's hybrid engine on only where it can
accelerate the actor (:func:`hybrid_engine_support`); otherwise step 3 says why once
and the trainer generates with the project's own path (:mod:`utils.generation`).
"""
from __future__ import annotations

import inspect
import time

from utils.distributed import print_rank_0
from utils.errors import UserInputError
from utils.lora import apply_lora
from utils.runtime import on_cpu
from utils.training import frozen_ds_config, frozen_stage, make_engine, train_ds_config


def _log_init(name: str, start: float | None = None) -> float:
    if start is None:
        print_rank_0(f"[start] initializing {name} model")
    else:
        print_rank_0(f"[end] initialized {name} model ({time.time() - start:.2f}s)")
    return time.time()


CACHE_API_PARAMETERS = ("past_key_values", "cache_position", "cache")  # "cache" from transformers 5.24


def takes_cache_api(layer_class) -> bool:
    """Does ``layer_class.forward`` take transformers' ``Cache`` objects rather than the legacy tuple KV cache?

    A parameter named after the Cache API says so; so does being a layer of transformers 5 or later, which
    removed the tuple cache from every model it ships (the parameter names change between releases).
    """
    params = inspect.signature(layer_class.forward).parameters
    if any(name in params for name in CACHE_API_PARAMETERS):
        return True
    import transformers

    ships_with_transformers = layer_class.__module__.split(".")[0] == "transformers"
    return ships_with_transformers and int(transformers.__version__.split(".")[0]) >= 5


def hybrid_engine_support(model) -> tuple[bool, str]:
    """``(usable, reason)``: can DeepSpeed's hybrid engine accelerate ``model``'s generation?

    The hybrid engine swaps each decoder layer whose class one of DeepSpeed's
    ``replace_policies`` names for a fused inference kernel. Those kernels implement
    the legacy tuple KV cache: a layer whose ``forward`` takes transformers' ``Cache``
    API (:func:`takes_cache_api`: every OPT and Llama layer under transformers 5) cannot
    be swapped. DeepSpeed 0.19 skips OPT for that reason and
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
            if takes_cache_api(cls):
                return False, (f"DeepSpeed {deepspeed.__version__}'s {policy.__name__} kernels use the legacy tuple "
                               f"KV cache but {cls.__name__} takes transformers' Cache API")
            return True, f"DeepSpeed inference policy {policy.__name__} for {cls.__name__}"
    return False, f"DeepSpeed {deepspeed.__version__} has no inference policy for {type(model).__name__}"


class DeepSpeedRLHFEngine:
    """Builds ``actor``, ``ref``, ``actor_ema``, ``critic`` and ``reward`` engines (see module docstring; the last
    three None when not used) from an :class:`~step3_rlhf_finetuning.config.EngineConfig`; ``num_total_iters`` is
    the length of the learning-rate schedules."""

    def __init__(self, config, tokenizer, num_total_iters: int):
        self.config = config
        self.tokenizer = tokenizer
        self.num_total_iters = num_total_iters
        self.hybrid_engine_active = False  # set by _init_actor
        self.actor = self._init_actor()
        self.ref = self._init_frozen_actor("ref", lora=False) if config.reference else None
        if self.ref is None:
            print_rank_0("no reference model: --kl_ctl 0 uses no KL term (KL to the step-1 actor is not measured)")
        self.actor_ema = self._init_frozen_actor("EMA", lora=True) if config.enable_ema else None
        self.critic = self._init_critic() if config.critic is not None else None
        self.reward = self._init_reward() if config.reward_model is not None else None

    # ------------------------------------------------------------------ helpers

    def _lora(self, model, role, force_optimize=()):
        return apply_lora(model, role.lora_module_name, role.lora_dim, self.config.only_optimize_lora, force_optimize)

    def _frozen_config(self, role) -> dict:
        return frozen_ds_config(self.config.dtype, role.zero_stage, role.offload_frozen, self.config.micro_batch,
                                role.grad_accum, autocast=self.config.autocast)

    def _check_length(self, model) -> None:
        needed = self.config.max_seq_len
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and needed > limit:
            raise UserInputError(f"--max_prompt_seq_len + --max_answer_seq_len = {needed} exceeds the actor's "
                                 f"max_position_embeddings ({limit})")

    # ------------------------------------------------------------------ models

    def _init_actor(self):
        from transformers import AutoModelForCausalLM

        from utils.model.model_utils import create_hf_model

        start, config, actor, hybrid = _log_init("actor"), self.config, self.config.actor, self.config.hybrid
        ds_config = train_ds_config(
            config.dtype, actor.zero_stage, config.offload, config.micro_batch, actor.grad_accum,
            tensorboard_path=config.tensorboard_path, tb_name="step3_actor",
            enable_hybrid_engine=hybrid.enabled, inference_tp_size=hybrid.inference_tp_size,
            release_inference_cache=hybrid.release_inference_cache, pin_parameters=hybrid.pin_parameters,
            tp_gather_partition_size=hybrid.tp_gather_partition_size, max_out_tokens=config.max_seq_len,
            enable_mixed_precision_lora=hybrid.mixed_precision_lora, autocast=config.autocast)
        model = create_hf_model(AutoModelForCausalLM, actor.model_name_or_path, self.tokenizer, ds_config,
                                dropout=actor.dropout, trust_remote_code=config.trust_remote_code)
        self._check_length(model)
        if hybrid.enabled:
            usable, why = hybrid_engine_support(model)
            if usable and on_cpu():
                usable, why = False, f"{why}, but its kernels need a GPU"
            self.hybrid_engine_active = usable
            ds_config["hybrid_engine"]["enabled"] = usable
            print_rank_0(f"--enable_hybrid_engine: {why}; "
                         + ("generating with DeepSpeed's inference kernels" if usable else
                            "generating with the project's own path instead (--generation_backend)"))
        engine = make_engine(self._lora(model, actor), ds_config, actor.optim, self.num_total_iters,
                             actor.gradient_checkpointing)
        if hybrid.mixed_precision_lora:
            engine.optimizer.quantize_nontrainable_params()
            print_rank_0("Mixed Precision ZeRO++ enabled")
        _log_init("actor", start)
        return engine

    def _init_frozen_actor(self, name: str, lora: bool):
        """The reference model or the EMA copy: a frozen engine of the step-1 model."""
        from transformers import AutoModelForCausalLM

        from utils.model.model_utils import create_hf_model

        start, actor = _log_init(name), self.config.actor
        ds_config = self._frozen_config(actor)
        model = create_hf_model(AutoModelForCausalLM, actor.model_name_or_path, self.tokenizer, ds_config,
                                trust_remote_code=self.config.trust_remote_code)
        if lora:  # same parameter list as the actor, for the EMA update
            self._lora(model, actor)
        engine = make_engine(model, ds_config)
        _log_init(name, start)
        return engine

    def _init_critic(self):
        from utils.ds_utils import get_eval_ds_config
        from utils.model.critic import create_critic_model, zero_value_head

        start, config, critic = _log_init("critic"), self.config, self.config.critic
        ds_config = train_ds_config(config.dtype, critic.zero_stage, config.offload, config.micro_batch,
                                    critic.grad_accum, tensorboard_path=config.tensorboard_path,
                                    tb_name="step3_critic", autocast=config.autocast)
        # built under the same precision its engine trains in (ZeRO-3 partitions it in that dtype at construction)
        build_config = get_eval_ds_config(False, config.dtype, critic.zero_stage, autocast=config.autocast)
        model = create_critic_model(critic.model_name_or_path, self.tokenizer, build_config,
                                    config.num_padding_at_beginning, rlhf_training=True, dropout=critic.dropout,
                                    zero_stage=critic.zero_stage, trust_remote_code=config.trust_remote_code)
        if critic.value_head == "zero":  # --critic_value_head zero: values 0 until learned, the backbone kept
            zero_value_head(model)
            print_rank_0("critic: the step-2 model with its value head set to 0 (--critic_value_head zero)")
        # unlike the reference, --only_optimize_lora keeps the value head trainable
        engine = make_engine(self._lora(model, critic, force_optimize=("v_head",)), ds_config, critic.optim,
                             self.num_total_iters, critic.gradient_checkpointing)
        _log_init("critic", start)
        return engine

    def _init_reward(self):
        from utils.model.critic import create_critic_model

        start, config, reward = _log_init("reward"), self.config, self.config.reward_model
        ds_config = frozen_ds_config(config.dtype, reward.zero_stage, reward.offload, config.micro_batch, 1,
                                     autocast=config.autocast)
        model = create_critic_model(reward.model_name_or_path, self.tokenizer, ds_config,
                                    config.num_padding_at_beginning, rlhf_training=True, dropout=reward.dropout,
                                    zero_stage=frozen_stage(reward.zero_stage),
                                    trust_remote_code=config.trust_remote_code)
        engine = make_engine(model, ds_config)
        _log_init("reward", start)
        return engine
