"""Fault injection for the crash-safety tests: off unless ``DSCHAT_FAULT_INJECT`` is set.

Why it is in production code: the tests prove the crash safety of real training processes,
not of mocks, so the fault has to happen inside a real step's process, at a known step:

* ``DSCHAT_FAULT_INJECT=kill@N``: the process sends itself SIGKILL right after optimizer step N
  (after that step's checkpoint, if any); rerunning the command must resume from the last
  checkpoint and end bit-exactly where an uninterrupted run ends (tests/test_resume.py);
* ``DSCHAT_FAULT_INJECT=interrupt@N``: SIGINT there instead (a Ctrl-C); the run must print
  where to resume and exit 130 (tests/test_reruns.py);
* ``DSCHAT_FAULT_INJECT=killsave@N``: SIGKILL right after the N-th model folder of step 3's final
  save (``critic/``, ``actor_ema/``, then ``actor/``); the folder must not count as finished, and the
  rerun must resume and end bit-exactly as an uninterrupted run (tests/test_resume.py);
* ``DSCHAT_FAULT_INJECT=nan@N``: the first quantity :func:`utils.finite.check_finite` checks
  at step N reads as NaN; the run must stop with exit code 3, saving nothing new
  (tests/test_resume.py).

The hooks (:func:`nan_at` in ``check_finite``, :func:`kill_point` after each optimizer step
in ``CheckpointManager.step_done``, :func:`save_point` between step 3's final saves) do nothing
unless that one variable is set. Its value is parsed once (per distinct value); a malformed one
raises :class:`UserInputError` naming the variable rather than being ignored. The empty string
counts as unset.

Pure module: standard library only.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import sys
from typing import Optional, Tuple

from utils.errors import UserInputError

ENV = "DSCHAT_FAULT_INJECT"
KINDS = ("nan", "kill", "interrupt", "killsave")
_SIGNALS = {"kill": signal.SIGKILL, "interrupt": signal.SIGINT}
_FORM = re.compile(r"(?P<kind>\w+)@(?P<step>\d+)")


@functools.lru_cache(maxsize=None)
def _parse(value: str) -> Optional[Tuple[str, int]]:
    if not value:
        return None
    found = _FORM.fullmatch(value.strip())
    if found is None or found["kind"] not in KINDS or int(found["step"]) < 1:
        raise UserInputError(f"{ENV}={value!r}: expected KIND@STEP with KIND one of {', '.join(KINDS)} and STEP an "
                             f"optimizer step (1, 2, ...), e.g. {ENV}=kill@3; unset it for a normal run")
    return found["kind"], int(found["step"])


def fault() -> Optional[Tuple[str, int]]:
    """``(kind, step)`` from ``$DSCHAT_FAULT_INJECT``, or None (every normal run)."""
    return _parse(os.environ.get(ENV, ""))


def setting(kind: str, step: int) -> dict:
    """The environment entry that injects ``kind`` at ``step`` (for the tests' subprocesses)."""
    value = f"{kind}@{step}"
    _parse(value)
    return {ENV: value}


def nan_at(step: int) -> bool:
    """Whether the first quantity checked at optimizer step ``step`` is to read as NaN (``nan@N``)."""
    return fault() == ("nan", step)


def kill_point(step: int) -> None:
    """SIGKILL (``kill@N``) or SIGINT (``interrupt@N``) this process after optimizer step ``step``."""
    found = fault()
    if found is not None and found[0] in _SIGNALS and found[1] == step:
        _signal_self(_SIGNALS[found[0]])


def save_point(saved: int) -> None:
    """SIGKILL this process (``killsave@N``) once ``saved`` == N model folders of a final save are written."""
    if fault() == ("killsave", saved):
        _signal_self(signal.SIGKILL)


def _signal_self(sig: int) -> None:
    """Send ``sig`` to this process, after flushing what it printed (the tests read it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)
