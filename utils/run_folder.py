"""One owner for a step's output folder: :class:`RunFolder`.

Every question about an output folder is answered here, and only here: where its model lives, what this project
wrote there, whether the run in it finished, who may write it (the lock), what a killed save left, what
``--overwrite`` moves and deletes, the order of the final saves, and where a run stood when it was interrupted.
The entry points (through :func:`utils.preflight.preflight`), ``train.py``, the held-out check
(:mod:`utils.heldout`) and chat (:mod:`inference.chatbot`) ask a :class:`RunFolder`; no other module knows the
names below (``tests/test_run_folder.py`` checks that).

Layout of ``--output_dir PARENT/NAME``::

    PARENT/NAME/.dschat-run.json   the manifest: every entry of NAME a run of this project wrote, and whether
                                   the run finished (written by the run, rank 0; JSON)
    PARENT/NAME/...                the run's entries: the model (steps 1, 2, DPO), actor/ critic/ actor_ema/
                                   (step 3), checkpoints/, metrics.jsonl, train.py's training.log
    PARENT/.NAME.lock              the lock: an flock the system drops when its process ends (beside the folder,
                                   because saving a model replaces the folder)
    PARENT/.NAME.replaced/         --overwrite: the earlier run's entries, until the new run's first training
                                   step or good end (then deleted) or its failure (then put back)
    NAME/.NAME.replaced/           the same, for a folder that is its own file system (a mount point: nothing
                                   can be renamed beside it); a symlinked NAME: all of this beside its target
    PARENT/.NAME.tmp-* .NAME.old-* a save in progress (:func:`utils.files.atomic_directory`), or what a kill left
    PARENT/.NAME.training.log      train.py's log of a step on a folder that already holds an earlier run's
                                   entries, until the step takes the folder (it then becomes NAME/training.log)

What is "ours": the entries the manifest lists (and, inside a listed folder such as ``actor/`` or ``checkpoints/``,
the files its ``files`` lists: a user's ``actor/my_notes.txt`` stays where it is through ``--overwrite``) (each run adds what it writes: new entries, and entries a save
replaced). A folder without a manifest (written by an older version of this project, or by no run at all) has
only :data:`LEGACY_ENTRIES` (exact names: the files a run used to write) as ours, and ``--overwrite`` on it is
refused, nothing touched, while it also holds anything else. Entries that are not ours (a user's
``tokenizer_notes.md``) are never moved or deleted. ``--overwrite`` sets aside every entry of ours but
``training.log``, which train.py replaces once the new run has taken the folder (a step run by hand leaves it).
A run that fails before its first training step removes the entries it added, puts back what it set aside and
the manifest's run as it was: the folder is as it was, byte for byte.

"Finished": the folder holds a model (:meth:`RunFolder.model_dir`: ``config.json`` and weights, in the folder or
its ``actor/``) and the manifest says the run ended its final save (a folder without a manifest: the model alone).

The life of a run (rank 0 owns the folder; the other ranks' objects only follow the progress)::

    folder = RunFolder(args.output_dir)
    folder.claim(overwrite)     # lock, clean what a kill left, refuse a finished run, set the earlier run aside
    with folder:                # a failure before the first step puts the folder back as it was
        ...
        folder.step_done(step)  # (via CheckpointManager) first step: the earlier run's entries are deleted
        folder.save_final([...])  # the models in order, the one that marks a finished run last; then finished

Pure module: standard library and :mod:`utils.files` only.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from utils import fault_injection
from utils.errors import RunInterrupted, UserInputError
from utils.files import TEMPORARY_TAGS, atomic_write_text, renames_into

MANIFEST = ".dschat-run.json"
MANIFEST_FORMAT = "dschat-run"
RUN_LOG = "training.log"  # train.py's copy of a step's console output
MODEL_SUBFOLDER = "actor"  # step 3 keeps its actor (the model that marks a finished run) here
WEIGHT_ENDINGS = (".safetensors", ".bin", ".index.json")
# What runs of the versions before the manifest wrote into an output folder: exact names (no patterns, so a
# user's tokenizer_notes.md or my_experiment.model is never taken for ours), plus sharded weights.
LEGACY_ENTRIES = frozenset((
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json", "training_format.json", "reward_model.json", "metrics.jsonl", "checkpoints", "actor",
    "critic", "actor_ema", "ds_tensorboard_logs", RUN_LOG))
# What a run writes into its folder while it trains, under fixed names: TrainLogger's metrics, CheckpointManager's
# default root, tensorboard's folder when --tensorboard_path is the output folder. Everything else is ours only when
# a writer names it (RunFolder.will_write, a checkpoint root) or a final save made it (RunFolder.save_final).
RUN_ENTRIES = frozenset(("metrics.jsonl", "checkpoints", "ds_tensorboard_logs"))
LEGACY_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")

Stamp = Tuple[int, int]  # (device, inode) of an entry: a save replaces it, a move keeps it


def _stamps(folder: str) -> Dict[str, Stamp]:
    """``{name: (device, inode)}`` of ``folder``'s entries (empty when it does not exist)."""
    if not os.path.isdir(folder):
        return {}
    found = {}
    for name in os.listdir(folder):
        try:
            st = os.lstat(os.path.join(folder, name))
        except FileNotFoundError:
            continue
        found[name] = (st.st_dev, st.st_ino)
    return found


def _tree(folder: str) -> Dict[str, Stamp]:
    """``{relative path: stamp}`` of every file (and symlink) under ``folder``, not following symlinks."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            found[os.path.relpath(path, folder)] = (st.st_dev, st.st_ino)
    return found


def _remove(path: str) -> None:
    """Delete a folder (its tree, not a symlink's target) or a file."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _move_listed(source: str, dest: str, listed: set) -> List[str]:
    """Move folder ``source`` to ``dest``, but for what ``listed`` (paths relative to ``source``: the files a run
    wrote there) does not name: a user's files stay where they are, with the folders that hold them. Returns the
    files left (relative paths)."""
    users = sorted(rel for rel in _tree(source) if rel not in listed)
    if not users:
        os.replace(source, dest)
        return []
    holding = set()  # the folders that hold a user's file
    for rel in users:
        rel = os.path.dirname(rel)
        while rel:
            holding.add(rel)
            rel = os.path.dirname(rel)

    def move(rel_dir: str) -> None:
        os.makedirs(os.path.join(dest, rel_dir), exist_ok=True)
        for name in sorted(os.listdir(os.path.join(source, rel_dir))):
            rel = os.path.join(rel_dir, name) if rel_dir else name
            if rel in holding:
                move(rel)
            elif rel not in users:
                os.replace(os.path.join(source, rel), os.path.join(dest, rel))

    move("")
    return users


def _merge_back(source: str, dest: str) -> None:
    """Move every entry of ``source`` into ``dest``: a folder into a folder of the same name entry by entry (it
    still holds what was left in place: a user's files), anything else replacing what has its name."""
    for name in sorted(os.listdir(source)):
        src, dst = os.path.join(source, name), os.path.join(dest, name)
        if os.path.isdir(src) and not os.path.islink(src) and os.path.isdir(dst) and not os.path.islink(dst):
            _merge_back(src, dst)
            os.rmdir(src)
            continue
        if os.path.lexists(dst):
            _remove(dst)
        os.replace(src, dst)


def has_weights(folder: str) -> bool:
    """``folder`` holds a Hugging Face model: ``config.json`` and weights (or a sharded index)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return False
    return any(name.endswith(WEIGHT_ENDINGS) for name in os.listdir(folder))


class RunFolder:
    """A step's output folder (module docstring). ``path`` None: a run without an output folder (every method a
    no-op). ``owner``: this process moves, deletes and records (default: global rank 0, ``$RANK``)."""

    def __init__(self, path: Optional[str], log: Callable[[str], None] = print, owner: Optional[bool] = None):
        self.path = os.path.abspath(path) if path else None
        self.log = log
        self.owner = bool(self.path) and (int(os.environ.get("RANK", "0")) == 0 if owner is None else owner)
        self.step: Optional[int] = None  # the last optimizer step done (or resumed from)
        self.checkpoint: Optional[int] = None  # the step of the newest checkpoint on disk
        self.checkpoints: Optional[str] = None  # where the checkpoints are
        self._lock_file = None
        self._claimed = False
        self._at_claim: Optional[Dict[str, Stamp]] = None  # the folder's entries when the run took it
        self._earlier_run: Optional[str] = None  # the manifest's run before this one took the folder
        self._created = False  # the run made the folder
        self._aside: List[str] = []  # entries set aside, not settled yet
        self._deleted: List[str] = []  # entries of the earlier run this run deleted (--overwrite, after step 1)
        self._stepped = False  # an optimizer step happened in this process
        self._named: set = set()  # entries this run's writers named (besides RUN_ENTRIES)
        self._files: Dict[str, set] = {}  # files this run wrote inside its folder entries: {entry: {relative path}}
        self._sealed_answer: Optional[bool] = None

    # ------------------------------------------------------------------ layout

    def _beside(self, suffix: str) -> str:
        """``PARENT/.NAME{suffix}`` beside the folder (beside a symlink's target: where the entries really are)."""
        real = os.path.realpath(self.path)
        return os.path.join(os.path.dirname(real), f".{os.path.basename(real)}{suffix}")

    def _within(self, suffix: str) -> str:
        """``NAME/.NAME{suffix}``: bookkeeping inside the folder, for a folder that is its own file system."""
        real = os.path.realpath(self.path)
        return os.path.join(real, f".{os.path.basename(real)}{suffix}")

    def _sealed(self) -> bool:
        """The folder's entries cannot be renamed beside it (a mount point: a dedicated volume, a bind mount):
        what ``--overwrite`` sets aside then stays inside it (:meth:`_aside_home`)."""
        if getattr(self, "_sealed_answer", None) is None:
            real = os.path.realpath(self.path)
            self._sealed_answer = os.path.isdir(real) and not renames_into(real, os.path.dirname(real))
        return self._sealed_answer

    def _aside_home(self, suffix: str) -> str:
        """Where a set-aside run (``suffix`` .replaced, or its doomed name) lives: beside the folder, or inside it
        when it is its own file system; an existing one is found where it is."""
        beside, within = self._beside(suffix), self._within(suffix)
        if os.path.lexists(within):
            return within
        if os.path.lexists(beside):
            return beside
        return within if self._sealed() else beside

    def _bookkeeping(self, name: str) -> bool:
        """An entry of the folder that is this module's (the manifest and its temporary, a set-aside run inside a
        folder that is its own file system, a save's temporaries), never a run's entry nor a user's."""
        base = f".{os.path.basename(os.path.realpath(self.path))}"
        return name in (MANIFEST, MANIFEST + ".tmp") or name.startswith(base) and (
            name[len(base):] == ".replaced" or any(tag in name[len(base):] for tag in TEMPORARY_TAGS))

    @property
    def aside_path(self) -> str:
        return self._aside_home(".replaced")

    @property
    def lock_path(self) -> str:
        return self._beside(".lock")

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.path, MANIFEST)

    def model_dir(self) -> Optional[str]:
        """The folder holding the model of this layout (the folder itself, or step 3's ``actor/``), or None."""
        if not self.path:
            return None
        for folder in (self.path, os.path.join(self.path, MODEL_SUBFOLDER)):
            if os.path.isdir(folder) and has_weights(folder):
                return folder
        return None

    def manifest(self) -> Optional[dict]:
        """The manifest, or None (no manifest, or one that cannot be read: then the folder is treated as an
        older version's)."""
        try:
            with open(self.manifest_path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        ok = isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT and isinstance(data.get("entries"), list)
        return data if ok else None

    def finished(self, model: bool = True) -> bool:
        """A finished run: a model, and (when there is a manifest) the final save completed. ``model`` False: a run
        whose result is not a model (the comparison collector's files): the manifest's word alone."""
        data = self.manifest()
        if not model:
            return bool(data and data.get("finished"))
        if self.model_dir() is None:
            return False
        return data is None or bool(data.get("finished"))

    def run_id(self) -> Optional[str]:
        """Which run the manifest belongs to (changes when a run takes the folder), or None."""
        return (self.manifest() or {}).get("run")

    def ours(self) -> Tuple[List[str], List[str]]:
        """``(ours, others)``: the folder's entries a run of this project wrote, and the rest (never touched)."""
        names = sorted(n for n in os.listdir(self.path) if not self._bookkeeping(n)) if os.path.isdir(self.path) \
            else []
        data = self.manifest()
        if data is not None:
            listed = set(data["entries"])
            return [n for n in names if n in listed], [n for n in names if n not in listed]
        legacy = [n for n in names if n in LEGACY_ENTRIES or LEGACY_SHARD.fullmatch(n)]
        return legacy, [n for n in names if n not in legacy]

    def movable(self) -> List[str]:
        """The entries ``--overwrite`` sets aside: ours but train.py's ``training.log``, which train.py replaces
        itself once the new run has taken the folder (:meth:`adopt_log`; it may be writing it right now)."""
        return [n for n in self.ours()[0] if n != RUN_LOG]

    # ------------------------------------------------------------------ lock

    def lock(self) -> None:
        """One output folder, one run: an exclusive ``flock`` on :attr:`lock_path`, held until :meth:`unlock` or
        the process ends (a crash or kill -9 releases it: no stale lock). Raises :class:`UserInputError` naming
        the process that holds it. A no-op when already held by this object."""
        import fcntl

        if not self.path or self._lock_file is not None:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            f = open(self.lock_path, "a+")
        except OSError as e:
            raise UserInputError(f"cannot write beside output folder {self.path} ({self.lock_path}): "
                                 f"{e.strerror}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise UserInputError(f"{self.path} is in use by another run (process {holder}); wait for it to end, stop "
                                 "it, or give another output folder") from None
        except OSError:  # a file system without flock (some network mounts): go on unlocked
            f.close()
            return
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._lock_file = f

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the file drops the flock
            self._lock_file = None

    # ------------------------------------------------------------------ what kills leave

    def remove_stale_temporaries(self) -> List[str]:
        """Remove what saves killed mid-way left (:func:`~utils.files.atomic_directory`'s temporaries beside the
        folder and, for step 3's sub-folders, inside it; a half-deleted set-aside run); returns the paths.
        Call only while holding the lock: then no other run can be writing them."""
        real = os.path.realpath(self.path)
        parent, base = os.path.dirname(real), os.path.basename(real)
        found = [os.path.join(parent, n) for n in os.listdir(parent)
                 if any(n.startswith(f".{base}{tag}") for tag in TEMPORARY_TAGS)] if os.path.isdir(parent) else []
        if os.path.isdir(self.path):
            found += [os.path.join(self.path, n) for n in os.listdir(self.path)
                      if n.startswith(".") and any(tag in n[1:] for tag in TEMPORARY_TAGS)]
        for path in found:
            _remove(path)
        return sorted(found)

    def recover(self) -> None:
        """Put back what an ``--overwrite`` killed (SIGKILL) before its first step had set aside: the killed run's
        own entries go, the earlier run's come back."""
        if not os.path.isdir(self.aside_path):
            return
        if self.manifest() is not None:  # the killed run's entries, and its manifest
            for name in self.movable() + [MANIFEST]:
                _remove(os.path.join(self.path, name))
        moved = self._put_back()
        self.log(f"put back {', '.join(moved) or 'nothing'} into {self.path}: a run with --overwrite was killed "
                 "before its first training step")

    def _put_back(self) -> List[str]:
        """Move every entry of the set-aside folder back (replacing an entry of the same name); remove it."""
        os.makedirs(self.path, exist_ok=True)
        aside = self.aside_path
        moved = sorted(os.listdir(aside))
        _merge_back(aside, self.path)
        os.rmdir(aside)
        return [n for n in moved if n != MANIFEST]

    # ------------------------------------------------------------------ taking the folder

    def claim(self, overwrite: bool = False, changes: Callable[[], List[str]] = list) -> "RunFolder":
        """Take the folder for this run (rank 0; the other ranks only return): the lock, then what kills left,
        then the rerun rule (docs/outputs.md): a finished run is refused unless ``overwrite``, which sets the
        earlier run's entries aside. ``changes()``: the result flags changed since the finished run, for the
        refusal. Nothing in the folder is touched when it refuses. Returns ``self``."""
        if not self.owner:
            return self
        self.lock()
        try:
            for path in self.remove_stale_temporaries():
                self.log(f"removed {path}, left by a save that was killed")
            self.recover()
            self._check_rerun(overwrite, changes)
            self._created = not os.path.isdir(self.path)
            if overwrite:
                self._set_aside()
            self._start_manifest(keep=not overwrite)
        except BaseException:
            self._undo()
            self.unlock()
            raise
        self._claimed = True
        return self

    def _check_rerun(self, overwrite: bool, changes: Callable[[], List[str]]) -> None:
        """Refuse a finished run without ``overwrite``, and ``overwrite`` on a folder without a manifest that
        holds entries no run wrote (its other entries are then not known to be ours either)."""
        if self.finished() and not overwrite:
            changed = changes()
            raise UserInputError(f"--output_dir {self.path} already holds a finished run (its model is in "
                                 f"{self.model_dir()}{'; changed since: ' + ', '.join(changed) if changed else ''}); "
                                 "rerun with --overwrite to replace it (the old model, checkpoints and metrics.jsonl "
                                 "are deleted after the new run's first step), or give another --output_dir")
        ours, others = self.ours()
        if overwrite and others and self.movable() and self.manifest() is None:
            raise UserInputError(f"--overwrite: {self.path} has no record of what a run wrote there ({MANIFEST}: "
                                 f"a folder from an older version?) and also holds {', '.join(others[:5])}"
                                 f"{' …' if len(others) > 5 else ''}, which no training run writes; nothing was "
                                 f"touched: move those away, or delete the earlier run's {', '.join(ours[:5])}"
                                 f"{' …' if len(ours) > 5 else ''} yourself, or give another --output_dir")

    def _set_aside(self) -> None:
        """Move the earlier run's entries (and its manifest) into :attr:`aside_path`."""
        moving, others = self.movable(), self.ours()[1]
        if not moving:
            return
        listed = (self.manifest() or {}).get("files") or {}
        aside = self.aside_path
        try:
            os.makedirs(aside)
            # the manifest first: a kill half-way leaves a folder whose manifest (if any) is the new run's
            for name in ([MANIFEST] if os.path.exists(self.manifest_path) else []) + moving:
                self._aside.append(name)
                source = os.path.join(self.path, name)
                if name in listed and os.path.isdir(source) and not os.path.islink(source):
                    others += [os.path.join(name, rel) for rel in _move_listed(source, os.path.join(aside, name),
                                                                               set(listed[name]))]
                else:
                    os.replace(source, os.path.join(aside, name))
        except OSError as e:
            raise UserInputError(f"--overwrite: cannot move the earlier run's files aside in {self.path} "
                                 f"({e.strerror or e}); nothing was deleted") from None
        kept = f"; left in place: {', '.join(others)} (no run wrote them)" if others else ""
        self.log(f"--overwrite: set the earlier run's {', '.join(moving)} aside (in {self.aside_path}); they are "
                 f"deleted after this run's first training step, and put back if it fails before{kept}")

    def _start_manifest(self, keep: bool) -> None:
        """This run's manifest: the earlier entries of the run it continues (``keep``), none after --overwrite."""
        os.makedirs(self.path, exist_ok=True)
        self._at_claim, self._earlier_run = _stamps(self.path), self.run_id()
        entries = self._entries() if keep else []
        if keep and self.manifest() is None:  # an older version's unfinished run: its known entries are ours
            entries = self.ours()[0]
        self._write_manifest(entries, finished=False,
                             run=f"{os.getpid()}@{socket.gethostname()}:{time.time():.6f}")

    def _entries(self) -> List[str]:
        return (self.manifest() or {}).get("entries", [])

    def _write_manifest(self, entries: Iterable[str], **fields) -> None:
        data = self.manifest() or {}
        data.update(format=MANIFEST_FORMAT, version=1, **fields, entries=sorted(set(entries)))
        atomic_write_text(self.manifest_path, json.dumps(data, indent=1) + "\n")

    # ------------------------------------------------------------------ during the run

    def will_write(self, *paths: Optional[str]) -> None:
        """This run writes ``paths`` (the data cache, tensorboard's logs, a checkpoint root): the entries of the
        folder they lie in are the run's. Paths outside the folder are ignored."""
        for path in paths:
            if path and self.path:
                rel = os.path.relpath(os.path.abspath(path), self.path)
                if rel != os.curdir and rel.split(os.sep)[0] != os.pardir:
                    self._named.add(rel.split(os.sep)[0])

    def written(self) -> List[str]:
        """The entries this run wrote so far: those its writers name (:data:`RUN_ENTRIES`, :meth:`will_write`, the
        final saves), when new since it took the folder or replaced (a save renames a new entry into place). A file
        a user drops into the folder while the run goes on, or edits in place, stays theirs."""
        return sorted(n for n, stamp in _stamps(self.path).items()
                      if not self._bookkeeping(n) and (n in RUN_ENTRIES or n in self._named)
                      and ((self._at_claim or {}).get(n) != stamp or n in self._files))

    def _note_files(self, entry: str, rels: Iterable[str]) -> None:
        """This run wrote ``rels`` (relative to the folder's ``entry``), which is the run's."""
        self._named.add(entry)
        self._files.setdefault(entry, set()).update(rels)

    def _listing(self) -> Dict[str, List[str]]:
        """The manifest's files inside its entries, with this run's, less those gone (rotated checkpoints)."""
        listing = {name: set(rels) for name, rels in ((self.manifest() or {}).get("files") or {}).items()}
        for name, rels in self._files.items():
            listing.setdefault(name, set()).update(rels)
        return {name: sorted(rel for rel in rels if os.path.lexists(os.path.join(self.path, name, rel)))
                for name, rels in sorted(listing.items())}

    def record(self, *names: str) -> None:
        """Add what this run wrote (and ``names``) to the manifest; writes only when something is new."""
        if not (self.owner and self._claimed):
            return
        entries = set(self._entries()) | set(self.written()) | set(names)
        listing = self._listing()
        if entries != set(self._entries()) or listing != ((self.manifest() or {}).get("files") or {}):
            self._write_manifest(entries, files=listing)

    def step_done(self, step: int) -> None:
        """Optimizer step ``step`` is done: the run has proved it can run, so what ``--overwrite`` set aside is
        deleted now."""
        self.step, self._stepped = step, True
        self.commit()
        self.record()

    def checkpoint_saved(self, step: int, root: str, *written: str) -> None:
        """Checkpoint ``step`` was saved under ``root``; ``written``: the files and folders that save wrote (every
        file under them is the run's; a user's file elsewhere in ``root`` stays theirs)."""
        self.checkpoint, self.checkpoints = step, root
        self.will_write(root)
        if self.owner and self.path:
            for path in written:
                rel = os.path.relpath(os.path.abspath(path), self.path)
                if rel == os.curdir or rel.split(os.sep)[0] == os.pardir or os.sep not in rel:
                    continue
                entry, inner = rel.split(os.sep, 1)
                files = [os.path.join(inner, r) for r in _tree(path)] if os.path.isdir(path) else [inner]
                self._note_files(entry, files)
        self.record()

    def resumed(self, step: int, root: str) -> None:
        self.step = self.checkpoint = step
        self.checkpoints = root

    def commit(self) -> None:
        """Delete what ``--overwrite`` set aside (a no-op when nothing waits). Renamed to a stale-temporary name
        first, so a kill while deleting never lets a half-deleted earlier run be put back."""
        if not self._aside:
            return
        aside = self.aside_path
        real = os.path.realpath(self.path)
        doomed = os.path.join(os.path.dirname(aside), f".{os.path.basename(real)}{TEMPORARY_TAGS[1]}replaced")
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(aside, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        self._deleted, self._aside = [n for n in self._aside if n != MANIFEST], []
        self.log(f"--overwrite: deleted the earlier run's files ({', '.join(self._deleted)})")

    def restore(self) -> None:
        """The run failed before its first step: remove the entries it added, put back what it set aside, and
        remove the folder if the run made it and left nothing else there."""
        try:
            self._undo()
        except OSError as e:  # say where they are rather than lose them
            self.log(f"--overwrite: could not put the earlier run's files back into {self.path} ({e}); they are in "
                     f"{self.aside_path}")
            return

    def _undo(self) -> None:
        """Settle a run that failed before its first step (or a claim that failed half-way): see :meth:`restore`."""
        added = [n for n in self.written() + [MANIFEST] if n not in self._at_claim] if self._at_claim is not None \
            else []
        for name in added:
            if os.path.lexists(os.path.join(self.path, name)):
                _remove(os.path.join(self.path, name))
        if MANIFEST not in added and self._at_claim is not None and self.manifest() is not None:
            self._write_manifest(self._entries(), run=self._earlier_run)  # the run it was before
        if self._aside:
            self._aside = []
            moved = self._put_back()
            self.log(f"--overwrite: this run failed before its first step; put the earlier run's {', '.join(moved)} "
                     f"back into {self.path}")
        if self._created and os.path.isdir(self.path) and not os.listdir(self.path):
            os.rmdir(self.path)

    # ------------------------------------------------------------------ the end

    def save_final(self, saves: Sequence[Tuple[Optional[str], Callable[[str], None]]]) -> None:
        """Write the run's models, ``(sub-folder or None for the folder itself, writer(path))`` each, on every
        rank (a save is collective), then mark the run finished. The model that marks a finished run (the folder
        itself, or ``actor/``) is saved last, so that a kill between two saves leaves a folder that an older
        version too resumes rather than refuses. Each save is recorded as it lands."""
        marks = (None, MODEL_SUBFOLDER)
        ordered = [s for s in saves if s[0] not in marks] + [s for s in saves if s[0] in marks]
        for count, (name, save) in enumerate(ordered, start=1):
            target = os.path.join(self.path, name) if name else self.path
            before = _stamps(self.path) if self.owner else {}
            inner = set(_tree(target).values()) if self.owner and name else set()
            save(target)
            if self.owner:  # what this save made or replaced (a save of the folder moves the other entries across)
                changed = [n for n, stamp in _stamps(self.path).items()
                           if before.get(n) != stamp and not self._bookkeeping(n)]
                self._named.update(changed)
                if name:  # the files inside it this save wrote: not those it kept (a user's notes)
                    self._note_files(name.split(os.sep)[0], [rel for rel, stamp in _tree(target).items()
                                                            if stamp not in inner])
                for entry in changed:
                    path = os.path.join(self.path, entry)
                    if entry != name and os.path.isdir(path) and not os.path.islink(path):
                        self._note_files(entry, _tree(path))
            self.record()
            fault_injection.save_point(count)  # test hook: a kill between saves must leave a folder that resumes
        if self.owner and self._claimed:
            self._write_manifest(self._entries(), finished=True)

    def gone(self) -> str:
        """What ``--overwrite`` deleted in this run, for the message of a run that fails afterwards ('' if none)."""
        if not self._deleted:
            return ""
        return (f"the earlier run's {', '.join(self._deleted)} in {self.path} were deleted after this run's first "
                "training step (--overwrite) and are gone")

    def interrupt_message(self) -> str:
        """"interrupted at step N; rerun … to resume from step M" (or what a rerun does instead)."""
        where = "before the first training step" if self.step is None else f"at step {self.step}"
        if self.checkpoint:
            text = (f"interrupted {where}; rerun the same command to resume from step {self.checkpoint} (checkpoint "
                    f"in {self.checkpoints})")
        elif self.step is None:
            text = f"interrupted {where}; nothing was saved, a rerun starts afresh"
        else:
            text = (f"interrupted {where}; no checkpoint was saved (--save_interval N saves one every N steps), so a "
                    "rerun starts afresh")
        return f"{text}; {self.gone()}" if self.gone() else text

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        """A failure before the first step puts the folder back as it was (:meth:`restore`); after it, the
        failure's message says what ``--overwrite`` deleted. Ctrl-C becomes :class:`RunInterrupted` with
        :meth:`interrupt_message`. The lock is released."""
        try:
            failed = error is not None and not (isinstance(error, SystemExit) and not error.code)
            if failed and not self._stepped and self.owner and self._claimed:
                self.restore()
            elif self.owner and self._claimed:
                self.commit()  # ended well (a run without a training step included)
                self.record()
            if failed and self.gone() and not isinstance(error, KeyboardInterrupt):
                error.add_note(self.gone())
        finally:
            self.unlock()
        if isinstance(error, KeyboardInterrupt) and not isinstance(error, RunInterrupted):
            raise RunInterrupted(self.interrupt_message()) from None
        return False


    # ------------------------------------------------------------------ train.py's log of a step

    def step_log(self) -> str:
        """Where train.py writes a step's console output: ``training.log`` in the folder while the folder holds
        nothing (a first run: follow it there live), else beside it until the step has taken the folder
        (:meth:`adopt_log`), so that a refused rerun leaves the earlier run's log as it was."""
        if os.path.isdir(self.path) and os.listdir(self.path):
            return self._beside(f".{RUN_LOG}")
        os.makedirs(self.path, exist_ok=True)
        return os.path.join(self.path, RUN_LOG)

    def adopt_log(self, log_path: str, earlier_run: Optional[str], ended_well: bool) -> str:
        """After a step that train.py logged to ``log_path`` (:meth:`step_log`): when the step took the folder (it
        ended well, or the manifest's run is no longer ``earlier_run``), the log becomes the folder's
        ``training.log`` and is recorded as ours; else it stays beside. Returns where the log is now."""
        inside = os.path.join(self.path, RUN_LOG)
        took = ended_well or self.run_id() != earlier_run
        if log_path != inside and took and os.path.isdir(self.path):
            shutil.move(log_path, inside)  # a folder that is its own file system: copied across
            log_path = inside
        if log_path == inside and self.manifest() is not None and RUN_LOG not in self._entries():
            self._write_manifest(self._entries() + [RUN_LOG])
        return log_path
