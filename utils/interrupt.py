"""Ctrl-C before an entry point's run has started, and after it has ended: one line, exit 130, no traceback.

Python turns Ctrl-C into a ``KeyboardInterrupt`` wherever the process is; before
:func:`utils.entrypoint.run_main` is reached (importing torch and DeepSpeed, parsing the flags: the first
seconds of every command) nothing catches it, and the user gets a traceback from inside an import. Each entry
script calls :func:`exit_quietly_on_ctrl_c` as its first statement; ``run_main`` (and train.py) hand Ctrl-C
back to Python (:func:`raise_on_ctrl_c`) when the run starts, so a running step still says where it stopped
and how to resume (:func:`utils.entrypoint.interrupt_message`).

Standard library only: it must be importable in the first milliseconds.
"""
from __future__ import annotations

import os
import signal
import sys

STARTING = "interrupted while starting; nothing was run or saved"
ENDED = "interrupted while exiting; the run had ended (what it reported is saved)"


def _quiet_exit(message: str):
    def handler(signum, frame):
        if os.environ.get("RANK", "0") in ("0", ""):  # launched ranks all get the Ctrl-C: rank 0 says it
            try:
                sys.stdout.flush()
                sys.stderr.write(f"\n{message}\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)  # at once: no half-imported module's clean-up, no traceback

    handler.quiet_exit = True
    return handler


def exit_quietly_on_ctrl_c(message: str = STARTING) -> None:
    """From now on Ctrl-C ends the process with ``message`` (one line on stderr) and exit code 130."""
    signal.signal(signal.SIGINT, _quiet_exit(message))


def raise_on_ctrl_c() -> bool:
    """Ctrl-C raises ``KeyboardInterrupt`` again (Python's default), for the run's own handling; True if it was
    :func:`exit_quietly_on_ctrl_c`'s (an entry script's process), False if left as it was (e.g. a test's)."""
    if not getattr(signal.getsignal(signal.SIGINT), "quiet_exit", False):
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True
