"""No traceback from the machine's state (README, reliability rule 7): a full disk in every writer (torch's
``basic_ios::clear`` included) is one ``error:`` line, exit 2; Ctrl-C from the first second of every entry point and
of train.py is one line, exit 130, nothing written; a reader that goes away (``chat.py | head``) ends chat quietly,
exit 141."""
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from utils.errors import UserInputError


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


# --------------------------------------------------------------------------- a full disk

@pytest.mark.slow
def test_torchs_iostream_error_is_a_write_failure_and_any_writer_failing_so_is_one_line(tmp_path):
    """torch.save under a file-size limit (a full disk, as the file system sees it) raises what is_write_failure
    recognises, whatever the wrapper; machine_write_failure finds it behind a re-raise, and nothing else."""
    import errno

    from utils.files import is_write_failure, machine_write_failure

    code = ("import resource, torch\nfrom utils.files import is_write_failure\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))\n"
            "for target in (%r, open(%r, 'wb')):\n"
            "    try:\n        torch.save({'w': torch.zeros(1000000)}, target)\n"
            "    except Exception as e:\n        print(type(e).__name__, is_write_failure(e))\n"
            % (str(tmp_path / "a.pt"), str(tmp_path / "b.pt")))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=_env())
    lines = proc.stdout.split("\n")[:-1]
    assert len(lines) == 2 and all(line.endswith(" True") for line in lines), (proc.stdout, proc.stderr[-2000:])
    assert is_write_failure(RuntimeError("basic_ios::clear: iostream error"))
    full = OSError(errno.ENOSPC, "No space left on device", "/x/model.pt")
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("saving failed") from e
    except RuntimeError as wrapped:
        assert machine_write_failure(wrapped) is full
    assert machine_write_failure(FileNotFoundError(errno.ENOENT, "No such file")) is None
    assert machine_write_failure(ValueError("a bug")) is None
    assert machine_write_failure(RuntimeError("basic_ios::clear: iostream error")) is not None


@pytest.mark.slow
def test_run_main_turns_a_full_disk_anywhere_into_one_line(tmp_path):
    """A writer that does not go through atomic_write (a library's torch.save, say) hits a full disk: run_main's
    last resort says so in one line, exit 2."""
    script = tmp_path / "entry.py"
    script.write_text("from utils.entrypoint import run_main\n"
                      "def main(args):\n    raise RuntimeError('basic_ios::clear: iostream error')\n"
                      "def other(args):\n    raise OSError(28, 'No space left on device', '/out/metrics.jsonl')\n"
                      "import sys\nrun_main(main if sys.argv[1] == 'a' else other, None)\n")
    for which, expected in (("a", "error: cannot write: basic_ios::clear: iostream error (disk full"),
                            ("b", "error: cannot write /out/metrics.jsonl: No space left on device (disk full")):
        proc = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=_env())
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert [line for line in proc.stderr.splitlines() if line.strip()] == [
            line for line in proc.stderr.splitlines() if line.startswith(expected)], proc.stderr


def test_the_summary_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    import errno
    import json

    from utils import summary

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(UserInputError, match=r"cannot write the run's summary .*summary\.json: No space left on "
                                             r"device \(disk full"):
        summary.write_summary(str(tmp_path), {}, {})


# --------------------------------------------------------------------------- Ctrl-C from the first second

ENTRY_POINTS = {
    "step1": ["step1_supervised_finetuning/main.py", "--output_dir", "{dir}/out"],
    "step2": ["step2_reward_model_finetuning/main.py", "--output_dir", "{dir}/out"],
    "dpo": ["step2_dpo_finetuning/main.py", "--output_dir", "{dir}/out"],
    "step3": ["step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", "tiny-opt", "--output_dir", "{dir}/out"],
    "prompt_eval": ["step1_supervised_finetuning/prompt_eval.py", "--model_name_or_path_baseline", "tiny-opt",
                    "--model_name_or_path_finetune", "tiny-opt"],
    "rw_eval": ["step2_reward_model_finetuning/rw_eval.py", "--model_name_or_path", "{dir}/nowhere"],
    "collect_comparisons": ["step2_reward_model_finetuning/collect_comparisons.py", "--actor_model_name_or_path",
                            "tiny-opt", "--label_fn", "builtin_rule", "--output_dir", "{dir}/out"],
    "chat": ["chat.py", "--path", "tiny-opt"],
    "chatbot": ["inference/chatbot.py", "--path", "tiny-opt"],
}


def _mapped(pid, name):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_ctrl_c_while_an_entry_point_imports_is_one_line(name, tmp_path):
    """Ctrl-C while torch is being imported (before run_main: the first seconds of every command) used to be a
    KeyboardInterrupt traceback from inside an import."""
    import signal

    script, *args = ENTRY_POINTS[name]
    proc = subprocess.Popen([sys.executable, str(REPO / script), *[a.format(dir=tmp_path) for a in args]],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not _mapped(proc.pid, "libtorch") and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out[-1000:], err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == ["interrupted while starting; nothing was run or "
                                                                    "saved"], err[-3000:]
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.slow
def test_ctrl_c_while_train_py_starts_is_one_line(tmp_path):
    import signal

    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--demo", "--output-dir", str(tmp_path / "o")],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not _mapped(proc.pid, "libtorch") and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)  # train.py imports no torch itself: this is it checking the steps' flags, before step 1
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


@pytest.mark.slow
def test_a_reader_that_goes_away_ends_chat_quietly(tmp_path):
    """`chat.py | head -c 20`: the pipe closes while the assistant answers; a BrokenPipeError traceback was printed."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first answer is written
    proc = subprocess.run([sys.executable, str(REPO / "chat.py"), "--path", "tiny-opt", "--max_new_tokens", "8"],
                          cwd=tmp_path, env=_env(), input=b"hello there\nquit\n", stdout=write,
                          stderr=subprocess.PIPE, timeout=300)
    os.close(write)
    err = proc.stderr.decode()
    assert proc.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
