"""Writing output folders and files so that a crash never leaves a half-written one behind, and the fsync
helpers they (and the training checkpoints, :mod:`utils.checkpoint`) use."""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import tempfile

from utils.errors import UserInputError

# The name tags of atomic_directory's temporaries beside a folder: ``.NAME.tmp-*`` (the new content) and
# ``.NAME.old-*`` (the folder it replaces); a kill mid-save leaves them (utils.run_folder removes them).
TEMPORARY_TAGS = (".tmp-", ".old-")


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under ``path``."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` all or nothing: a fsynced temporary sibling renamed into place, and the rename
    itself made durable (the folder fsynced)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


# errno values of a write the machine refuses, not a bug: the disk or quota full, a file-size limit, a read-only
# file system
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
# what libraries raise instead of an OSError when the file system refuses a write: torch's zip writer
# (PytorchStreamWriter, inline_container.cc), torch's C++ ofstream ("basic_ios::clear: iostream error", e.g. a
# torch.save that hits a full disk), safetensors' "I/O error"
_WRAPPED_WRITE_FAILURES = ("PytorchStreamWriter failed", "inline_container", "basic_ios::clear", "iostream error",
                           "file write failed")


def is_write_failure(e: BaseException) -> bool:
    """Is ``e`` the file system refusing a write (disk full, quota, file-size limit, read-only)?

    An :class:`OSError` (inside a write, any: the caller knows it was writing), or the wrappers that torch's
    zip and stream writers and safetensors put around one.
    """
    if isinstance(e, OSError):
        return True
    text = str(e)
    if type(e).__name__ == "SafetensorError":
        return "I/O error" in text
    return isinstance(e, RuntimeError) and any(marker in text for marker in _WRAPPED_WRITE_FAILURES)


def machine_write_failure(e: BaseException) -> BaseException | None:
    """The disk-full-like failure behind ``e`` (itself, or its cause or context), or None: for code that may fail
    in other ways too (an entry point's last resort, :func:`utils.entrypoint.run_main`), so only an OSError whose
    errno is in :data:`DISK_ERRNOS`, or a library's wrapper of a failed write, counts."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS or not isinstance(e, OSError) and is_write_failure(e):
            return e
        e = e.__cause__ or e.__context__
    return None


def write_failure_reason(e: BaseException) -> str:
    """One short reason for a write failure: the OSError's text, or the first line of a library's message."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def machine_write_failure_line(e: BaseException) -> str | None:
    """The one line an entry point ends with when ``e`` is (or hides) a full disk or the like
    (:func:`machine_write_failure`), else None."""
    failure = machine_write_failure(e)
    if failure is None:
        return None
    path = getattr(failure, "filename", None)
    return (f"cannot write{f' {path}' if path else ''}: {write_failure_reason(failure)} (disk full, quota or "
            "read-only file system?)")


@contextlib.contextmanager
def writing(what: str, path: str):
    """Turn a write failure inside the block (a full disk, a read-only folder…) into one
    :class:`UserInputError` line naming ``what`` and ``path``, for writers that do not go through
    :func:`atomic_write` / :func:`atomic_directory`."""
    try:
        yield
    except UserInputError:
        raise
    except Exception as e:
        if not is_write_failure(e):
            raise
        raise UserInputError(f"cannot write {what} {path}: {write_failure_reason(e)} (disk full, quota or read-only "
                             "file system?)") from None


def atomic_write(path: str, write, what: str = "file") -> None:
    """``write(tmp)`` into ``<path>.tmp<pid>``, then rename it into place. On a failure the temporary file
    is removed (a full disk leaves nothing half-written behind) and a write failure becomes one
    :class:`UserInputError` line naming ``what`` and ``path``."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if is_write_failure(e):
            raise UserInputError(f"cannot write {what} {path}: {write_failure_reason(e)} (disk full, quota or "
                                 "read-only file system?)") from None
        raise


def renames_into(folder: str, other: str) -> bool:
    """Can an entry of ``folder`` be renamed into ``other``? Not across file systems (``folder`` a mount point: a
    dedicated volume, a bind mount) nor into a folder the process may not write. Probes with a file: created in
    ``folder``, renamed into ``other`` (under a temporary's name, :data:`TEMPORARY_TAGS`, so that a kill leaves
    nothing that is not cleaned up), removed. True when ``folder`` itself cannot be written (nothing to decide)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(folder)}{TEMPORARY_TAGS[0]}probe-", dir=folder)
        os.close(fd)
    except OSError:
        return True
    moved = os.path.join(other, os.path.basename(probe))
    try:
        os.replace(probe, moved)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(probe)
        return False
    with contextlib.suppress(OSError):
        os.remove(moved)
    return True


@contextlib.contextmanager
def atomic_directory(out_dir: str):
    """Write a folder atomically: yields a temporary folder, renames it into place on success.

    Entries of an existing ``out_dir`` that the new content does not replace (a
    ``training.log``, a tensorboard folder, sub-model folders, a user's notes) are kept.
    On an exception the temporary folder is removed and ``out_dir`` is untouched,
    so a crash never leaves a half-written model behind.

    A symlink ``out_dir`` is written through: its target is what is replaced (the link stays, the model lands on
    the file system the link points to). The temporary folder is a sibling ``.NAME.tmp-*`` that replaces the whole
    folder; where an existing ``out_dir`` cannot be renamed into its parent (a mount point: another file system,
    or a parent the process may not write) it is ``NAME/.NAME.tmp-*`` inside it instead, and the new entries are
    renamed into place one by one (the old ones in ``NAME/.NAME.old-*`` until then), so nothing ever crosses a
    file system.
    """
    out_dir = os.path.realpath(out_dir)
    parent, base = os.path.dirname(out_dir), os.path.basename(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        inside = os.path.isdir(out_dir) and not renames_into(out_dir, parent)
        tmp = tempfile.mkdtemp(prefix=f".{base}{TEMPORARY_TAGS[0]}", dir=out_dir if inside else parent)
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
        fsync_tree(tmp)
        if inside:
            old = tempfile.mkdtemp(prefix=f".{base}{TEMPORARY_TAGS[1]}", dir=out_dir)
            names = sorted(os.listdir(tmp))
            for name in names:
                if os.path.lexists(os.path.join(out_dir, name)):
                    os.replace(os.path.join(out_dir, name), os.path.join(old, name))
            for name in names:
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            os.rmdir(tmp)
            fsync_dir(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        elif os.path.isdir(out_dir):
            for name in os.listdir(out_dir):
                if not os.path.lexists(os.path.join(tmp, name)):
                    os.replace(os.path.join(out_dir, name), os.path.join(tmp, name))
            old = tempfile.mkdtemp(prefix=f".{base}{TEMPORARY_TAGS[1]}", dir=parent)
            os.replace(out_dir, os.path.join(old, "x"))
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):
            raise UserInputError(f"cannot write output folder {out_dir}: {write_failure_reason(e)} (disk full, "
                                 "quota or read-only file system?)") from e
        raise


def content_hash(source: str | os.PathLike | bytes, sample: int | None = None, digits: int | None = 16) -> str:
    """The project's one content hash: sha256, as hex cut to ``digits`` characters (None: all 64), of ``source``'s
    bytes: a file's (``source`` a path) or the bytes given (text: ``content_hash(text.encode())``).

    A file with ``sample``: of its size, first and last ``sample`` bytes only (for model weights of many GB: a
    different model differs there, and reading it all would take minutes). A file's hash is computed once per
    process while it is unchanged (same inode, size and change time: unlike the modification time, the change
    time cannot be set back)."""
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()[:digits]
    st = os.stat(source)
    return _file_hash(os.path.abspath(source), st.st_size, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns),
                      sample)[:digits]


@functools.lru_cache(maxsize=256)
def _file_hash(path: str, size: int, stamp: tuple, sample: int | None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if sample is None or size <= 2 * sample:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(str(size).encode())
            digest.update(f.read(sample))
            f.seek(size - sample)
            digest.update(f.read(sample))
    return digest.hexdigest()


SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_WEIGHTS, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def loaded_weight_files(folder: str) -> list:
    """The weight files of a local model folder that loading it reads, by transformers' rule (the first of
    ``model.safetensors``, ``model.safetensors.index.json``'s shards, ``pytorch_model.bin``,
    ``pytorch_model.bin.index.json``'s shards; the reward model's loader, :mod:`utils.model.critic`, reads the
    first and third too): names relative to ``folder``, the index itself included. Other files beside them (a
    user's ``backup_of_old_model.bin``) are never read, so never checked. Empty when there is none."""
    if not os.path.isdir(folder):
        return []
    for name in (SAFE_WEIGHTS, SAFE_INDEX, BIN_WEIGHTS, BIN_INDEX):
        if not os.path.isfile(os.path.join(folder, name)):
            continue
        if not name.endswith(".index.json"):
            return [name]
        try:
            with open(os.path.join(folder, name)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserInputError(f"{folder}: {name} cannot be read as a sharded weights index ({e}); copy or save "
                                 "the model again") from None
        return [name] + [s for s in shards if isinstance(s, str)]
    return []


MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja")


# ``.txt`` files a tokenizer reads; any other ``.txt`` in a model folder (a user's notes) is not part of the model
TOKENIZER_TEXT_FILES = ("vocab.txt", "merges.txt")


def model_fingerprint(name_or_path: str) -> str:
    """What identifies a model for resuming: a local folder by the content of the files loading it reads (weights
    sampled, :func:`content_hash`; only the weights files the loader picks, :func:`loaded_weight_files`:
    a user's ``backup_of_old_model.bin`` or ``notes.txt`` beside them is not the model, and hidden files such as a
    run's manifest are bookkeeping), anything else (a hub name) by its name."""
    if not os.path.isdir(name_or_path):
        return f"name:{name_or_path}"
    try:
        weights = set(loaded_weight_files(name_or_path))
    except UserInputError:  # an unreadable index: its bytes identify it
        weights = None

    def part_of_the_model(name: str) -> bool:
        if name.endswith((".safetensors", ".bin", ".index.json")) and weights is not None:
            return name in weights
        return not name.endswith(".txt") or name in TOKENIZER_TEXT_FILES

    parts = [f"{name}:{content_hash(os.path.join(name_or_path, name), sample=1 << 20)}"
             for name in sorted(os.listdir(name_or_path))
             if name.endswith(MODEL_FILE_SUFFIXES) and name not in ("metrics.jsonl", "training_format.json")
             and not name.startswith(".") and os.path.isfile(os.path.join(name_or_path, name))
             and part_of_the_model(name)]
    return ";".join(parts)
