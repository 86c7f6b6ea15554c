"""The one exception type for bad user input.

Anything the user can fix (a bad flag, a missing column, an unknown dataset name)
raises :class:`UserInputError` with a message naming the culprit. Entry points
catch it in one place (``utils.utils.run_main``), print the message and exit 2, so
users see one clear line instead of a traceback from deep inside a library.
"""


class UserInputError(ValueError):
    """Bad input the user can fix: message names the dataset / file / flag / field."""
