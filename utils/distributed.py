"""Ranks and the process group: who am I, how many are we, wait for the others, average a tensor.

Works before ``torch.distributed`` is initialised (reads the launcher's environment) and on
one process; :func:`init_distributed` sets up the group under ``deepspeed``, ``torchrun``
and plain ``python`` (CPU: gloo).
"""
from __future__ import annotations

import atexit
import contextlib
import os

import torch

from utils.launch import free_port


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


def clear_stale_extension_locks(root: str | None = None, min_age_s: float = 30.0, log=None) -> list:
    """Remove build locks a killed compile left in the torch-extensions cache; returns their paths.

    DeepSpeed JIT-compiles its ops (on the CPU: the shared-memory op, at start-up) under a ``lock`` file
    that the compiling process deletes when it is done; killed in between, it leaves the file, and every
    later run waits for it forever, silently. A lock counts as stale when it is older than ``min_age_s``
    and no process works in its build folder (a live compile runs ninja and the compilers there).
    ``root``: the cache (default: torch's, ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``).
    """
    import glob
    import time

    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    locks = glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))
    if not locks:
        return []
    busy = set()
    for cwd in glob.glob("/proc/[0-9]*/cwd"):
        try:
            busy.add(os.path.realpath(os.readlink(cwd)))
        except OSError:
            continue
    cleared = []
    for lock in locks:
        folder = os.path.realpath(os.path.dirname(lock))
        try:
            old = time.time() - os.path.getmtime(lock) > min_age_s
        except OSError:
            continue
        if old and not any(path == folder or path.startswith(folder + os.sep) for path in busy):
            try:
                os.remove(lock)
            except OSError:
                continue
            cleared.append(lock)
            (log or print)(f"removed a stale build lock {lock} (a compile killed before it finished)")
    return cleared


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
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    args.local_rank = int(os.environ.get("LOCAL_RANK", max(getattr(args, "local_rank", 0), 0)))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            skip_shm_op()
        elif args.local_rank == 0:  # DeepSpeed builds its shared-memory op now: a killed build must not hang us
            clear_stale_extension_locks()
        deepspeed.init_distributed(dist_backend="gloo")
        atexit.register(_remove_shm_buffer)
        device = torch.device("cpu")
    else:
        accelerator.set_device(args.local_rank)
        deepspeed.init_distributed()
        device = torch.device(accelerator.device_name(args.local_rank))
    args.global_rank = torch.distributed.get_rank()
    return device


def skip_shm_op() -> None:
    """One CPU process: tell DeepSpeed its shared-memory all-reduce op is unavailable, so it neither JIT-compiles
    it (1-2 min on a fresh machine) nor loads it (and its all-reduce buffer) for a group with nobody to reduce
    with; a collective on one rank is an identity either way, and DeepSpeed falls back to torch.distributed."""
    import deepspeed.ops

    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


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


def get_all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over all ranks (identity on one rank)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1:
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        tensor = tensor / get_world_size()
    return tensor
