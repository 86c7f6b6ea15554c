"""Build locks (README, reliability rule 7: no hang on a build lock a killed compile left): the stale-lock sweep
looks wherever torch builds (``$TORCH_EXTENSIONS_DIR`` honoured), keeps a lock whose owner is alive however old, and a
build waiting on a lock takes it over once its owner dies. The sweep against a killed compile: tests/test_reruns.py."""
import os
import subprocess
import sys
import threading
import time

import pytest


# --------------------------------------------------------------------------- the sweep and the waiting build

def _aged_lock(folder, age):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").write_text("")
    os.utime(folder / "lock", (time.time() - age, time.time() - age))
    return folder / "lock"


def test_the_extensions_root_is_torchs_own_and_honours_torch_extensions_dir(tmp_path, monkeypatch):
    """Where torch would build an op (its private _get_build_directory, asked in a throw-away root) is where the
    stale-lock sweep looks: $TORCH_EXTENSIONS_DIR when set, not only ~/.cache/torch_extensions."""
    from torch.utils import cpp_extension

    from utils.distributed import clear_stale_extension_locks, torch_extensions_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert torch_extensions_root() == str(tmp_path / "ext")
    assert os.path.dirname(cpp_extension._get_build_directory("probe_op", False)) == torch_extensions_root()
    stale = _aged_lock(tmp_path / "ext" / "deepspeed_shm_comm", 600)
    lines = []
    assert clear_stale_extension_locks(log=lines.append) == [str(stale)] and not stale.exists()
    assert lines == [f"removed a stale build lock {stale} (a compile killed before it finished)"]
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert torch_extensions_root() == cpp_extension.get_default_build_root()


def _hold_open(path):
    """A process that owns ``path`` as torch's FileBaton does (a descriptor open on it), until killed."""
    code = "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); print('held', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_lock_whose_owner_is_alive_is_kept_however_old(tmp_path):
    from utils.distributed import clear_stale_extension_locks

    lock = _aged_lock(tmp_path / "py311_cpu" / "cpu_adam", 3600)
    owner = _hold_open(lock)
    try:
        assert clear_stale_extension_locks(str(tmp_path)) == [] and lock.exists()
    finally:
        owner.kill()
        owner.wait()
    assert clear_stale_extension_locks(str(tmp_path), log=lambda line: None) == [str(lock)]


@pytest.mark.slow
def test_a_build_waiting_on_a_lock_takes_it_over_when_its_owner_dies(tmp_path, monkeypatch):
    """torch's build waits (FileBaton.wait) while another process compiles the op; that process is killed. The
    waiting build must not wait forever: it removes the dead owner's lock and builds the op itself."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    from utils import distributed

    build_dir = tmp_path / "py311_cpu" / "some_op"
    built = []

    def fake_jit_compile(name, build_directory):  # torch's _jit_compile, reduced to its locking
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            try:
                built.append(name)
            finally:
                baton.release()
        else:
            baton.wait()
        return name

    monkeypatch.setattr(cpp_extension, "_jit_compile", fake_jit_compile)
    monkeypatch.setattr(FileBaton, "wait", FileBaton.wait)  # both restored after the test
    monkeypatch.setitem(distributed._GUARD, "installed", False)
    monkeypatch.setitem(distributed._GUARD, "check_every_s", 0.3)
    lines = []
    distributed.guard_build_locks(log=lines.append)
    lock = _aged_lock(build_dir, 0)
    owner = _hold_open(lock)  # a live compile: the build waits
    result = {}
    waiter = threading.Thread(target=lambda: result.update(out=cpp_extension._jit_compile("some_op", str(build_dir))))
    waiter.start()
    time.sleep(1.5)
    assert waiter.is_alive() and lock.exists() and built == []  # waiting, as it should, for a live owner
    owner.kill()
    owner.wait()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "still waiting on a dead owner's lock"
    assert result["out"] == "some_op" and built == ["some_op"] and not lock.exists()
    assert lines == [f"removed a stale build lock {lock} (its compile died while this run waited)"]
