"""Logging in one place: rank-0 printing, tqdm bars, tensorboard scalars, a metrics file.

Every entry point makes one :class:`TrainLogger`; loops call ``log.info``,
``log.progress`` and ``log.scalars`` and never ``print``. Only global rank 0
writes anything. Scalars go to tensorboard (``--enable_tensorboard``) and, when
an output folder is given, to ``<output_dir>/metrics.jsonl`` (one JSON object a
line), which ``train.py`` reads for its summary table and curves.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

from utils.distributed import is_rank_0
from utils.errors import UserInputError
from utils.files import atomic_write


class TrainLogger:
    def __init__(self, name: str, enable_tensorboard: bool = False, tensorboard_path: str = "",
                 metrics_dir: str | None = None):
        self.name = name
        self.rank0 = is_rank_0()
        self.writer = None
        self.metrics_file = None
        self.metrics_dir = metrics_dir
        if not self.rank0:
            return
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(tensorboard_path, "ds_tensorboard_logs", name))

    def info(self, msg: str) -> None:
        if self.rank0:
            print(msg, flush=True)

    def warning(self, msg: str) -> None:
        if self.rank0:
            print(f"warning: {msg}", file=sys.stderr, flush=True)

    def progress(self, iterable, desc: str, total: int | None = None):
        """A tqdm bar on rank 0 (sparse updates when not on a terminal), the bare iterable elsewhere."""
        from tqdm.auto import tqdm

        tty = sys.stderr.isatty()
        return tqdm(iterable, desc=desc, total=total, disable=not self.rank0, dynamic_ncols=True,
                    mininterval=0.5 if tty else 10.0, leave=tty)

    def scalars(self, step: int, prefix: str = "", **values) -> None:
        """Log ``values`` (floats or 0-d tensors) at ``step`` under ``prefix/``."""
        if not self.rank0:
            return
        clean = {k: float(v) for k, v in values.items() if v is not None}
        if self.writer is not None:
            for key, value in clean.items():
                self.writer.add_scalar(f"{prefix}/{key}" if prefix else key, value, step)
            self.writer.flush()
        path = os.path.join(self.metrics_dir or "", "metrics.jsonl")
        try:
            if self.metrics_dir and self.metrics_file is None:  # opened on first use: a run that fails
                os.makedirs(self.metrics_dir, exist_ok=True)  # during set-up leaves no output folder behind
                self.metrics_file = open(path, "a", buffering=1)
            if self.metrics_file is not None:
                row = {"step": step, "phase": prefix, "time": round(time.time(), 3)}
                row.update({k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()})
                self.metrics_file.write(json.dumps(row) + "\n")
        except OSError as e:  # a full disk or a vanished folder: one line, not a traceback from the loop
            raise UserInputError(f"cannot write {path}: {e.strerror or e} (disk full, quota or read-only file "
                                 "system?)") from None

    def restart_metrics(self, resumed_step: int | None) -> None:
        """Make ``metrics.jsonl`` this run's record: rows of an earlier attempt past ``resumed_step`` go.

        A fresh run (``None``) starts an empty file; a run resumed from step N keeps the rows
        before N and N's training row (the steps it will not redo). So a rerun never mixes old
        and new rows or restarts the step counter within one file.
        """
        if not (self.rank0 and self.metrics_dir):
            return
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None
        path = os.path.join(self.metrics_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            return
        keep = []
        if resumed_step is not None:
            with open(path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                        step = int(row["step"])
                    except (ValueError, KeyError, TypeError):
                        continue
                    if step < resumed_step or (step == resumed_step and row.get("phase") == "train"):
                        keep.append(line if line.endswith("\n") else line + "\n")
        def write(tmp):
            with open(tmp, "w") as f:
                f.writelines(keep)
        atomic_write(path, write, "the metrics log")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
