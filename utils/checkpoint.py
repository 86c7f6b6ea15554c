"""Resumable training checkpoints: DeepSpeed engine states + the training state DeepSpeed does not hold.

Layout under ``<output_dir>/checkpoints/``::

    step-00000040/
        actor/ critic/ ...      engine.save_checkpoint(): model, optimizer, scheduler, loss scaler
        rng-rank0.pt …          per rank: python / numpy / torch (/ accelerator) RNG states
        trainer_state.pt        rank 0: epoch, step, data-loader position, extra (EMA reward, …)
        MANIFEST.json           written last: size and sha256 of every other file
    latest                      names the newest complete checkpoint

A checkpoint is written into ``.tmp-step-N`` and renamed into place only when
every rank has finished and the manifest is written and fsynced, so "latest"
always names a complete checkpoint. Loading walks the checkpoints newest first;
one whose manifest is missing or does not match the files is skipped with a
message, falling back to the previous one. Only the newest ``max_checkpoints``
are kept.

Our own files are loaded with ``torch.load(weights_only=True)`` (no arbitrary
unpickling). DeepSpeed's engine files are DeepSpeed's format; they are loaded
only after their hashes match the manifest we wrote.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from typing import Callable, Dict, Optional

import numpy as np
import torch

from utils.utils import barrier, get_rank, is_rank_0

MANIFEST = "MANIFEST.json"
STATE = "trainer_state.pt"
_NAME = re.compile(r"^step-(\d{8})$")


# --------------------------------------------------------------------------- RNG

def rng_state() -> dict:
    """Every RNG that training consumes, in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- files

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: str):
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel != MANIFEST:
                yield rel, path


def write_manifest(root: str) -> None:
    manifest = {rel: {"size": os.path.getsize(path), "sha256": _sha256(path)} for rel, path in _files(root)}
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST))
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())


def verify_manifest(root: str) -> Optional[str]:
    """``None`` when every file matches the manifest, else what is wrong."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return "no manifest (incomplete checkpoint)"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})"
    present = dict(_files(root))
    for rel, meta in manifest.items():
        if rel not in present:
            return f"missing file {rel}"
        if os.path.getsize(present[rel]) != meta["size"]:
            return f"size mismatch in {rel}"
        if _sha256(present[rel]) != meta["sha256"]:
            return f"checksum mismatch in {rel}"
    return None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- manager

class CheckpointManager:
    """Save / find / load resumable checkpoints of several DeepSpeed engines under one folder."""

    def __init__(self, output_dir: str, max_checkpoints: int = 2, log: Callable[[str], None] = print):
        self.root = os.path.join(output_dir, "checkpoints")
        self.max_checkpoints = max(1, max_checkpoints)
        self.log = log

    def checkpoints(self):
        """Complete-looking checkpoint folders, newest first."""
        if not os.path.isdir(self.root):
            return []
        names = sorted((n for n in os.listdir(self.root) if _NAME.match(n)), reverse=True)
        return [os.path.join(self.root, n) for n in names]

    def save(self, step: int, engines: Dict[str, object], trainer_state: dict) -> str:
        """Collective: every rank calls it. Returns the final checkpoint folder."""
        name = f"step-{step:08d}"
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".tmp-{name}")
        if is_rank_0():
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        for engine_name, engine in engines.items():
            engine.save_checkpoint(os.path.join(tmp, engine_name), tag="state", save_latest=False)
        torch.save(rng_state(), os.path.join(tmp, f"rng-rank{get_rank()}.pt"))
        if is_rank_0():
            torch.save(dict(trainer_state, step=step), os.path.join(tmp, STATE))
        barrier()
        if is_rank_0():
            write_manifest(tmp)
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._write_latest(name)
            _fsync_dir(self.root)
            for old in self.checkpoints()[self.max_checkpoints:]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def _write_latest(self, name: str) -> None:
        tmp = os.path.join(self.root, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, "latest"))

    def find_valid(self) -> Optional[str]:
        """The newest checkpoint whose files match its manifest; corrupt ones are reported and skipped."""
        for path in self.checkpoints():
            problem = verify_manifest(path)
            if problem is None:
                return path
            self.log(f"checkpoint {path} is unusable ({problem}); falling back to an older one")
        return None

    def load(self, engines: Dict[str, object], path: Optional[str] = None) -> Optional[dict]:
        """Load the newest valid checkpoint into ``engines`` (collective); returns the trainer state or None."""
        path = path or self.find_valid()
        if path is None:
            return None
        for engine_name, engine in engines.items():
            load_path, _ = engine.load_checkpoint(os.path.join(path, engine_name), tag="state")
            if load_path is None:
                raise RuntimeError(f"DeepSpeed could not load {engine_name} from {path}")
        rng_file = os.path.join(path, f"rng-rank{get_rank()}.pt")
        if os.path.isfile(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=True))
        state = torch.load(os.path.join(path, STATE), weights_only=True)
        self.log(f"resumed from {path} (step {state['step']})")
        return state
