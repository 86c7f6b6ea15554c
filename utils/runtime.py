"""The process's device, precision and seed."""
from __future__ import annotations

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
