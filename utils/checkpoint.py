"""Resumable training checkpoints: DeepSpeed engine states + the training state DeepSpeed does not hold.

Layout under ``<output_dir>/checkpoints/``::

    step-00000040/
        actor/ critic/ ...      engine.save_checkpoint(): model, optimizer, scheduler, loss scaler
        rng-rank0.pt …          per rank: python / numpy / torch (/ cuda) RNG states
        trainer_state.pt        rank 0: step, epoch, data-loader position, run config, extra (EMA reward, …)
        MANIFEST.json           written last: size and sha256 of every other file
    latest                      names the newest complete checkpoint (informational)

A checkpoint is written into ``.tmp-step-N`` and renamed into place only when
every rank has finished and the manifest is written and fsynced, so a folder
named ``step-N`` is always complete. Loading walks the checkpoints newest first;
one whose manifest is missing or does not match its files is reported, renamed to
``step-N.corrupt`` (kept for inspection, out of the rotation) and skipped, falling
back to the previous one. Only the newest ``max_checkpoints`` are kept.

The entry points use :class:`CheckpointManager` through three calls::

    ckpt = CheckpointManager.from_args(args, log)  # --save_interval, --resume, …
    state = ckpt.resume({"actor": actor_engine, ...})   # None for a fresh run, else the trainer state
    ...                                   # after each optimizer step, once loss/reward passed check_finite:
    ckpt.step_done(step, engines, lambda: {"epoch": ..., "batches_in_epoch": ..., ...})

Resume is automatic: rerunning the same command picks up the newest valid checkpoint
in ``--output_dir``; ``--resume`` makes "no checkpoint" an error. Every flag that changes
the result (all but :data:`RUN_ONLY_FLAGS`: output paths, logging, checkpoint cadence, run length) must
be the same in the interrupted and the resumed run, and so must the world size; a
difference is a :class:`UserInputError` naming the flag. If every checkpoint is corrupt, a run without ``--resume``
starts from scratch (after the messages).

Data-loader position: :class:`EpochSampler` orders an epoch as a pure function of
(seed, epoch) and can skip the batches already consumed, so a resumed run sees exactly
the batches the uninterrupted run would have seen.

Security: our own files are loaded with ``torch.load(weights_only=True)`` (no arbitrary
unpickling). DeepSpeed's engine files are DeepSpeed's format and DeepSpeed unpickles
them (``weights_only=False``); they are loaded only after their sizes and sha256 match
the manifest. That detects corruption and truncation, not tampering: whoever can write
the checkpoint folder can rewrite the manifest too, so only resume from folders you trust.

Test hook: :meth:`CheckpointManager.step_done` ends with :func:`utils.fault_injection.kill_point`,
which with ``DSCHAT_FAULT_INJECT=kill@N`` makes the process SIGKILL itself right after optimizer
step N (after any checkpoint of that step), to test resuming from a hard crash, and with
``interrupt@N`` sends it SIGINT there instead (a Ctrl-C); unset, it does nothing.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from typing import Callable, Dict, Optional

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler

from utils import fault_injection
from utils.distributed import barrier, get_rank, get_world_size, is_rank_0
from utils.errors import UserInputError
from utils.files import atomic_write_text, content_hash, fsync_tree, is_write_failure

MANIFEST = "MANIFEST.json"
STATE = "trainer_state.pt"
_NAME = re.compile(r"^step-(\d{8})$")
# Flags that may differ between an interrupted run and its resume: those that do not change what a run
# computes (paths, logging, evaluation, checkpoint cadence), and the run length, so that a run can be
# resumed to train longer (docs/checkpointing.md). Every other flag must be the same.
RUN_ONLY_FLAGS = frozenset((
    "local_rank", "global_rank", "output_dir", "data_output_path", "save_interval", "max_checkpoints", "resume",
    "overwrite", "print_loss", "enable_tensorboard", "tensorboard_path", "print_answers", "print_answers_interval",
    "eval_interval", "eval_iters", "per_device_eval_batch_size", "preprocessing_num_workers", "deepspeed",
    "deepspeed_config", "deepscale", "deepscale_config", "num_train_epochs", "max_steps", "trust_checkpoint"))


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


# --------------------------------------------------------------------------- data position

class EpochSampler(DistributedSampler):
    """A :class:`DistributedSampler` (also for one rank) that can skip the start of an epoch.

    The order of epoch ``e`` is a pure function of ``(seed, e)`` (and the rank / world
    size). ``set_epoch(e, skip_batches=k, batch_size=b)`` drops this rank's first ``k·b``
    indices of epoch ``e`` — the micro-batches an interrupted run already trained on.
    """

    def __init__(self, dataset, seed: int, shuffle: bool = True, drop_last: bool = False):
        super().__init__(dataset, num_replicas=get_world_size(), rank=get_rank(), shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.skip = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0, batch_size: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = min(skip_batches * batch_size, self.num_samples)

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def resumable_loader(dataset, batch_size: int, seed: int, **kwargs):
    """A training DataLoader whose position a checkpoint can restore (see :class:`EpochSampler`).

    It gets its own generator, so creating its iterator does not draw from the global
    torch RNG (which dropout uses): a resumed run's RNG stream matches the uninterrupted one.
    """
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=batch_size, sampler=EpochSampler(dataset, seed),
                      generator=torch.Generator().manual_seed(seed), **kwargs)


# --------------------------------------------------------------------------- frozen modules

class ModuleState:
    """Checkpoint adapter for a model without an optimizer (step 3's EMA actor).

    DeepSpeed cannot ``save_checkpoint`` a ZeRO-3 engine that has no optimizer, and such
    a model needs no optimizer state anyway: this saves every parameter and buffer in
    full (ZeRO-3 partitions gathered) as one safetensors file, written by rank 0, and
    loads it back into the (possibly partitioned) module. Same two methods as an engine.
    """

    FILE = "model.safetensors"

    def __init__(self, module):
        self.module = module.module if hasattr(module, "module") else module

    def _tensors(self):
        return list(self.module.named_parameters()) + list(self.module.named_buffers())

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None:
        import deepspeed
        from safetensors.torch import save_file

        state = {}
        for name, tensor in self._tensors():
            with deepspeed.zero.GatheredParameters([tensor] if hasattr(tensor, "ds_id") else []):
                if is_rank_0():
                    state[name] = tensor.detach().cpu().clone().contiguous()
        if is_rank_0():
            os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
            save_file(state, os.path.join(save_dir, tag, self.FILE))
        barrier()

    def load_checkpoint(self, load_dir: str, tag: str):
        import deepspeed
        from safetensors.torch import load_file

        state = load_file(os.path.join(load_dir, tag, self.FILE))
        names = {name for name, _ in self._tensors()}
        if names != set(state):
            raise UserInputError(f"checkpoint {load_dir}: its tensors do not match the model "
                                 f"(missing {sorted(names - set(state))[:3]}, unexpected {sorted(set(state) - names)[:3]})")
        with torch.no_grad():
            for name, tensor in self._tensors():
                with deepspeed.zero.GatheredParameters([tensor] if hasattr(tensor, "ds_id") else [],
                                                       modifier_rank=0):
                    tensor.data.copy_(state[name].to(dtype=tensor.dtype, device=tensor.device))
        return load_dir, {}


# --------------------------------------------------------------------------- files

def _files(root: str):
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel != MANIFEST:
                yield rel, path


def _hash_all(paths) -> list:
    """sha256 of each file, several at a time (hashlib releases the GIL: the engines' files hash in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    paths = list(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(paths)))) as pool:
        return list(pool.map(lambda path: content_hash(path, digits=None), paths))


def write_manifest(root: str) -> None:
    """fsync every file and folder under ``root``, then write ``MANIFEST.json`` (size + sha256 of each) atomically."""
    files = list(_files(root))
    fsync_tree(root)
    manifest = {rel: {"size": os.path.getsize(path), "sha256": digest}
                for (rel, path), digest in zip(files, _hash_all(path for _, path in files))}
    atomic_write_text(os.path.join(root, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))


def verify_manifest(root: str) -> Optional[str]:
    """``None`` when every file matches the manifest, else what is wrong."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return "no manifest (incomplete checkpoint)"
    try:
        with open(path) as f:
            manifest = json.load(f)
        present = dict(_files(root))
        for rel, meta in manifest.items():
            if rel not in present:
                return f"missing file {rel}"
            if os.path.getsize(present[rel]) != meta["size"]:
                return f"size mismatch in {rel}"
        names = sorted(manifest)
        for rel, digest in zip(names, _hash_all(present[rel] for rel in names)):
            if digest != manifest[rel]["sha256"]:
                return f"checksum mismatch in {rel}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable manifest ({e})"
    if STATE not in manifest:
        return f"no {STATE} in the manifest"
    return None


def holds_checkpoint(folder: str) -> bool:
    """A ``step-N`` folder holds a checkpoint (or what is left of one): something a checkpoint save writes (its
    manifest, trainer state, RNG states, an engine's folder). A folder holding only a user's files is not one."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n in (MANIFEST, STATE) or n.startswith("rng-rank") or os.path.isdir(os.path.join(folder, n))
               for n in names)


def remove_checkpoint(folder: str) -> None:
    """Delete checkpoint ``folder``: the files its manifest lists and the manifest, then the folders left empty; a
    file the manifest does not list (a user's notes) stays, and so does the folder holding it. A checkpoint
    without a readable manifest (damaged) is deleted whole."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            listed = [rel for rel in json.load(f)]
    except (OSError, ValueError, TypeError):
        shutil.rmtree(folder, ignore_errors=True)
        return
    for rel in listed + [MANIFEST]:
        path = os.path.join(folder, rel)
        if os.path.normpath(rel).split(os.sep)[0] != os.pardir and (os.path.isfile(path) or os.path.islink(path)):
            os.remove(path)
    for root, dirs, files in os.walk(folder, topdown=False):
        if not os.listdir(root):
            os.rmdir(root)


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return obj


# --------------------------------------------------------------------------- manager

# Classes DeepSpeed's own checkpoint files import (ZeRO 1-3, fp32/fp16/bf16), found by scanning real ones;
# unpickling these builds plain records, it runs nothing.
DEEPSPEED_PICKLE_GLOBALS = frozenset((
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address"))


def check_pickles(folder: str) -> None:
    """Refuse a checkpoint whose ``.pt`` files would import anything beyond tensors, plain data and
    :data:`DEEPSPEED_PICKLE_GLOBALS` when unpickled (DeepSpeed loads them with ``weights_only=False``, so a
    planted ``os.system`` would run). Reads only each file's pickle, not its tensors. ``--trust_checkpoint``
    skips it."""
    import glob

    for path in sorted(glob.glob(os.path.join(folder, "**", "*.pt"), recursive=True)):
        try:
            found = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception as e:  # noqa: BLE001 - not a zip checkpoint torch can scan: not one we wrote
            raise UserInputError(f"checkpoint file {path} cannot be checked before loading ({type(e).__name__}); "
                                 "delete the checkpoint, start afresh with --overwrite, or pass --trust_checkpoint "
                                 "if you made it yourself") from None
        unsafe = sorted(found - DEEPSPEED_PICKLE_GLOBALS)
        if unsafe:
            raise UserInputError(f"checkpoint file {path} would import {', '.join(unsafe)} when loaded, which can "
                                 "run code; not resuming from it. Delete the checkpoint or start afresh with "
                                 "--overwrite; pass --trust_checkpoint only if you made it yourself")


def run_inputs(data=None, **models) -> dict:
    """What a resumed run must find unchanged beyond its flags, for :meth:`CheckpointManager.from_args`:
    ``data`` (a :class:`~utils.data.data_utils.PromptDataset`: its cache key covers the data files' content,
    the split, the tokenizer ...) and each model flag's folder (``actor_model_name_or_path=path``: its files'
    content, :func:`~utils.files.model_fingerprint`). Keys read ``"content of --flag"``."""
    from utils.files import model_fingerprint
    from utils.model.tiny import resolve_model_path

    inputs = {}
    if data is not None and getattr(data, "cache_key", None):
        inputs["content of --data_path"] = data.cache_key
    for flag, path in models.items():
        if path:
            inputs[f"content of --{flag}"] = model_fingerprint(resolve_model_path(path))
    return inputs


class CheckpointManager:
    """Save / find / load resumable checkpoints of several DeepSpeed engines under ``<output_dir>/checkpoints``."""

    def __init__(self, output_dir: str, max_checkpoints: int = 2, log: Callable[[str], None] = print,
                 save_interval: int = 0, require_resume: bool = False, config: Optional[dict] = None,
                 warn: Optional[Callable[[str], None]] = None, folder=None):
        self.root = os.path.join(output_dir, "checkpoints")
        self.folder = folder  # the run's utils.run_folder.RunFolder: told of each step, checkpoint and resume
        self.max_checkpoints = max(1, max_checkpoints)
        self.log = log
        self.warn = warn or (lambda msg: log(f"warning: {msg}"))
        self.save_interval = save_interval
        self.require_resume = require_resume
        self.trust_checkpoint = False  # --trust_checkpoint: load without check_pickles
        self.config = dict(config or {})
        self.metrics = None  # a TrainLogger whose metrics.jsonl follows the resumed step (from_args)

    @classmethod
    def from_args(cls, args, log, inputs: Optional[dict] = None, folder=None) -> "CheckpointManager":
        """From ``--output_dir``, ``--save_interval``, ``--max_checkpoints``, ``--resume``; ``folder``: the run's
        :class:`~utils.run_folder.RunFolder` (what :func:`utils.preflight.preflight` returned).

        ``log``: a :class:`~utils.logger.TrainLogger` (its ``metrics.jsonl`` is trimmed to
        the resumed step). Every argument but :data:`RUN_ONLY_FLAGS` must be equal in the
        interrupted and the resumed run (and the world size), and so must ``inputs``
        (:func:`run_inputs`: what the data and model folders hold, not only their names).
        """
        config = {key: value for key, value in sorted(vars(args).items()) if key not in RUN_ONLY_FLAGS}
        config["world_size"] = get_world_size()
        config.update(inputs or {})
        manager = cls(args.output_dir, args.max_checkpoints, log.info, save_interval=args.save_interval,
                      require_resume=args.resume, config=config, warn=log.warning, folder=folder)
        manager.metrics = log
        manager.trust_checkpoint = getattr(args, "trust_checkpoint", False)
        return manager

    # ------------------------------------------------------------------ listing

    def checkpoints(self):
        """Checkpoint folders (complete by construction, maybe corrupted since), newest first."""
        if not os.path.isdir(self.root):
            return []
        names = sorted((n for n in os.listdir(self.root) if _NAME.match(n)), reverse=True)
        return [os.path.join(self.root, n) for n in names if holds_checkpoint(os.path.join(self.root, n))]

    def find_valid(self) -> Optional[str]:
        """The newest checkpoint whose files match its manifest (rank 0 decides, every rank gets the answer).

        Corrupt ones are reported and renamed ``step-N.corrupt`` (out of the rotation).
        """
        path = None
        if is_rank_0():
            for candidate in self.checkpoints():
                problem = verify_manifest(candidate)
                if problem is None:
                    path = candidate
                    break
                self.warn(f"checkpoint {candidate} is unusable ({problem}); moved to "
                         f"{os.path.basename(candidate)}.corrupt, falling back to an older checkpoint")
                shutil.rmtree(candidate + ".corrupt", ignore_errors=True)
                os.replace(candidate, candidate + ".corrupt")
        return _broadcast(path)

    # ------------------------------------------------------------------ save

    def save(self, step: int, engines: Dict[str, object], trainer_state: dict) -> str:
        """Collective: every rank calls it. Returns the final checkpoint folder.

        A failed write (disk full, read-only folder) removes the partial folder and raises
        :class:`UserInputError`; the previous checkpoints are untouched.
        """
        name = f"step-{step:08d}"
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".tmp-{name}")
        try:
            if is_rank_0():
                os.makedirs(self.root, exist_ok=True)
                for stale in os.listdir(self.root):  # left by a run killed while saving
                    if stale.startswith(".tmp-"):
                        shutil.rmtree(os.path.join(self.root, stale), ignore_errors=True)
                os.makedirs(tmp)
            barrier()
            for engine_name, engine in engines.items():
                engine.save_checkpoint(os.path.join(tmp, engine_name), tag="state", save_latest=False)
            torch.save(rng_state(), os.path.join(tmp, f"rng-rank{get_rank()}.pt"))
            if is_rank_0():
                torch.save(dict(trainer_state, step=step, config=self.config), os.path.join(tmp, STATE))
            barrier()
            if is_rank_0():
                write_manifest(tmp)
                if holds_checkpoint(final):
                    remove_checkpoint(final)
                if os.path.isdir(final):  # it holds a user's files, which stay: the new files are moved in
                    for name in sorted(os.listdir(tmp), key=lambda n: n == MANIFEST):  # the manifest last
                        os.replace(os.path.join(tmp, name), os.path.join(final, name))
                    os.rmdir(tmp)
                else:
                    os.replace(tmp, final)
                atomic_write_text(os.path.join(self.root, "latest"), name + "\n")  # fsyncs the root: both renames
                for old in self.checkpoints()[self.max_checkpoints:]:
                    remove_checkpoint(old)
        except BaseException as e:
            if is_rank_0():
                shutil.rmtree(tmp, ignore_errors=True)
            if not is_write_failure(e):
                raise
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise UserInputError(f"cannot write checkpoint {final}: {reason} (disk full, quota or read-only file "
                                 "system?); the previous checkpoints are kept") from e
        barrier()
        return final

    def step_done(self, step: int, engines: Dict[str, object], trainer_state: Callable[[], dict]) -> None:
        """After optimizer step ``step`` (whose loss/reward passed ``check_finite``): save every
        ``--save_interval`` steps, then the test hook (``utils.fault_injection.kill_point``). The run's folder hears
        of both (the first step settles ``--overwrite``; the Ctrl-C message says where the run stood)."""
        if self.folder is not None:
            self.folder.step_done(step)
        if self.save_interval > 0 and step % self.save_interval == 0:
            start = time.time()
            path = self.save(step, engines, trainer_state())
            if self.folder is not None:
                self.folder.checkpoint_saved(step, self.root, path, os.path.join(self.root, "latest"))
            self.log(f"saved checkpoint {path} ({time.time() - start:.2f}s)")
        fault_injection.kill_point(step)

    # ------------------------------------------------------------------ load

    def _check_config(self, path: str, saved: dict) -> None:
        """Keys the checkpoint did not record (older checkpoints recorded fewer) are not compared."""
        diffs = [f"{key}: checkpoint {saved[key]!r}, now {value!r}"
                 for key, value in self.config.items() if key in saved and saved[key] != value]
        if diffs:
            flags = ", ".join(f"--{d.split(':')[0]}" for d in diffs
                              if not d.startswith(("world_size", "content of ")))
            raise UserInputError(f"checkpoint {path} comes from a different run configuration ({'; '.join(diffs)}); "
                                 f"rerun with the same settings{f' ({flags} as before)' if flags else ''} to resume "
                                 "it, or start afresh with --overwrite (or a new --output_dir)")

    def load(self, engines: Dict[str, object], path: Optional[str] = None) -> Optional[dict]:
        """Load the newest valid checkpoint into ``engines`` (collective); returns the trainer state or None.
        DeepSpeed unpickles its files in full, so they are scanned first (:func:`check_pickles`)."""
        path = path or self.find_valid()
        if path is None:
            return None
        if not self.trust_checkpoint:
            check_pickles(path)
        try:
            state = torch.load(os.path.join(path, STATE), weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserInputError(f"checkpoint {path}: {STATE} holds more than tensors and plain data, which could "
                                 f"run code when loaded ({str(e).splitlines()[-1][:200]}); delete the checkpoint "
                                 "or start afresh with --overwrite") from None
        self._check_config(path, state.get("config", {}))
        for engine_name, engine in engines.items():
            load_path, _ = engine.load_checkpoint(os.path.join(path, engine_name), tag="state")
            if load_path is None:
                raise RuntimeError(f"DeepSpeed could not load {engine_name} from {path}")
        rng_file = os.path.join(path, f"rng-rank{get_rank()}.pt")
        if not os.path.isfile(rng_file):
            raise UserInputError(f"checkpoint {path} has no RNG state for rank {get_rank()} (saved with fewer ranks)")
        set_rng_state(torch.load(rng_file, weights_only=True))
        if self.folder is not None:
            self.folder.resumed(state["step"], self.root)
        self.log(f"resumed from {path} (step {state['step']})")
        return state

    def resume(self, engines: Dict[str, object]) -> Optional[dict]:
        """Automatic resume: the trainer state of the newest valid checkpoint, or None for a fresh start.

        ``--resume`` makes "no usable checkpoint" an error instead of a fresh start.
        """
        state = self.load(engines)
        if state is None and self.require_resume:
            raise UserInputError(f"--resume: no usable checkpoint in {self.root} (drop --resume to start a fresh run)")
        if self.metrics is not None:
            self.metrics.restart_metrics(state["step"] if state else None)
        return state
