"""Issue 57, rule 3, malformed files for every reader of a model folder: a damaged tokenizer.json,
tokenizer_config.json or config.json is one ``error:`` line naming the folder, never a traceback (before: a
``JSONDecodeError`` traceback from transformers or from our own model-type check)."""
import shutil

import pytest

from tests.conftest import run_entry
from utils.errors import UserInputError
from utils.model.model_utils import load_hf_tokenizer
from utils.model.tiny import resolve_model_path

DAMAGE = {  # file: (what is written, what the error names)
    "tokenizer.json": ('{"version": "1.0", "truncation": ', "its files in"),
    "tokenizer_config.json": ('{"bad": ', "its files in"),
    "config.json": ('{"model_type": "llama", "hidden', "config.json"),
}


@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny-llama"), folder)
    return folder


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_damaged_file_of_a_model_folder_is_a_user_error(model_folder, name):
    load_hf_tokenizer(str(model_folder))  # intact: loads
    text, fragment = DAMAGE[name]
    (model_folder / name).write_text(text)
    with pytest.raises(UserInputError, match=fragment) as info:
        load_hf_tokenizer(str(model_folder))
    assert str(model_folder) in str(info.value)


@pytest.mark.slow
def test_chat_on_a_folder_with_a_damaged_tokenizer_is_one_line(model_folder):
    (model_folder / "tokenizer.json").write_text(DAMAGE["tokenizer.json"][0])
    proc = run_entry("chat.py", "--path", model_folder, "--max_new_tokens", 2, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "error: cannot load a tokenizer for" in proc.stderr
