"""Small shared helpers: distributed set-up, seeding, device moves, atomic folders.

Heavy imports (deepspeed, transformers) stay inside the functions that need them,
so ``--help`` and the pure modules stay fast and network-free.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import socket
import sys
import tempfile
from typing import Callable

import numpy as np
import torch

from utils.errors import TrainingDiverged, UserInputError


# --------------------------------------------------------------------------- ranks

def get_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_rank_0() -> bool:
    return get_rank() == 0


def print_rank_0(msg, rank=None) -> None:
    """Print on global rank 0 only (``rank`` may be given explicitly, as in the reference)."""
    if (get_rank() if rank is None else rank) <= 0:
        print(msg, flush=True)


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(args) -> torch.device:
    """Initialise DeepSpeed's process group; works under ``deepspeed``, ``torchrun`` and plain ``python``.

    A plain ``python main.py`` gets a one-rank group (env vars filled in here, so
    DeepSpeed does not go looking for MPI). CPU uses gloo, GPUs the accelerator's
    default backend. Sets ``args.local_rank`` and ``args.global_rank``; returns the device.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:  # not launched by deepspeed/torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    args.local_rank = int(os.environ.get("LOCAL_RANK", max(getattr(args, "local_rank", 0), 0)))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        deepspeed.init_distributed(dist_backend="gloo")
        atexit.register(_remove_shm_buffer)
        device = torch.device("cpu")
    else:
        accelerator.set_device(args.local_rank)
        deepspeed.init_distributed()
        device = torch.device(accelerator.device_name(args.local_rank))
    args.global_rank = torch.distributed.get_rank()
    return device


def _remove_shm_buffer() -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer in /dev/shm at exit.

    DeepSpeed's shm_comm op (used when all ranks are local, e.g. ``deepspeed --num_gpus 2`` on
    CPU) creates ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (66 MB) and never
    unlinks it, so every multi-rank CPU run leaked 66 MB of RAM per rank until reboot. The
    other ranks' mappings stay valid after the unlink.
    """
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(os.getuid(), os.environ.get("MASTER_ADDR", ""),
                                                           os.environ.get("MASTER_PORT", ""),
                                                           os.environ.get("RANK", "0"))
    with contextlib.suppress(OSError):
        os.unlink(os.path.join("/dev/shm", name))


def on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def resolve_dtype(args) -> str:
    """``--dtype`` default is fp16 on an accelerator, fp32 on CPU; fp16 on CPU is refused."""
    if args.dtype is None:
        args.dtype = "fp32" if on_cpu() else "fp16"
    elif args.dtype == "fp16" and on_cpu():
        raise UserInputError("--dtype fp16 needs a GPU (DeepSpeed's fp16 optimizer does not run on CPU); "
                             "use --dtype bf16 or --dtype fp32")
    return args.dtype


def torch_dtype(name: str) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


# --------------------------------------------------------------------------- misc

def set_random_seed(seed) -> None:
    if seed is None:
        return
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def get_all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over all ranks (identity on one rank)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1:
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        tensor = tensor / get_world_size()
    return tensor


# Where a training run is, for the Ctrl-C message: updated by utils.checkpoint.CheckpointManager.
PROGRESS = {"step": None, "checkpoint": None, "checkpoints": None}
INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


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


OUT_OF_MEMORY = 4  # the exit status of a step that ran out of accelerator memory
OOM_REMEDY = ("lower --per_device_*_batch_size (step 3: --per_device_generation_batch_size / "
              "--per_device_training_batch_size) or --max_seq_len, raise the ZeRO stage (3 partitions the "
              "weights), add --offload (ZeRO 1-3), --gradient_checkpointing, or LoRA with --only_optimize_lora")


def out_of_memory_message(e: BaseException) -> str:
    """One line for a GPU out-of-memory error: PyTorch's first sentence and the remedies."""
    text = " ".join(str(e).split())
    first = text.split(". ")[0] if text else "out of memory"
    return f"out of GPU memory ({first[:160]}); {OOM_REMEDY}"


def run_main(main: Callable, args) -> None:
    """Run an entry point: bad input ends with one clear line and exit code 2, divergence with exit code 3,
    running out of GPU memory with one line naming the remedies and exit code 4, Ctrl-C with one line
    saying where the run stopped and how to resume, exit code 130."""
    import signal

    try:
        main(args)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except torch.OutOfMemoryError as e:
        print(f"error: {out_of_memory_message(e)}", file=sys.stderr, flush=True)
        sys.exit(OUT_OF_MEMORY)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not turn this into a traceback
        if get_rank() == 0:
            print(f"\n{interrupt_message()}", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)


# --------------------------------------------------------------------------- files

def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def is_write_failure(e: BaseException) -> bool:
    """Is ``e`` the file system refusing a write (disk full, quota, file-size limit, read-only)?

    An :class:`OSError`, or the wrappers that torch's zip writer and safetensors put around one.
    """
    if isinstance(e, OSError):
        return True
    text = str(e)
    if type(e).__name__ == "SafetensorError":
        return "I/O error" in text
    return isinstance(e, RuntimeError) and ("PytorchStreamWriter failed" in text or "inline_container" in text)


@contextlib.contextmanager
def atomic_directory(out_dir: str):
    """Write a folder atomically: yields a temporary sibling, renames it into place on success.

    Entries of an existing ``out_dir`` that the new content does not replace (a
    ``training.log``, a tensorboard folder, sub-model folders) are moved across.
    On an exception the temporary folder is removed and ``out_dir`` is untouched,
    so a crash never leaves a half-written model behind.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; an output folder is an ordinary folder
    except OSError as e:
        raise UserInputError(f"cannot write output folder {out_dir}: {e.strerror}") from None
    try:
        yield tmp
        for root, _, files in os.walk(tmp):  # some writers create 0600 files; outputs are ordinary files
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~umask)
        _fsync_tree(tmp)
        if os.path.isdir(out_dir):
            for name in os.listdir(out_dir):
                if not os.path.exists(os.path.join(tmp, name)):
                    os.replace(os.path.join(out_dir, name), os.path.join(tmp, name))
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "x"))
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):
            raise UserInputError(f"cannot write output folder {out_dir}: {e} (disk full, quota or read-only "
                                 "file system?)") from e
        raise
