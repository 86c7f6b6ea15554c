"""How an entry point ends: one clear line and a documented exit code for each way a run can fail."""
from __future__ import annotations

import sys
from typing import Callable

import torch

from utils.distributed import get_rank
from utils.errors import BAD_INPUT, DIVERGED, INTERRUPTED, OUT_OF_MEMORY, TrainingDiverged, UserInputError


# Where a training run is, for the Ctrl-C message: updated by utils.checkpoint.CheckpointManager.
PROGRESS = {"step": None, "checkpoint": None, "checkpoints": None}


def interrupt_message() -> str:
    """"interrupted at step N; rerun … to resume from step M" (or what a rerun does instead)."""
    step, saved, root = PROGRESS["step"], PROGRESS["checkpoint"], PROGRESS["checkpoints"]
    where = "before the first training step" if step is None else f"at step {step}"
    if saved:
        return f"interrupted {where}; rerun the same command to resume from step {saved} (checkpoint in {root})"
    if step is None:
        return f"interrupted {where}; nothing was saved, a rerun starts afresh"
    return (f"interrupted {where}; no checkpoint was saved (--save_interval N saves one every N steps), "
            "so a rerun starts afresh")


OOM_REMEDY = ("lower --per_device_*_batch_size (step 3: --per_device_generation_batch_size / "
              "--per_device_training_batch_size) or --max_seq_len, raise the ZeRO stage (3 partitions the "
              "weights), add --offload (ZeRO 1-3), --gradient_checkpointing, or LoRA with --only_optimize_lora")


def out_of_memory_message(e: BaseException) -> str:
    """One line for a GPU out-of-memory error: PyTorch's first sentence and the remedies."""
    text = " ".join(str(e).split())
    first = text.split(". ")[0] if text else "out of memory"
    return f"out of GPU memory ({first[:160]}); {OOM_REMEDY}"


def run_main(main: Callable, args) -> None:
    """Run an entry point: bad input ends with one clear line and exit code 2 (so does a full disk, from any
    writer), divergence with exit code 3, running out of GPU memory with one line naming the remedies and exit
    code 4, Ctrl-C with one line saying where the run stopped and how to resume, exit code 130 (before this,
    :func:`utils.interrupt.exit_quietly_on_ctrl_c` covers the imports and the parsing of the flags)."""
    import signal

    from utils import overwrite
    from utils.files import machine_write_failure_line
    from utils.interrupt import ENDED, exit_quietly_on_ctrl_c, raise_on_ctrl_c

    entry_script = False
    try:
        entry_script = raise_on_ctrl_c()  # the run starts: Ctrl-C now says where it stopped
        try:
            main(args)
        except BaseException as e:
            if not (isinstance(e, SystemExit) and not e.code):
                overwrite.restore()  # failed before its first step: --overwrite puts the earlier run back
            raise
        overwrite.commit()  # ended well (a run without a training step included)
        if entry_script:
            exit_quietly_on_ctrl_c(ENDED)  # the interpreter's shutdown: no traceback from an atexit handler
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(DIVERGED)
    except torch.OutOfMemoryError as e:
        print(f"error: {out_of_memory_message(e)}", file=sys.stderr, flush=True)
        sys.exit(OUT_OF_MEMORY)
    except Exception as e:  # the machine's state from any writer (a full disk…): one line, not a traceback
        line = machine_write_failure_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not turn this into a traceback
        if get_rank() == 0:
            print(f"\n{interrupt_message()}", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
