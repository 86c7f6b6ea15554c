"""inference/chatbot.py and chat.py: prompt format with history, clear/quit, scripting through a pipe."""
import io
import os
import shutil
import subprocess
import sys

import pytest
import torch

from inference.chatbot import Chatbot, actor_folder, chat
from tests.conftest import REPO
from utils.model.tiny import resolve_model_path


@pytest.fixture(scope="module")
def tiny_folder():
    return resolve_model_path("tiny-opt")  # an (untrained) HF folder built once per machine


@pytest.fixture(scope="module")
def bot(tiny_folder):
    return Chatbot(tiny_folder, max_new_tokens=16, device="cpu")


def scripted_generate(bot, answer_text, seen):
    """Replace ``model.generate``: record the prompt, 'generate' ``answer_text`` (+ EOS)."""
    answer_ids = bot.tokenizer(answer_text, add_special_tokens=False, return_tensors="pt").input_ids
    eos = torch.tensor([[bot.tokenizer.eos_token_id]])

    def generate(input_ids, attention_mask, **kwargs):
        seen.append(bot.tokenizer.decode(input_ids[0], skip_special_tokens=True))
        return torch.cat([input_ids, answer_ids, eos], dim=1)

    return generate


def test_history_accumulates_turns_and_clear_forgets(bot, monkeypatch):
    seen = []
    bot.clear()
    monkeypatch.setattr(bot.model, "generate", scripted_generate(bot, " The lamp is bright and kind.", seen))
    assert bot.reply("Describe the lamp.") == "The lamp is bright and kind."
    assert seen[-1] == " Human: Describe the lamp. Assistant:"
    bot.reply("And the river?")
    assert seen[-1] == " Human: Describe the lamp. Assistant: The lamp is bright and kind. Human: And the river? Assistant:"
    bot.clear()
    bot.reply("Hi")
    assert seen[-1] == " Human: Hi Assistant:"


def test_answer_is_cut_where_the_model_starts_the_next_turn(bot, monkeypatch):
    bot.clear()
    monkeypatch.setattr(bot.model, "generate", scripted_generate(bot, " The city is calm. Human: and", []))
    assert bot.reply("Tell me about the city.") == "The city is calm."
    assert bot.history == " Human: Tell me about the city. Assistant: The city is calm."


def test_oldest_turns_are_dropped_when_the_history_does_not_fit(bot, monkeypatch):
    seen = []
    bot.clear()
    monkeypatch.setattr(bot.model, "generate", scripted_generate(bot, " Fine.", seen))
    monkeypatch.setattr(bot, "max_positions", 16 + 24)  # 16 answer tokens + a 24-token prompt budget
    bot.history = " Human: " + "a long old question " * 10 + "Assistant: Fine."
    bot.reply("Describe the lamp.")
    assert seen[-1] == " Human: Describe the lamp. Assistant:"


def test_clear_and_quit_through_a_non_tty_stream(bot, monkeypatch, capsys):
    monkeypatch.setattr(bot, "reply", lambda text: f"echo {text}")
    chat(bot, io.StringIO("Describe the lamp.\n\nclear\nquit\nnever read\n"), interactive=False)
    assert capsys.readouterr().out.splitlines() == ["Assistant: echo Describe the lamp.", "[history cleared]"]


def test_step3_output_folder_resolves_to_its_actor(tmp_path, tiny_folder):
    shutil.copytree(tiny_folder, tmp_path / "step3" / "actor")
    assert actor_folder(str(tmp_path / "step3")) == str(tmp_path / "step3" / "actor")
    assert actor_folder(tiny_folder) == tiny_folder


@pytest.mark.slow
def test_chat_py_scripted_through_a_pipe(tiny_folder):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, str(REPO / "chat.py"), "--path", tiny_folder, "--max_new_tokens", "8"],
                         input="Describe the lamp.\nclear\nquit\n", capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Assistant: ") and lines[1] == "[history cleared]"
    assert "Human:" not in res.stdout and "Type 'clear'" not in res.stdout  # no prompt text on a pipe


@pytest.mark.slow
def test_missing_folder_is_a_clear_error(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "chat.py"), "--path", str(tmp_path / "nope")],
                         input="quit\n", capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "nope" in res.stderr and "Traceback" not in res.stderr


def test_weights_load_as_saved_on_a_gpu_and_in_fp32_on_a_cpu():
    """A bf16-trained actor must not be cast to fp16 on a GPU (fp16's range can overflow it): "auto" keeps
    the saved dtype there; a CPU computes in fp32 unless --dtype says otherwise."""
    from inference.chatbot import load_dtype

    assert load_dtype("auto", "cuda") == "auto" and load_dtype("auto", "cpu") is torch.float32
    assert load_dtype("bf16", "cpu") is torch.bfloat16 and load_dtype("fp16", "cuda") is torch.float16


def test_bf16_and_top_k_sampling_on_a_cpu(tiny_folder):
    bot = Chatbot(tiny_folder, max_new_tokens=4, device="cpu", do_sample=True, top_k=1, dtype="bf16")
    assert bot.model.dtype is torch.bfloat16 and bot.generate_kwargs["logits_processor"][0].top_k == 1
    greedy = Chatbot(tiny_folder, max_new_tokens=4, device="cpu", dtype="bf16")
    assert bot.reply("Describe the lamp.") == greedy.reply("Describe the lamp.")  # top-1 sampling is greedy
