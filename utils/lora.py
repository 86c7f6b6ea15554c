"""LoRA as in DeepSpeed-Chat: replace matching ``nn.Linear`` layers, train the low-rank factors.

``LinearLayer_LoRA`` keeps the base ``weight``/``bias`` under the same names as
the ``nn.Linear`` it replaces (so state-dict keys do not change) and adds
``lora_right_weight`` (in × r, kaiming-uniform a=√5) and ``lora_left_weight``
(r × out, zeros), scaled by ``lora_scaling`` (1/r by default):

    y = x Wᵀ + b + scaling · dropout(x) R L

Because L starts at zero, a fresh LoRA layer computes exactly the base layer.
Fusing adds ``scaling · (R L)ᵀ`` to W, so the plain Linear computes the same
function; ``convert_lora_to_linear_layer`` fuses every layer before saving.
ZeRO-3 partitioned weights are gathered while fusing.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from utils.errors import UserInputError


class LinearLayer_LoRA(nn.Module):
    def __init__(self, weight: nn.Parameter, lora_dim: int = 0, lora_scaling: float = 1.0,
                 lora_droppout: float = 0.0, bias: nn.Parameter | None = None):
        super().__init__()
        if lora_dim <= 0:
            raise ValueError("LoRA needs lora_dim > 0")
        self.weight = weight
        self.bias = bias
        rows, columns = self._shape(weight)  # weight is out × in
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim, dtype=weight.dtype, device=weight.device))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows, dtype=weight.dtype, device=weight.device))
        self.lora_scaling = lora_scaling / lora_dim
        self.lora_dropout = nn.Dropout(lora_droppout) if lora_droppout > 0 else nn.Identity()
        self.reset_parameters()
        self.weight.requires_grad = False
        self.fuse_lora = False

    @staticmethod
    def _shape(weight):
        return tuple(weight.ds_shape) if hasattr(weight, "ds_shape") else tuple(weight.shape)

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_left_weight)

    def _delta(self) -> torch.Tensor:
        return self.lora_scaling * (self.lora_right_weight @ self.lora_left_weight).t()

    def fuse_lora_weight(self) -> None:
        if not self.fuse_lora:
            self.weight.data += self._delta().to(self.weight.dtype)
        self.fuse_lora = True

    def unfuse_lora_weight(self) -> None:
        if self.fuse_lora:
            self.weight.data -= self._delta().to(self.weight.dtype)
        self.fuse_lora = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.fuse_lora:
            return out
        return out + (self.lora_dropout(x) @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def convert_linear_layer_to_lora(model: nn.Module, part_module_name, lora_dim: int = 0,
                                 lora_scaling: float = 1.0, lora_droppout: float = 0.0) -> nn.Module:
    """Replace every ``nn.Linear`` whose qualified name contains ``part_module_name``.

    ``part_module_name`` may be a string or a list of strings (any match counts).
    Raises :class:`UserInputError` (a ``ValueError``) when nothing matches: a silent
    no-op would train nothing, and the entry points turn it into one clear line.
    """
    parts = [part_module_name] if isinstance(part_module_name, str) else list(part_module_name)
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and any(p in name for p in parts)]
    if not names:
        linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        hint = f" (its first one is {linears[0]!r}" + (", so try --lora_module_name layers." if any(
            ".layers." in n for n in linears) else "") + ")" if linears else ""
        raise UserInputError(f"--lora_module_name {part_module_name!r} matches no nn.Linear layer of "
                             f"{type(model).__name__}{hint}")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        setattr(parent, child, LinearLayer_LoRA(linear.weight, lora_dim, lora_scaling, lora_droppout, linear.bias))
    return model


def _lora_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, LinearLayer_LoRA)]


def _gathered(module: LinearLayer_LoRA, zero_stage_3: bool):
    if not zero_stage_3:
        import contextlib

        return contextlib.nullcontext()
    import deepspeed

    params = [module.weight, module.bias, module.lora_left_weight, module.lora_right_weight]
    return deepspeed.zero.GatheredParameters([p for p in params if p is not None], modifier_rank=0)


def convert_lora_to_linear_layer(model: nn.Module, zero_stage_3: bool = False) -> nn.Module:
    """Fuse every LoRA layer's update into its base weight (before saving)."""
    for module in _lora_layers(model):
        with _gathered(module, zero_stage_3):
            module.fuse_lora_weight()
    return model


def unfuse_lora_weight(model: nn.Module, zero_stage_3: bool = False) -> nn.Module:
    """Undo :func:`convert_lora_to_linear_layer` (to keep training after a save)."""
    for module in _lora_layers(model):
        with _gathered(module, zero_stage_3):
            module.unfuse_lora_weight()
    return model


def only_optimize_lora_parameters(model: nn.Module, force_optimize_params=()) -> nn.Module:
    """Freeze everything except LoRA factors and parameters whose name contains one of ``force_optimize_params``."""
    for name, param in model.named_parameters():
        param.requires_grad = ("lora_right_weight" in name or "lora_left_weight" in name
                               or any(f in name for f in force_optimize_params))
    return model


def make_model_gradient_checkpointing_compatible(model: nn.Module) -> nn.Module:
    """With LoRA-only training + checkpointing, the inputs must require grad or no gradient flows."""
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    elif hasattr(model, "get_input_embeddings"):
        def make_inputs_require_grad(module, input, output):
            output.requires_grad_(True)

        model.get_input_embeddings().register_forward_hook(make_inputs_require_grad)
    return model


def apply_lora(model: nn.Module, module_name, dim: int, only_optimize: bool, force_optimize=()) -> nn.Module:
    """A role's LoRA, as every step applies it: ``dim`` > 0 converts the layers whose name contains
    ``module_name``; ``only_optimize`` then freezes all but the LoRA factors (and ``force_optimize``, e.g.
    the reward model's ``v_head``) and lets gradients reach them through checkpointed layers (on the
    backbone of a reward model). ``dim`` 0 leaves the model as it is."""
    if dim > 0:
        convert_linear_layer_to_lora(model, module_name, dim)
        if only_optimize:
            only_optimize_lora_parameters(model, force_optimize)
            make_model_gradient_checkpointing_compatible(getattr(model, "rwtransformer", model))
    return model
