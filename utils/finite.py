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
