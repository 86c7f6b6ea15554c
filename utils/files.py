"""Writing output folders and files so that a crash never leaves a half-written one behind, and the fsync
helpers they (and the training checkpoints, :mod:`utils.checkpoint`) use."""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import tempfile

from utils.errors import UserInputError


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
        fsync_tree(tmp)
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
            raise UserInputError(f"cannot write output folder {out_dir}: {write_failure_reason(e)} (disk full, "
                                 "quota or read-only file system?)") from e
        raise


def content_hash(path: str, sample: int | None = None) -> str:
    """sha256 of a file's bytes (hex, 16 characters); with ``sample``, of its size, first and last ``sample``
    bytes only (for model weights of many GB: a different model differs there, and reading it all would take
    minutes). Computed once per process for an unchanged file (same inode, size and change time: unlike the
    modification time, the change time cannot be set back)."""
    st = os.stat(path)
    return _content_hash(os.path.abspath(path), st.st_size, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns), sample)


@functools.lru_cache(maxsize=256)
def _content_hash(path: str, size: int, stamp: tuple, sample: int | None) -> str:
    import hashlib

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
    return digest.hexdigest()[:16]


MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja")


def model_fingerprint(name_or_path: str) -> str:
    """What identifies a model for resuming: a local folder by its files' content (weights sampled,
    :func:`content_hash`), anything else (a hub name) by its name."""
    if not os.path.isdir(name_or_path):
        return f"name:{name_or_path}"
    parts = [f"{name}:{content_hash(os.path.join(name_or_path, name), sample=1 << 20)}"
             for name in sorted(os.listdir(name_or_path))
             if name.endswith(MODEL_FILE_SUFFIXES) and name not in ("metrics.jsonl", "training_format.json")
             and os.path.isfile(os.path.join(name_or_path, name))]
    return ";".join(parts)


_HELD_LOCKS: dict = {}  # path -> open file: a lock lives as long as its process (the kernel drops it at exit)


def lock_output_dir(out_dir: str) -> None:
    """One output folder, one run: an exclusive ``flock`` on ``.<name>.lock`` beside ``out_dir``, held until
    this process ends (a crash or kill -9 releases it: no stale lock). The lock sits beside the folder, not in
    it, because saving replaces the folder (:func:`atomic_directory`). Raises :class:`UserInputError` naming
    the process that holds it. A second call for the same folder in one process is a no-op."""
    import fcntl

    out_dir = os.path.abspath(out_dir)
    if out_dir in _HELD_LOCKS:
        return
    path = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.lock")
    try:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        raise UserInputError(f"cannot write beside output folder {out_dir} ({path}): {e.strerror}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise UserInputError(f"{out_dir} is in use by another run (process {holder}); wait for it to end, stop "
                             "it, or give another output folder") from None
    except OSError:  # a file system without flock (some network mounts): go on unlocked
        f.close()
        return
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} on {os.uname().nodename}\n")
    f.flush()
    _HELD_LOCKS[out_dir] = f


def remove_stale_temporaries(out_dir: str) -> list:
    """Remove what saves killed mid-way left (:func:`atomic_directory`'s ``.NAME.tmp-*`` and ``.NAME.old-*``)
    beside ``out_dir`` and, for step 3's sub-folders, inside it; returns the paths removed. Call only while
    holding :func:`lock_output_dir`: then no other run can be writing them."""
    import glob

    out_dir = os.path.abspath(out_dir)
    name = glob.escape(os.path.basename(out_dir))
    found = []
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        found += glob.glob(os.path.join(glob.escape(os.path.dirname(out_dir)), pattern))
    if os.path.isdir(out_dir):
        for pattern in (".*.tmp-*", ".*.old-*"):
            found += glob.glob(os.path.join(glob.escape(out_dir), pattern))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(found)
