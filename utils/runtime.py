"""The process's device, precision and seed."""
from __future__ import annotations

import os
import random

import numpy as np
import torch

from utils.errors import UserInputError


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


# --------------------------------------------------------------------------- bf16 on a CPU without bf16 instructions

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86's two (/proc/cpuinfo flags), aarch64's (its Features)
NO_AVX512 = ("AVX2", "NO AVX")  # torch's CPU capabilities that rule the x86 bf16 instructions out


def cpuinfo_field(keys: tuple, path: str = "/proc/cpuinfo") -> str | None:
    """The value of the first line of /proc/cpuinfo whose key is one of ``keys`` (lower case), stripped; None
    where there is none or the file is unreadable."""
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip().lower() in keys:
                    return value.strip()
    except OSError:
        return None
    return None


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset | None:
    """The CPU's feature flags (the first ``flags`` or ``Features`` line of /proc/cpuinfo), None where unreadable."""
    value = cpuinfo_field(("flags", "features"), path)
    return None if value is None else frozenset(value.split())


def cpu_model(path: str = "/proc/cpuinfo") -> str | None:
    """The CPU's name (the first ``model name`` line of /proc/cpuinfo), None where unreadable or absent."""
    return cpuinfo_field(("model name",), path) or None


def cpu_capability() -> str | None:
    """torch's ``get_cpu_capability()`` ("AVX2", "AVX512", "NO AVX", "DEFAULT", …), None where it has none."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - an old or unusual build: unknown
        return None


def cpu_lacks_bf16(capability: str | None, flags: frozenset | None) -> str | None:
    """Why bf16 matmuls will be slow on this CPU (no bf16 instructions: oneDNN emulates them, ~48× slower than fp32
    on an AVX2 AMD EPYC), or None where it has them or nothing tells. Pure: ``capability`` is torch's
    :func:`cpu_capability`, ``flags`` :func:`cpu_flags`."""
    if flags is not None:
        if any(flag in flags for flag in BF16_CPU_FLAGS):
            return None
        return f"this CPU has no bf16 instructions (no {' / '.join(BF16_CPU_FLAGS[:2])}; torch: {capability or '?'})"
    if capability in NO_AVX512:
        return f"this CPU has no bf16 instructions (torch reports {capability})"
    return None


def host_line(cpu: str | None, cores: int, flags: frozenset | None, capability: str | None,
              gpu: str | None = None) -> str:
    """The machine a wall time was measured on, in one line: the GPU where one did the work, else the CPU, the
    cores this process may use and whether the CPU has bf16 instructions (a bf16 recipe's speed on a CPU turns on
    them: :func:`cpu_lacks_bf16`). Pure."""
    if gpu:
        return gpu
    if cpu_lacks_bf16(capability, flags):
        bf16 = "no bf16 instructions"
    elif flags:
        bf16 = "bf16 instructions: " + ", ".join(flag for flag in BF16_CPU_FLAGS if flag in flags)
    else:
        bf16 = "bf16 instructions unknown"
    return f"{cpu or 'unknown CPU'}, {cores} cores, {bf16}"


def this_host() -> str:
    """:func:`host_line` of this machine (the first CUDA device where there is one)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return host_line(cpu_model(), cores, cpu_flags(), cpu_capability(), gpu)


def slow_bf16_warning(dtype: str | None, autocast: bool = False, generation_dtype: str | None = None,
                      capability: str | None = None, flags: frozenset | None = None) -> str | None:
    """One line for a run on the CPU in bf16 (``--dtype bf16``, with or without ``--torch_autocast``, or
    ``--generation_dtype bf16``) where :func:`cpu_lacks_bf16`, naming the faster setting; else None. Pure."""
    if dtype != "bf16" and generation_dtype != "bf16":
        return None
    why = cpu_lacks_bf16(capability, flags)
    if why is None:
        return None
    if dtype == "bf16":
        chosen = "--dtype bf16" + (" --torch_autocast" if autocast else "")
        faster = "--dtype fp32" + (" (without --torch_autocast)" if autocast else "")
        if generation_dtype == "bf16":
            chosen, faster = f"{chosen} --generation_dtype bf16", f"{faster} and no --generation_dtype"
    else:
        chosen, faster = "--generation_dtype bf16", "no --generation_dtype (generate from the fp32 actor)"
    return (f"{chosen} on the CPU: {why}, so bf16 matmuls run many times (~50x) slower than fp32 here; the faster "
            f"setting is {faster}")


def cpu_bf16_warning(args, device) -> str | None:
    """:func:`slow_bf16_warning` of a run's flags (``--dtype``, ``--torch_autocast``, ``--generation_dtype``) when
    ``device`` is the CPU, with this machine's CPU; None elsewhere."""
    if getattr(device, "type", str(device)) != "cpu":
        return None
    dtype, generation = getattr(args, "dtype", None), getattr(args, "generation_dtype", None)
    if dtype != "bf16" and generation != "bf16":
        return None
    return slow_bf16_warning(dtype, bool(getattr(args, "torch_autocast", False)), generation, cpu_capability(),
                             cpu_flags())
