"""Ranks and the process group: who am I, how many are we, wait for the others, average a tensor.

Works before ``torch.distributed`` is initialised (reads the launcher's environment) and on
one process; :func:`init_distributed` sets up the group under ``deepspeed``, ``torchrun``
and plain ``python`` (CPU: gloo).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import threading
import time

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


def torch_extensions_root() -> str:
    """Where torch builds C++ extensions (and DeepSpeed JIT-compiles its ops), resolved as torch's own
    ``cpp_extension._get_build_directory`` does: ``$TORCH_EXTENSIONS_DIR`` when set (each op in ``<it>/<op>``),
    else :func:`~torch.utils.cpp_extension.get_default_build_root` (``~/.cache/torch_extensions``, each op in
    ``<it>/py<XY>_<accelerator>/<op>``). Creates nothing (torch's own function creates the op's folder)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return get_default_build_root() if root is None else root


def _build_lock_in_use(lock: str) -> bool:
    """Does a live process own build lock ``lock``? torch's ``FileBaton`` keeps the file open from its creation to
    its removal, so its owner holds a descriptor on it; a compile it started (ninja, the compilers) works in the
    lock's folder. Either counts as alive. Without a readable ``/proc`` nothing can be told: alive."""
    import glob

    if not os.path.isdir("/proc/self/fd"):
        return True
    lock = os.path.realpath(lock)
    folder = os.path.dirname(lock)
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            cwd = os.path.realpath(os.readlink(os.path.join(proc, "cwd")))
            if cwd == folder or cwd.startswith(folder + os.sep):
                return True
        except OSError:
            pass
        try:
            fds = os.listdir(os.path.join(proc, "fd"))
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(proc, "fd", fd)) == lock:
                    return True
            except OSError:
                continue
    return False


def _remove_if_stale(lock: str, min_age_s: float, log=None, why: str = "a compile killed before it finished") -> bool:
    """Remove ``lock`` when it is older than ``min_age_s`` and no live process owns it (checked twice, a moment
    apart, on the same file: an owner releasing it closes it just before deleting it); True if removed."""
    try:
        first = os.stat(lock)
    except OSError:
        return False
    if time.time() - first.st_mtime <= min_age_s or _build_lock_in_use(lock):
        return False
    time.sleep(0.2)
    try:
        again = os.stat(lock)
        if (again.st_ino, again.st_dev) != (first.st_ino, first.st_dev) or _build_lock_in_use(lock):
            return False
        os.remove(lock)
    except OSError:
        return False
    (log or print)(f"removed a stale build lock {lock} ({why})")
    return True


def clear_stale_extension_locks(root: str | None = None, min_age_s: float = 30.0, log=None) -> list:
    """Remove build locks a killed compile left in the torch-extensions cache; returns their paths.

    DeepSpeed JIT-compiles its ops (on the CPU: the shared-memory op, at start-up; ``cpu_adam`` with
    ``--offload``; fused optimizers on a GPU) under a ``lock`` file that the compiling process deletes when it is
    done; killed in between, it leaves the file, and every later run waits for it forever, silently. A lock
    counts as stale when it is older than ``min_age_s`` and no live process owns it (:func:`_build_lock_in_use`).
    ``root``: the cache (default: torch's, :func:`torch_extensions_root`).
    """
    import glob

    root = torch_extensions_root() if root is None else root
    locks = glob.glob(os.path.join(glob.escape(root), "*", "lock")) + \
        glob.glob(os.path.join(glob.escape(root), "*", "*", "lock"))
    return [lock for lock in locks if _remove_if_stale(lock, min_age_s, log)]


class _BuildLockTakenOver(Exception):
    """Raised inside torch's wait for a build lock whose owner died: the build is started again."""


_GUARD = {"installed": False, "check_every_s": 5.0}
_WAITING = threading.local()  # inside a guarded torch JIT build (this thread)


def guard_build_locks(log=None) -> None:
    """Make torch's JIT builds (DeepSpeed's ops) never wait forever on a dead owner's lock: while a build waits
    for another process's ``lock`` (torch's ``FileBaton.wait`` polls until the file is gone), every few seconds
    the lock is checked; once its owner is dead (:func:`_build_lock_in_use`) it is removed, with one line, and the
    build starts again here (torch's ``_jit_compile`` retried). Installed once per process; idempotent."""
    from torch.utils import cpp_extension, file_baton

    if _GUARD["installed"]:
        return
    original_wait, original_jit = file_baton.FileBaton.wait, cpp_extension._jit_compile

    def wait(self) -> None:
        if not getattr(_WAITING, "active", False):
            return original_wait(self)
        checked = time.monotonic()
        while os.path.exists(self.lock_file_path):
            time.sleep(self.wait_seconds)
            if time.monotonic() - checked >= _GUARD["check_every_s"]:
                checked = time.monotonic()
                if _remove_if_stale(self.lock_file_path, 0.0, log, "its compile died while this run waited"):
                    raise _BuildLockTakenOver(self.lock_file_path)

    def jit_compile(*args, **kwargs):
        outer = getattr(_WAITING, "active", False)
        _WAITING.active = True
        try:
            while True:
                try:
                    return original_jit(*args, **kwargs)
                except _BuildLockTakenOver:
                    continue  # the dead owner's lock is gone: this process builds the op itself
        finally:
            _WAITING.active = outer

    file_baton.FileBaton.wait = wait
    cpp_extension._jit_compile = jit_compile
    _GUARD["installed"] = True


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
    # DeepSpeed JIT-compiles ops (the CPU shared-memory op now, cpu_adam / fused optimizers at the engines' set-up):
    # a lock a killed build left is removed, and one whose owner dies while we wait is taken over then
    guard_build_locks()
    if args.local_rank <= 0:
        clear_stale_extension_locks()
    if accelerator.device_name() == "cpu":
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            skip_shm_op()
        deepspeed.init_distributed(dist_backend="gloo")
        atexit.register(_remove_shm_buffer)
        device = torch.device("cpu")
    else:
        accelerator.set_device(args.local_rank)
        deepspeed.init_distributed()
        device = torch.device(accelerator.device_name(args.local_rank))
    args.global_rank = torch.distributed.get_rank()
    return device


def end_distributed(settle_s: float = 0.1) -> None:
    """Tear the process group down once a run has finished (no-op without one), while Python is still alive.

    Without it a CPU run could abort as it exits ("terminate called without an active exception", SIGABRT, and the
    launcher reports the finished run failed): gloo's worker thread lets go of a finished collective, and with it
    the Python tensors it was given, a moment after the caller's ``wait`` returned; if the interpreter is
    finalizing by then, the thread's taking the GIL ends it inside a ``noexcept`` destructor. A group nothing else
    holds joins its threads when destroyed; one DeepSpeed still holds (its ZeRO groups) keeps them, so this also
    gives them ``settle_s`` without the GIL to finish. Torch 2.13 CPU, two gloo ranks: about 1 exit in 5 aborted
    after a waited ``all_gather``, 4 in 5 with collectives left running."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        gc.collect()  # groups held only by reference cycles go now, joining their threads
        time.sleep(settle_s)


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


def gather_per_rank(value) -> list:
    """``[rank 0's value, rank 1's, …]`` on every rank (picklable values; ``[value]`` with one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or get_world_size() == 1:
        return [value]
    out = [None] * get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out
