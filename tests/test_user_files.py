"""Issue 57, "rules kept everywhere": a demanding user's files and folders against the output-folder rules.

* R1: nothing a run did not write is lost, moved or blocks loading, inside the run's sub-folders too (step 3's
  ``actor/``, ``checkpoints/`` and a checkpoint's ``step-N/``), and in an input model folder;
* R4: any folder a user would choose works as an output folder: a mount point (its own file system: nothing may be
  renamed across it), a symlink to a folder elsewhere.

Fast: the run folder's life cycle with fake saves (the real ``atomic_directory``) and fake engines, as in
``tests/test_run_folder.py``; a mount point is simulated by making every rename across its boundary fail with
EXDEV, as the kernel does."""
import errno
import os
import shutil

import pytest

from tests.test_run_folder import beside, save_model, snapshot, write
from utils.errors import UserInputError
from utils.run_folder import MANIFEST, RunFolder


class Engine:
    """A DeepSpeed engine's checkpoint calls, writing one small file."""

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        write(os.path.join(save_dir, tag, "engine_state"), b"engine state")

    def load_checkpoint(self, load_dir, tag):
        return load_dir, {}


def checkpoints(out, folder=None, keep=2):
    from utils.checkpoint import CheckpointManager

    return CheckpointManager(str(out), max_checkpoints=keep, log=lambda m: None, save_interval=1, folder=folder)


def step3_run(out, content=b"old weights", steps=1) -> None:
    """A finished step-3 run in ``out``: metrics, real checkpoints (CheckpointManager), critic/ then actor/."""
    folder = RunFolder(str(out), log=lambda m: None).claim()
    with folder:
        manager = checkpoints(out, folder)
        for step in range(1, steps + 1):
            write(os.path.join(out, "metrics.jsonl"), b'{"step": 1}\n')
            manager.step_done(step, {"actor": Engine()}, dict)
        folder.save_final([("actor", save_model(content)), ("critic", save_model(b"critic"))])


def overwrite(out, content=b"new weights", lines=None):
    """A whole --overwrite run of step 3 on ``out``."""
    folder = RunFolder(str(out), log=(lines.append if lines is not None else lambda m: None)).claim(overwrite=True)
    with folder:
        checkpoints(out, folder).step_done(1, {"actor": Engine()}, dict)
        folder.save_final([("actor", save_model(content)), ("critic", save_model(b"new critic"))])


# --------------------------------------------------------------------------- (a) R1: a user's file in actor/

def test_overwrite_keeps_a_users_file_inside_actor_and_checkpoints(tmp_path):
    """Issue case (a): the user's actor/my_notes.txt and checkpoints/my_notes.txt, in a finished step-3 folder,
    survive --overwrite byte for byte (before: deleted with the earlier run's actor/ and checkpoints/, unnamed);
    the earlier run's own files are set aside and deleted as before, and the message names the notes."""
    out = tmp_path / "grpo"
    step3_run(out)
    notes = {"actor/my_notes.txt": b"why this run is good\n", "checkpoints/my_notes.txt": b"step 1 was fine\n"}
    for name, data in notes.items():
        write(out / name, data)

    earlier = snapshot(out)
    with pytest.raises(UserInputError):  # a run that fails before its first step: every byte as it was
        with RunFolder(str(out), log=lambda m: None).claim(overwrite=True):
            raise UserInputError("refused after set-up")
    assert snapshot(out) == earlier

    lines = []
    overwrite(out, lines=lines)
    after = snapshot(out)
    assert {name: after.get(name) for name in notes} == notes
    assert after["actor/model.safetensors"] == b"new weights"
    assert "left in place: actor/my_notes.txt, checkpoints/my_notes.txt (no run wrote them)" in lines[0]
    assert beside(str(out)) == [".grpo.lock"] and RunFolder(str(out)).finished()
    # the new run's files are recorded as its own, the notes are not: a second --overwrite keeps them too
    overwrite(out, content=b"newer weights")
    after = snapshot(out)
    assert {name: after.get(name) for name in notes} == notes and after["actor/model.safetensors"] == b"newer weights"
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "my_notes.txt", "step-00000001"]


# --------------------------------------------------------------------------- (b) R1: a backup beside the weights

def model_copy(path):
    from utils.model.model_utils import resolve_model_name_or_path

    shutil.copytree(resolve_model_name_or_path("tiny-opt"), path)
    return path


def test_a_users_backup_beside_the_weights_does_not_block_loading(tmp_path):
    """Issue case (b): backup_of_old_model.bin (and a user's half-copied old.safetensors) beside the real weights:
    chat.py --path and step 1's --model_name_or_path loaded the folder's every *.bin / *.safetensors and refused it
    ("backup_of_old_model.bin cannot be read as PyTorch weights"); now only the files the loader reads are checked.
    The weights that are read are still checked."""
    from utils.preflight import check_causal_lm_path

    folder = model_copy(tmp_path / "model")
    write(folder / "backup_of_old_model.bin", b"\x00my backup\x00")
    write(folder / "old.safetensors", b"\x10\x00\x00\x00half a copy")
    for flag in ("--path", "--model_name_or_path"):
        assert check_causal_lm_path(flag, str(folder)) == str(folder)
    from utils.files import loaded_weight_files

    assert loaded_weight_files(str(folder)) == ["model.safetensors"]

    step3 = tmp_path / "step3"  # chat.py --path on a step-3 folder reads its actor/
    model_copy(step3 / "actor")
    write(step3 / "actor" / "backup_of_old_model.bin", b"\x00my backup\x00")
    from inference.chatbot import actor_folder

    check_causal_lm_path("--path", actor_folder(str(step3)))

    os.truncate(folder / "model.safetensors", 20)  # the weights it reads: still refused when damaged
    with pytest.raises(UserInputError, match="model.safetensors is damaged"):
        check_causal_lm_path("--path", str(folder))


def test_a_users_file_in_the_input_model_folder_does_not_block_resuming(tmp_path):
    """Own case (R1, "blocks loading"): an interrupted run resumes only when its input model is unchanged; a note or
    a backup the user puts into the model folder meanwhile changed its fingerprint, and the resume was refused
    ("comes from a different run configuration (content of --model_name_or_path ...)"). Only what loading the
    model reads identifies it now; a change of the weights still does."""
    from utils.files import model_fingerprint

    folder = model_copy(tmp_path / "model")
    before = model_fingerprint(str(folder))
    write(folder / "notes.txt", b"trained on the March data\n")
    write(folder / "backup_of_old_model.bin", b"\x00my backup\x00")
    assert model_fingerprint(str(folder)) == before
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    assert model_fingerprint(str(folder)) != before


# --------------------------------------------------------------------------- (c) R4: a mount point, a symlink

@pytest.fixture
def own_file_system(monkeypatch):
    """``own_file_system(path)``: ``path`` becomes a mount point: a rename from inside it to outside it (or back,
    or of the mount point itself) fails with EXDEV, as the kernel's does."""
    roots = []
    real_replace, real_rename = os.replace, os.rename

    def device(path):
        path = os.path.realpath(os.path.abspath(path))
        return next((root for root in roots if path == root or path.startswith(root + os.sep)), None)

    def guarded(real):
        def rename(src, dst, *args, **kwargs):
            if device(src) != device(dst) or os.path.realpath(os.path.abspath(src)) in roots:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
            return real(src, dst, *args, **kwargs)
        return rename

    monkeypatch.setattr(os, "replace", guarded(real_replace))
    monkeypatch.setattr(os, "rename", guarded(real_rename))

    def mount(path):
        os.makedirs(path, exist_ok=True)
        roots.append(os.path.realpath(path))
        return path
    return mount


def test_a_mount_point_works_as_output_folder(tmp_path, own_file_system):
    """Issue case (c): --output_dir on a mount point. The final save staged the model beside the folder, on the
    parent's file system, and failed renaming it across: "Invalid cross-device link (disk full, quota or
    read-only file system?)", after every training step, nothing saved. Now the save stages inside the folder."""
    out = own_file_system(tmp_path / "volume")
    folder = RunFolder(str(out), log=lambda m: None).claim()
    with folder:
        write(out / "metrics.jsonl", b'{"step": 1}\n')
        folder.step_done(1)
        folder.save_final([(None, save_model(b"weights"))])
    assert RunFolder(str(out)).finished() and (out / "model.safetensors").read_bytes() == b"weights"
    assert sorted(os.listdir(out)) == [MANIFEST, "config.json", "metrics.jsonl", "model.safetensors",
                                       "tokenizer.json"]
    assert beside(str(out)) == [".volume.lock"]


def test_overwrite_on_a_mount_point_sets_aside_inside_it(tmp_path, own_file_system):
    """Own case (R4): --overwrite on a mount point set the earlier run aside beside it (a rename across file
    systems) and was refused ("cannot move the earlier run's files aside ... Invalid cross-device link"). Now the
    earlier run waits inside the folder; a failure before the first step puts it back, a training step deletes it;
    the user's file stays; train.py's log beside the folder is moved in (copied across)."""
    out = own_file_system(tmp_path / "volume")
    step3_run(out)
    write(out / "tokenizer_notes.md", b"mine")
    earlier = snapshot(out)
    with pytest.raises(UserInputError):
        with RunFolder(str(out), log=lambda m: None).claim(overwrite=True):
            raise UserInputError("refused after set-up")
    assert snapshot(out) == earlier

    log = RunFolder(str(out)).step_log()
    write(log, b"the new run's log\n")
    before = RunFolder(str(out)).run_id()
    overwrite(out)
    assert RunFolder(str(out)).adopt_log(log, before, True) == str(out / "training.log")
    after = snapshot(out)
    assert after["tokenizer_notes.md"] == b"mine" and after["actor/model.safetensors"] == b"new weights"
    assert after["training.log"] == b"the new run's log\n"
    assert beside(str(out)) == [".volume.lock"] and not [n for n in os.listdir(out) if n.startswith(".")
                                                          and n != MANIFEST]


def test_a_symlinked_step3_folder_keeps_its_link_and_the_model_lands_where_it_points(tmp_path):
    """Issue case (c), a symlink, step 3 (saves into sub-folders): --output_dir LINK -> /other/volume/run. Kept
    before this issue: the link stays a link, the models are in its target, --overwrite through it keeps the user's
    file. (Steps 1 and 2, which replace the folder itself, did not: the next test.)"""
    target = tmp_path / "volume" / "run"
    target.mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    step3_run(link)
    write(link / "tokenizer_notes.md", b"mine")
    assert link.is_symlink() and (target / "actor" / "model.safetensors").read_bytes() == b"old weights"
    assert RunFolder(str(link)).finished()
    with pytest.raises(UserInputError, match="already holds a finished run"):
        RunFolder(str(link)).claim()
    overwrite(link)
    assert link.is_symlink() and (target / "actor" / "model.safetensors").read_bytes() == b"new weights"
    assert (target / "tokenizer_notes.md").read_bytes() == b"mine"


def test_a_symlinked_step1_folder_is_saved_through_the_link(tmp_path):
    """Issue case (c), a symlink, steps 1 and 2 (the final save replaces the output folder itself): the save
    renamed LINK itself away and put a new folder in its place: the link was gone, the user's folder it pointed to
    emptied, the model on the link's file system instead. Now the save goes through the link."""
    target = tmp_path / "volume" / "run"
    target.mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    with RunFolder(str(link), log=lambda m: None).claim() as folder:
        folder.step_done(1)
        folder.save_final([(None, save_model(b"weights"))])
    assert link.is_symlink() and (target / "model.safetensors").read_bytes() == b"weights"
    assert RunFolder(str(link)).finished() and (target / MANIFEST).is_file()


# --------------------------------------------------------------------------- own cases: checkpoints

def test_a_users_file_in_a_checkpoint_folder_survives_rotation_and_resume(tmp_path):
    """Own case (R1): a user's note inside checkpoints/step-00000001/ was deleted with the checkpoint when the
    rotation (--max_checkpoints) removed it. Now the rotation deletes the files the checkpoint's manifest lists;
    the note stays, in its folder, and the folder left with it is not taken for a (corrupt) checkpoint on resume."""
    out = tmp_path / "out"
    manager = checkpoints(out, keep=1)
    manager.save(1, {"actor": Engine()}, {})
    write(out / "checkpoints" / "step-00000001" / "my_notes.txt", b"loss spiked here\n")
    manager.save(2, {"actor": Engine()}, {})
    assert os.listdir(out / "checkpoints" / "step-00000001") == ["my_notes.txt"]
    warnings = []
    again = checkpoints(out, keep=1)
    again.warn = warnings.append
    assert again.find_valid() == str(out / "checkpoints" / "step-00000002") and warnings == []
    assert again.resume({"actor": Engine()})["step"] == 2
    assert (out / "checkpoints" / "step-00000001" / "my_notes.txt").read_bytes() == b"loss spiked here\n"


def test_a_users_file_in_a_checkpoint_folder_survives_overwrite_and_the_new_runs_checkpoint(tmp_path):
    """Own case (R1): a note inside the earlier run's checkpoints/step-00000001/ across --overwrite: it stays in
    place (not deleted with the earlier run's checkpoints, not renamed to step-00000001.corrupt by the new run's
    resume, not deleted when the new run saves its own step-1 checkpoint there)."""
    out = tmp_path / "out"
    step3_run(out)
    note = out / "checkpoints" / "step-00000001" / "my_notes.txt"
    write(note, b"loss spiked here\n")
    with RunFolder(str(out), log=lambda m: None).claim(overwrite=True) as folder:
        manager = checkpoints(out, folder)
        assert manager.resume({"actor": Engine()}) is None  # the earlier run's checkpoint is gone: a fresh start
        manager.step_done(1, {"actor": Engine()}, dict)
        folder.save_final([("actor", save_model(b"new")), ("critic", save_model(b"new critic"))])
    assert note.read_bytes() == b"loss spiked here\n"
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-00000001"]
    assert checkpoints(out).find_valid() == str(out / "checkpoints" / "step-00000001")


# --------------------------------------------------------------------------- cases that already kept the rules

def test_an_output_dir_that_is_a_file_is_refused_before_training(tmp_path):
    """R4, kept before this issue: an existing regular file as --output_dir is refused up front, untouched."""
    from utils.preflight import check_output_dir_writable

    path = tmp_path / "results.txt"
    write(path, b"mine")
    with pytest.raises(UserInputError, match="exists and is not a folder"):
        check_output_dir_writable(str(path))
    assert path.read_bytes() == b"mine"


def test_a_users_subfolder_beside_the_model_survives_overwrite(tmp_path):
    """R1, kept before this issue: a user's folder in the run folder's root (beside a steps-1/2 model) is not the
    run's, so --overwrite leaves it."""
    out = tmp_path / "out"
    with RunFolder(str(out), log=lambda m: None).claim() as folder:
        folder.step_done(1)
        folder.save_final([(None, save_model(b"weights"))])
    write(out / "eval" / "answers.jsonl", b"{}\n")
    with RunFolder(str(out), log=lambda m: None).claim(overwrite=True) as folder:
        folder.step_done(1)
        folder.save_final([(None, save_model(b"new"))])
    assert (out / "eval" / "answers.jsonl").read_bytes() == b"{}\n"
