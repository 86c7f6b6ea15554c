"""DeepSpeed configuration and optimiser construction (the reference's fields).

``get_train_ds_config`` / ``get_eval_ds_config`` return plain dicts for
``deepspeed.initialize``; ``train_batch_size`` is always
micro batch × world size × gradient accumulation.
"""
from __future__ import annotations

import math

from utils.arguments import ADAM_BETAS

GLOBAL_BATCH_SIZE = 32  # placeholders, overwritten by the caller like the reference
MICRO_BATCH_SIZE = 4


def _precision(dtype: str, autocast: bool = False) -> dict:
    """DeepSpeed's precision section. ``autocast`` (``--torch_autocast``, bf16 only): fp32 weights, the forward
    under ``torch.autocast`` (DeepSpeed's ``torch_autocast``), instead of bf16 weights."""
    if autocast:
        if dtype != "bf16":
            raise ValueError(f"torch autocast is built for bf16, not {dtype}")
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "loss_scale_window": 100}}
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    return {}


def get_train_ds_config(offload: bool, dtype: str, stage: int = 2, enable_hybrid_engine: bool = False,
                        inference_tp_size: int = 1, release_inference_cache: bool = False,
                        pin_parameters: bool = True, tp_gather_partition_size: int = 8,
                        max_out_tokens: int = 512, enable_tensorboard: bool = False,
                        enable_mixed_precision_lora: bool = False, tb_path: str = "", tb_name: str = "",
                        world_size: int = 1, devices_per_node: int = 1, autocast: bool = False) -> dict:
    """``world_size`` / ``devices_per_node`` only matter with ``enable_mixed_precision_lora``: on several
    nodes ZeRO++'s secondary weight partition (hpZ) spans one node, as in DeepSpeed-Chat."""
    device = "cpu" if offload else "none"
    zero_opt_dict = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    if enable_mixed_precision_lora:
        zero_opt_dict["zero_quantized_nontrainable_weights"] = True
        if world_size != devices_per_node:
            zero_opt_dict["zero_hpz_partition_size"] = devices_per_node
    config = {
        "train_batch_size": GLOBAL_BATCH_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": enable_hybrid_engine,
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": release_inference_cache,
            "pin_parameters": pin_parameters,
            "tp_gather_partition_size": tp_gather_partition_size,
        },
        "tensorboard": {
            "enabled": enable_tensorboard,
            "output_path": f"{tb_path}/ds_tensorboard_logs/",
            "job_name": f"{tb_name}_tensorboard",
        },
    }
    config.update(_precision(dtype, autocast))
    return config


def get_eval_ds_config(offload: bool, dtype: str, stage: int = 0, autocast: bool = False) -> dict:
    device = "cpu" if offload else "none"
    config = {
        "train_batch_size": GLOBAL_BATCH_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": device},
            "memory_efficient_linear": False,
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
    config.update(_precision(dtype, autocast))
    return config


def set_batch_sizes(ds_config: dict, micro_batch: int, world_size: int, grad_accum: int) -> dict:
    """Global batch = micro × world × grad-accum (what DeepSpeed checks)."""
    ds_config["train_micro_batch_size_per_gpu"] = micro_batch
    ds_config["train_batch_size"] = micro_batch * world_size * grad_accum
    ds_config["gradient_accumulation_steps"] = grad_accum
    return ds_config


NO_DECAY_NAMES = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")
LORA_NAMES = ("lora_right_weight", "lora_left_weight")


def get_optimizer_grouped_parameters(model, weight_decay: float, lora_lr: float = 5e-4,
                                     no_decay_name_list=NO_DECAY_NAMES, lora_name_list=LORA_NAMES):
    """Three groups: decayed weights, LoRA factors (own lr), no-decay (biases, norms). Empty groups dropped."""
    decay, lora, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if any(nd in name.lower() for nd in no_decay_name_list):
            no_decay.append(param)
        elif any(ln in name for ln in lora_name_list):
            lora.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": lora, "weight_decay": weight_decay, "lr": lora_lr},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def create_optimizer(model, weight_decay: float, learning_rate: float, lora_learning_rate: float,
                     offload: bool, betas=ADAM_BETAS):
    """DeepSpeedCPUAdam with ``--offload``; else torch's fused AdamW (on a GPU and on a CPU).

    DeepSpeed-Chat uses DeepSpeed's FusedAdam on a GPU. torch's fused AdamW runs the
    same decoupled-weight-decay Adam update in one multi-tensor kernel, and needs no
    JIT build of a CUDA extension (FusedAdam compiles for ~1 min on every fresh
    machine, needs nvcc, and fails outright where DeepSpeed cannot parse the GPU's
    architecture list, e.g. ``9.0a`` on an H100 with CUDA 13). On a CPU torch has a
    fused kernel too: 1.2 s instead of 8.5 s (the default per-tensor loop) for a step
    of a 128 M-parameter model on 2 cores, where a SmolLM2-135M SFT step takes ~7 s.
    """
    from deepspeed.accelerator import get_accelerator

    groups = get_optimizer_grouped_parameters(model, weight_decay, lora_learning_rate)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=learning_rate, betas=betas)
    import torch

    fused = get_accelerator().device_name() in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)


# --------------------------------------------------------------------------- bf16 at ZeRO 0: a fused optimizer step

def fuses_bf16_step(engine) -> bool:
    """Whether :func:`fuse_bf16_step` applies to ``engine``: bf16 weights at ZeRO 0 (``--dtype bf16``, no
    ``--torch_autocast``), where DeepSpeed wraps the optimizer in its ``FP16_UnfusedOptimizer`` (fp32 master
    weights), without model parallelism or MoE layers (whose norms DeepSpeed reduces across ranks)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    optimizer = getattr(engine, "optimizer", None)
    return (type(optimizer) is FP16_UnfusedOptimizer and engine.bfloat16_enabled()
            and engine.zero_optimization_stage() == 0 and optimizer.mpu is None and not optimizer.fused_lamb_legacy
            and not getattr(engine, "has_moe_layers", False))


def fuse_bf16_step(engine) -> bool:
    """Give ``engine``'s bf16 ZeRO-0 optimizer (:func:`fuses_bf16_step`) a step of a few multi-tensor kernels and one
    host sync; True when it did. Everything else (fp32 master weights, state dict, checkpoints) stays DeepSpeed's.

    DeepSpeed's ``FP16_UnfusedOptimizer.step`` walks the parameters one by one: an inf/NaN check and a norm per
    gradient, each read back to the host (a sync per parameter: 272 for SmolLM2-135M), then a float32 copy, an
    unscale and a copy back per parameter: ~5,700 small kernels a step on a GPU, where a fused AdamW is ~20.
    :func:`bf16_master_step` does the same maths with ``torch._foreach_*`` ops (a CUDA multi-tensor kernel each)
    and the one sync the engine needs (it reads ``optimizer.overflow`` after the step)."""
    if not fuses_bf16_step(engine):
        return False
    engine.optimizer.__class__ = _fused_unfused_optimizer()  # a subclass adding no state: only step() differs
    return True


def bf16_master_step(params16: list, masters: list, optimizer, clip_grad: float, loss_scale: float = 1.0) -> float:
    """One step of ``optimizer`` (over the float32 ``masters``) from the bf16 ``params16``'s gradients, the new
    weights copied back into ``params16``; returns the gradients' global L2 norm (inf/NaN: nothing is changed).

    The maths of DeepSpeed's ``FP16_UnfusedOptimizer.step``: the norm of all gradients (float32), each gradient
    (None = zeros) in float32 divided by ``loss_scale``, times ``clip_grad / (norm + 1e-6)`` where that is below 1,
    the optimizer's step, the masters copied into the bf16 weights. Kernels: a foreach norm, the copies and the
    scaling as multi-tensor ops, the optimizer's own (fused AdamW: one); host syncs: one (the norm).
    """
    import torch

    if not params16:  # nothing trained: the optimizer's step has nothing to do
        return 0.0
    grads16 = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params16]
    norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads16, 2.0, dtype=torch.float32))))
    if not math.isfinite(norm):
        return norm
    flat = torch.empty(sum(m.numel() for m in masters), dtype=torch.float32, device=masters[0].device)
    grads32 = [g.view_as(m) for g, m in zip(flat.split([m.numel() for m in masters]), masters)]
    torch._foreach_copy_(grads32, grads16)
    combined = loss_scale
    if clip_grad > 0:
        clip = ((norm / loss_scale) + 1e-6) / clip_grad
        if clip > 1:
            combined = clip * loss_scale
    if combined != 1.0:
        torch._foreach_mul_(grads32, 1.0 / combined)
    for master, grad in zip(masters, grads32):
        master.grad = grad
    optimizer.step()
    for master in masters:
        master.grad = None
    with torch.no_grad():
        torch._foreach_copy_([p.data for p in params16], masters)
    return norm


_FUSED_CLASS = None


def _fused_unfused_optimizer():
    """``FP16_UnfusedOptimizer`` with :func:`bf16_master_step` as its step (built once, on first use: importing
    DeepSpeed's optimizers is not free)."""
    global _FUSED_CLASS
    if _FUSED_CLASS is None:
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        class FusedBf16Optimizer(FP16_UnfusedOptimizer):
            """DeepSpeed's bf16 ZeRO-0 optimizer wrapper with a multi-tensor step (:func:`fuse_bf16_step`)."""

            def step(self, closure=None):
                params16 = [p for group in self.fp16_groups for p in group]
                masters = [p for group in self.fp32_groups for p in group]
                norm = bf16_master_step(params16, masters, self.optimizer, self.clip_grad,
                                        self.loss_scale_config.cur_scale)
                self._global_grad_norm = norm
                if not math.isfinite(norm):
                    return self._skip_invalid_grad_norm()  # what DeepSpeed's step does on an inf/NaN gradient
                self.overflow = False
                self._update_scale(False)
                return self.overflow

        _FUSED_CLASS = FusedBf16Optimizer
    return _FUSED_CLASS
