"""Shared test fixtures: one built-in-model cache for the session, helpers to run entry points, and the rule that
keeps ``make test`` fast: a test that starts a fresh Python (an entry point, a launcher, ``python -c``) is marked
``slow`` (2 ranks: ``multiproc`` too), and so left to ``make test-slow``; the few end-to-end runs ``make test`` keeps
are marked ``smoke`` as well. An unmarked test that starts one fails (:func:`fresh_python_is_marked`)."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# Built-in tiny models are built once per machine and reused by every test and subprocess.
os.environ.setdefault("DSCHAT_HOME", str(REPO / ".cache" / "dschat"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def shared_data(*parts) -> Path:
    """A file under ../shared/data, or skip the test when ../shared is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (../shared is beside the repo in CI)")
    return path


def run_entry(script, *args, env=None, timeout=900, cwd=None):
    """Run ``python <script> args...`` from the repo root; returns the CompletedProcess (never raises)."""
    full_env = dict(os.environ)
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    full_env.pop("LOCAL_RANK", None)
    full_env.update(env or {})
    cmd = [sys.executable, str(REPO / script), *[str(a) for a in args]]
    return subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def entry():
    return run_entry


# --------------------------------------------------------------------------- a fresh Python is a marked test

FRESH_PYTHON_MARKS = ("slow", "multiproc")
_STARTED = {"test": None, "python": []}  # the test running now, the Python command lines it started


def _is_python(argv) -> bool:
    if isinstance(argv, (str, bytes, os.PathLike)):
        argv = shlex.split(os.fsdecode(argv))  # shell=True: the command's first word
    program = os.fsdecode(argv[0]) if argv else ""
    name = os.path.basename(program)
    return program == sys.executable or name.startswith("python") or name in ("deepspeed", "torchrun")


_execute_child = subprocess.Popen._execute_child


def _watched_execute_child(self, args, *rest, **kwargs):
    if _STARTED["test"] is not None and _is_python(args):
        _STARTED["python"].append([os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else [args])
    return _execute_child(self, args, *rest, **kwargs)


subprocess.Popen._execute_child = _watched_execute_child  # every Popen (subprocess.run too) of this test process


class _not_a_tests_process:
    """The session's own set-up (the shm op build) is no test's process."""

    def __enter__(self):
        self.test, _STARTED["test"] = _STARTED["test"], None

    def __exit__(self, *exc):
        _STARTED["test"] = self.test


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _STARTED["test"], _STARTED["python"] = item.nodeid, []  # before any fixture: a module fixture's runs count too


@pytest.fixture(autouse=True)
def fresh_python_is_marked(request):
    """Fails a test that started a fresh Python (itself or through a fixture it set up) without being marked
    ``slow``: ``make test`` leaves those out, so it stays fast."""
    yield
    started, _STARTED["test"] = _STARTED["python"], None
    if started and not any(request.node.get_closest_marker(mark) for mark in FRESH_PYTHON_MARKS):
        pytest.fail(f"{request.node.nodeid} starts a fresh Python ({' '.join(started[0])[:160]}) but is not marked "
                    "slow: add @pytest.mark.slow (and @pytest.mark.smoke to keep it in `make test`)", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built():
    """JIT-build DeepSpeed's CPU shm_comm op once, up front, with no resource limits.

    Every ``deepspeed.init_distributed`` on CPU loads it; the first load compiles it
    (~1-2 min) and holds a lock file meanwhile. Built here, before any test, so that no
    test pays for it inside its own time budget and a test that limits file sizes (the
    disk-full case) cannot kill the compiler and leave a stale lock that hangs every
    later run.
    """
    from utils.distributed import clear_stale_extension_locks

    clear_stale_extension_locks()  # a build killed in an earlier session would make this wait forever
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    with _not_a_tests_process():
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.exit("could not build DeepSpeed's shm_comm op:\n" + proc.stderr[-3000:], returncode=3)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_buffers():
    """Remove the DeepSpeed CPU all-reduce buffers (66 MB of RAM each, in /dev/shm) that runs killed
    on purpose (SIGKILL tests) could not unlink; clean runs unlink their own (utils.distributed)."""
    import glob

    pattern = "/dev/shm/deepspeed_allreduce_buffer_*"
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass


class Payload:
    """What an attacker plants in a file we load: unpickling it calls ``os.system`` to create ``marker``, so a
    test can assert that the file was refused before anything ran (the marker does not exist)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A real (untrained) step-2 folder of tiny-opt."""
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer

    folder = tmp_path_factory.mktemp("rm") / "reward"
    tokenizer = load_hf_tokenizer("tiny-opt")
    save_reward_model(create_critic_model("tiny-opt", tokenizer, None, 1), tokenizer, str(folder))
    return folder
