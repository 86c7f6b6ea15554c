"""The one exception type for bad user input.

Anything the user can fix (a bad flag, a missing column, an unknown dataset name)
raises :class:`UserInputError` with a message naming the culprit. Entry points
catch it in one place (``utils.entrypoint.run_main``), print the message and exit 2, so
users see one clear line instead of a traceback from deep inside a library.
"""


# How an entry point ends (utils.entrypoint.run_main); train.py reads the same codes from its steps.
BAD_INPUT = 2  # UserInputError: one line naming the flag, file or field
DIVERGED = 3  # TrainingDiverged: a non-finite loss or reward, nothing new saved
OUT_OF_MEMORY = 4  # the accelerator ran out of memory: one line naming the remedies
INTERRUPTED = 130  # Ctrl-C (the shell's code for a process ended by SIGINT)


class UserInputError(ValueError):
    """Bad input the user can fix: message names the dataset / file / flag / field."""


class TrainingDiverged(RuntimeError):
    """A non-finite loss/reward: training stops, nothing new is saved (message names step and quantity)."""


def check_finite(step: int, **values) -> None:
    """Raise :class:`TrainingDiverged` naming the step and the first non-finite quantity (floats or 0-d tensors).

    Test hook (:mod:`utils.fault_injection`): with ``DSCHAT_FAULT_INJECT=nan@N`` the first quantity
    checked at step N reads as NaN (tests that every step stops there, saving nothing new).
    """
    import math

    from utils import fault_injection

    poisoned = fault_injection.nan_at(step)
    for name, value in values.items():
        value = float(value.detach()) if hasattr(value, "detach") else float(value)
        if poisoned:
            value, poisoned = float("nan"), False
        if not math.isfinite(value):
            raise TrainingDiverged(f"non-finite {name} ({value}) at step {step}; stopping without saving "
                                   "(the last good checkpoint, if any, is kept)")
