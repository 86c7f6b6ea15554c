"""How an entry point ends: one clear line and a documented exit code for each way a run can fail."""
from __future__ import annotations

import os
import sys
from typing import Callable

from utils.errors import (BAD_INPUT, DIVERGED, INTERRUPTED, OUT_OF_MEMORY, RunInterrupted, TrainingDiverged,
                          UserInputError)
from utils.run_folder import RunFolder


def interrupt_message(e: KeyboardInterrupt) -> str:
    """Where the run stood (:class:`~utils.errors.RunInterrupted`, from the run's output folder), or, for a Ctrl-C
    before the folder was taken, that nothing was saved."""
    return e.message if isinstance(e, RunInterrupted) else RunFolder(None).interrupt_message()


def error_line(e: BaseException, text: str = "") -> str:
    """``error: …`` (``text``, default the exception's message) with the exception's notes (e.g. what
    ``--overwrite`` deleted before the run failed)."""
    return "; ".join([f"error: {text or e}", *getattr(e, "__notes__", ())])


OOM_REMEDY = ("lower --per_device_*_batch_size (step 3: --per_device_generation_batch_size / "
              "--per_device_training_batch_size) or --max_seq_len, raise the ZeRO stage (3 partitions the "
              "weights), add --offload (ZeRO 1-3), --gradient_checkpointing, or LoRA with --only_optimize_lora")


def out_of_memory_message(e: BaseException) -> str:
    """One line for a GPU out-of-memory error: PyTorch's first sentence and the remedies."""
    text = " ".join(str(e).split())
    first = text.split(". ")[0] if text else "out of memory"
    return f"out of GPU memory ({first[:160]}); {OOM_REMEDY}"


class _NoSuchError(Exception):
    """Stands in for ``torch.OutOfMemoryError`` in a process that never imported torch (a pure-Python tool)."""


def _out_of_memory_type() -> type:
    """``torch.OutOfMemoryError`` where torch is loaded; a process that never imported torch cannot have raised
    it (so a pure-Python tool under :func:`run_main` starts without torch's import)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", _NoSuchError) if torch is not None else _NoSuchError


def _rank() -> int:
    """The process's global rank: :func:`utils.distributed.get_rank` once torch is loaded, else ``$RANK``."""
    if "torch" in sys.modules:
        from utils.distributed import get_rank

        return get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def run_main(main: Callable, args, imports=("torch",)) -> None:
    """Run an entry point: bad input ends with one clear line and exit code 2 (so does a full disk, from any
    writer), divergence with exit code 3, running out of GPU memory with one line naming the remedies and exit
    code 4, Ctrl-C with one line saying where the run stopped and how to resume, exit code 130, a reader of the
    output that went away (`| head`) quietly with exit code 141 (before this,
    :func:`utils.interrupt.exit_quietly_on_ctrl_c` covers the imports and the parsing of the flags, and
    ``imports``, the heavy modules ``main`` would import on its first lines: a Ctrl-C while they load is
    "interrupted while starting", not a run's). What the output folder does on each (``--overwrite``'s earlier run
    put back, or named as gone) is the run's :class:`~utils.run_folder.RunFolder`'s business, inside ``main``."""
    import importlib
    import signal

    from utils.files import machine_write_failure_line
    from utils.interrupt import ENDED, exit_quietly_on_ctrl_c, raise_on_ctrl_c

    for name in imports:
        importlib.import_module(name)
    try:
        entry_script = raise_on_ctrl_c()  # the run starts: Ctrl-C now says where it stopped
        main(args)
        if entry_script:
            _end_distributed()
            exit_quietly_on_ctrl_c(ENDED)  # the interpreter's shutdown: no traceback from an atexit handler
    except (UserInputError, TrainingDiverged) as e:
        print(error_line(e), file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT if isinstance(e, UserInputError) else DIVERGED)
    except _out_of_memory_type() as e:  # evaluated when something was raised: torch's, if main loaded torch
        print(error_line(e, out_of_memory_message(e)), file=sys.stderr, flush=True)
        sys.exit(OUT_OF_MEMORY)
    except BrokenPipeError:  # the reader of the output went away (`chat.py | head`): stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail too
        sys.exit(128 + signal.SIGPIPE)
    except Exception as e:  # the machine's state from any writer (a full disk…): one line, not a traceback
        line = machine_write_failure_line(e)
        if line is None:
            raise
        print(error_line(e, line), file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not turn this into a traceback
        if _rank() == 0:
            print(f"\n{interrupt_message(e)}", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)


def _end_distributed() -> None:
    """A run that finished: its process group, if it made one, goes while Python is alive (see
    :func:`utils.distributed.end_distributed`). A tool that never loaded torch has none, and loads nothing here."""
    if "torch" in sys.modules:
        from utils.distributed import end_distributed

        end_distributed()


def run_script(main: Callable[[], "int | None"], imports=()) -> None:
    """A bench's or tool's ``main()`` (it parses ``sys.argv`` itself) under :func:`run_main` (``imports`` as there;
    none by default: a pure-Python tool starts without torch), its return value the exit code: a user's mistake is
    one ``error:`` line and exit 2, Ctrl-C one line and exit 130, as every entry point (tests/test_script_rules.py
    checks that each shipped script's ``__main__`` goes through one of these)."""
    code = []

    def call(_args):
        try:
            code.append(main())
        except RunInterrupted:
            raise
        except KeyboardInterrupt:  # not a training step's: no checkpoint to name
            raise RunInterrupted("interrupted; what it reported as done is kept, the rest was not run") from None

    run_main(call, None, imports)
    sys.exit(code[0] if code and code[0] is not None else 0)
