"""``--overwrite`` deletes nothing until the new run has proved it can run.

:func:`set_aside` (called by :func:`utils.preflight.prepare_output_dir` on rank 0) moves the earlier run's
entries into a hidden sibling, ``.NAME.replaced``, instead of deleting them. Then either

* the new run completes its first optimizer step (:meth:`utils.checkpoint.CheckpointManager.step_done`) or
  ends well (:func:`utils.entrypoint.run_main`): :func:`commit` deletes the set-aside entries; or
* it fails before that (bad data found after model set-up, a crash, Ctrl-C): :func:`restore` removes what
  the failed run wrote and puts them back, so the folder is as it was.

A run killed with SIGKILL can do neither: the next run on the folder (which holds its lock by then,
:func:`utils.files.lock_output_dir`) restores the set-aside entries first, so nothing is lost either way.
Only this module moves or deletes them; it imports nothing heavy.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, List, Optional

_PENDING: dict = {}  # {"out", "aside", "log"} while an overwrite waits for the run's first step


def aside_folder(out_dir: str) -> str:
    out_dir = os.path.abspath(out_dir)
    return os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.replaced")


def _remove(path: str) -> None:
    """Delete a folder (its tree, not a symlink's target) or a file."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _put_back(aside: str, out_dir: str) -> List[str]:
    """Move every entry of ``aside`` into ``out_dir`` (replacing an entry of the same name), remove ``aside``."""
    moved = []
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(aside)):
        dest = os.path.join(out_dir, name)
        if os.path.lexists(dest):
            _remove(dest)
        os.replace(os.path.join(aside, name), dest)
        moved.append(name)
    shutil.rmtree(aside, ignore_errors=True)
    return moved


def recover(out_dir: str, log: Callable[[str], None] = print) -> None:
    """Put back what an overwrite killed before its first step had set aside (a SIGKILL leaves that)."""
    aside = aside_folder(out_dir)
    if os.path.isdir(aside):
        moved = _put_back(aside, out_dir)
        log(f"put back {', '.join(moved) or 'nothing'} into {out_dir}: a run with --overwrite was killed before "
            "its first training step")


def set_aside(out_dir: str, names: List[str], keep: tuple = (), log: Callable[[str], None] = print) -> None:
    """Move ``names`` (every entry of ``out_dir`` but ``keep``) into :func:`aside_folder`; :func:`commit` or
    :func:`restore` settles them. Raises ``OSError`` as the file system does."""
    aside = aside_folder(out_dir)
    os.makedirs(aside)
    for name in names:
        os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
    _PENDING.update(out=os.path.abspath(out_dir), aside=aside, keep=tuple(keep), log=log)
    log(f"--overwrite: set the earlier run's {', '.join(names)} aside (in {aside}); they are deleted after this "
        "run's first training step, and put back if it fails before")


def pending() -> Optional[str]:
    """The output folder whose overwrite is not settled yet, or None."""
    return _PENDING.get("out")


def commit() -> None:
    """The new run has proved it can run: delete what the overwrite set aside (no-op when nothing waits)."""
    if _PENDING:
        aside, log = _PENDING["aside"], _PENDING["log"]
        _PENDING.clear()
        shutil.rmtree(aside, ignore_errors=True)
        log(f"--overwrite: deleted the earlier run's files ({aside})")


def restore() -> None:
    """The new run failed before its first step: put the earlier run's entries back (no-op when nothing waits)."""
    if _PENDING:
        out, aside, keep, log = _PENDING["out"], _PENDING["aside"], _PENDING["keep"], _PENDING["log"]
        _PENDING.clear()
        try:
            for name in os.listdir(out) if os.path.isdir(out) else ():  # what the failed run wrote
                if name not in keep:
                    _remove(os.path.join(out, name))
            moved = _put_back(aside, out)
        except OSError as e:  # say where they are rather than lose them
            log(f"--overwrite: could not put the earlier run's files back into {out} ({e}); they are in {aside}")
            return
        log(f"--overwrite: this run failed before its first step; put the earlier run's {', '.join(moved)} back "
            f"into {out}")
