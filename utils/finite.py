"""Stopping on a non-finite loss or reward: :func:`check_finite`, called by every step after each optimizer step.

Kept apart from :mod:`utils.errors` (the exception types, imported by everything, importing nothing) because it
reads the test hook of :mod:`utils.fault_injection`, which itself raises :class:`~utils.errors.UserInputError`.
"""
import math

from utils import fault_injection
from utils.errors import TrainingDiverged


def check_finite(step: int, **values) -> None:
    """Raise :class:`TrainingDiverged` naming the step and the first non-finite quantity (floats or 0-d tensors).

    Test hook (:mod:`utils.fault_injection`): with ``DSCHAT_FAULT_INJECT=nan@N`` the first quantity
    checked at step N reads as NaN (tests that every step stops there, saving nothing new).
    """
    poisoned = fault_injection.nan_at(step)
    for name, value in values.items():
        value = float(value.detach()) if hasattr(value, "detach") else float(value)
        if poisoned:
            value, poisoned = float("nan"), False
        if not math.isfinite(value):
            raise TrainingDiverged(f"non-finite {name} ({value}) at step {step}; stopping without saving "
                                   "(the last good checkpoint, if any, is kept)")


def check_weights_finite(what: str, *models) -> None:
    """Raise :class:`TrainingDiverged` when a parameter of ``models`` holds NaN or inf, naming the first one.

    Called before anything is saved: the loss checked after each step is the one computed *before* the update,
    so a last update can still write NaN into the weights (``--learning_rate 1e3``). Each rank looks at the
    parameters it holds (its ZeRO-3 shard, ``ds_tensor``, else the whole tensor) and the ranks agree on the
    verdict, so every rank stops together. ``None`` models are skipped.
    """
    import torch

    bad = None
    for model in models:
        if model is None:
            continue
        module = model.module if hasattr(model, "module") else model
        for name, param in module.named_parameters():
            data = getattr(param, "ds_tensor", None)
            data = param.data if data is None else data
            if data.is_floating_point() and data.numel() and not bool(torch.isfinite(data).all()):
                bad = name
                break
        if bad:
            break
    flag = torch.tensor([1.0 if bad else 0.0])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl":
            flag = flag.cuda()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item() > 0:
        where = f" (first: {bad})" if bad else " (on another rank)"
        raise TrainingDiverged(f"non-finite weights in {what}{where} after training; nothing saved (lower "
                               "--learning_rate; the last good checkpoint, if any, is kept)")
