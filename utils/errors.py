"""The one exception type for bad user input.

Anything the user can fix (a bad flag, a missing column, an unknown dataset name)
raises :class:`UserInputError` with a message naming the culprit. Entry points
catch it in one place (``utils.entrypoint.run_main``), print the message and exit 2, so
users see one clear line instead of a traceback from deep inside a library.

This module imports nothing from the project (everything imports it); :func:`utils.finite.check_finite`
raises :class:`TrainingDiverged`.
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



class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C, with where the run stood and how to go on (:meth:`utils.run_folder.RunFolder.interrupt_message`)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
