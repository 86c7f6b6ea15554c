"""--apply_chat_template (utils/data/chat_template.py) on tiny-llama, whose ChatML template (SmolLM2's and
Qwen's) ends a turn with <|im_end|>, not its EOS: token by token for every phase (the prompt ends with the
generation prompt, SFT labels mask the prompt, the reward score sits on the end-of-turn token, DPO sums the
answer), the row layouts as messages, the pad token a template writes (SmolLM2's), step 3's end tokens,
chat.py's choice of format, one-line refusals for a model without a template, and the steps end to end."""
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, run_entry
from utils.data import data_utils as du
from utils.data.chat_template import NEW_PAD, chat_format, dschat_messages, use_distinct_pad
from utils.data.raw_datasets import get_raw_dataset
from utils.data.split import split_indices
from utils.errors import UserInputError
from utils.model.model_utils import load_hf_tokenizer
from utils.rl_math import pairwise_reward_loss

SMALL = "builtin/preference-small"
SEED = 1234
CHATML_PROMPT = "<s><|im_start|>user\nDescribe the lamp.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("tiny-llama", apply_chat_template=True)


@pytest.fixture(scope="module")
def chat(tok):
    return chat_format(tok, "tiny-llama")


def tokens(tok, ids):
    return tok.convert_ids_to_tokens(list(ids))


def phase_rows(phase, split="train"):
    raw = get_raw_dataset(SMALL, "/unused", SEED, -1)
    data = raw.get_train_data() if split == "train" else raw.get_eval_data()
    return raw, [data[int(i)] for i in split_indices(len(data), "2,4,4", SEED)[phase - 1]]


# --------------------------------------------------------------------------- the format
def test_dschat_text_reads_back_as_messages():
    hh = "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant:"
    assert dschat_messages(hh) == [{"role": "user", "content": "What is 2+2?"},
                                   {"role": "assistant", "content": "4."},
                                   {"role": "user", "content": "And 3+3?"}]
    assert dschat_messages(" Human: Describe the lamp. Assistant:") == [
        {"role": "user", "content": "Describe the lamp."}]
    assert dschat_messages(" Be brief. Human: Hi Assistant:") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert dschat_messages("Why is the sky blue?") == [{"role": "user", "content": "Why is the sky blue?"}]
    assert dschat_messages("HumanAssistant: x") == [{"role": "user", "content": "HumanAssistant: x"}]  # no marker
    assert dschat_messages("  ") is None and dschat_messages(None) is None


def test_tiny_llama_prompt_and_answer_token_by_token(tok, chat):
    assert (chat.eot, tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>", "<pad>")
    assert chat.stop_ids == (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    messages = dschat_messages(" Human: Describe the lamp. Assistant:")
    assert chat.prompt(messages) == CHATML_PROMPT
    prompt_ids, answer_ids = chat.conversation_ids(messages, " The lamp is bright.")
    generation_prompt = chat.encode("<|im_start|>assistant\n")
    assert prompt_ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|im_start|>")]  # one BOS, the template's
    assert prompt_ids[-len(generation_prompt):] == generation_prompt
    assert tokens(tok, answer_ids) == ["The", "Ġlamp", "Ġis", "Ġbright", ".", "<|im_end|>"]  # nothing after the eot
    full = chat.render(messages + [{"role": "assistant", "content": "The lamp is bright."}])
    assert full == CHATML_PROMPT + "The lamp is bright.<|im_end|>\n"  # the template's "\n" is not trained on


def test_a_model_without_a_template_is_refused_in_one_line():
    plain = load_hf_tokenizer("tiny-opt")
    with pytest.raises(UserInputError) as e:
        chat_format(plain, "tiny-opt")
    assert str(e.value) == "tiny-opt has no chat template; drop --apply_chat_template"
    with pytest.raises(UserInputError, match="^tiny-opt has no chat template; drop --apply_chat_template$"):
        load_hf_tokenizer("tiny-opt", apply_chat_template=True)


# --------------------------------------------------------------------------- the phases
def test_phase1_labels_mask_the_prompt(tmp_path, tok, chat):
    train, _ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 1, SEED, tok, 64,
                                        apply_chat_template=True)
    raw, rows = phase_rows(1)
    expected = {}
    for row in rows:
        p, a = chat.conversation_ids(raw.get_prompt_messages(row), raw.get_chosen(row))
        expected[tuple(p + a)] = len(p)
    assert {tuple(s["input_ids"].tolist()): s["prompt_length"] for s in train.samples} == expected
    generation_prompt = chat.encode("<|im_start|>assistant\n")
    batch = du.DataCollatorSFT(tok.pad_token_id, 64)(train.samples[:4])
    for i, sample in enumerate(train.samples[:4]):
        ids, n = sample["input_ids"].tolist(), sample["prompt_length"]
        assert ids[n - len(generation_prompt):n] == generation_prompt and ids[-1] == chat.eot_id
        labels = batch["labels"][i].tolist()
        assert labels[:n] == [-100] * n  # the prompt is not trained on
        assert labels[n:len(ids)] == ids[n:]  # the answer and its <|im_end|> are
        assert set(labels[len(ids):]) <= {-100}  # padding


def test_phase2_reward_score_sits_on_the_end_of_turn_token(tmp_path, tok, chat):
    train, _ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 2, SEED, tok, 64,
                                        apply_chat_template=True)
    samples = train.samples[:8]
    for c, r in samples:
        assert c[-1] == chat.eot_id and r[-1] == chat.eot_id
    batch = du.DataCollatorReward(tok.pad_token_id, 64)(samples)
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1], dtype=torch.float).expand(ids.shape)  # score = where it was read
    B = len(samples)
    _, chosen_at, rejected_at = pairwise_reward_loss(positions[:B], positions[B:], ids[:B], ids[B:], tok.pad_token_id, 0)
    for i, (c, r) in enumerate(samples):
        assert int(chosen_at[i]) == len(c) - 1 and ids[i, len(c) - 1] == chat.eot_id
        assert int(rejected_at[i]) == len(r) - 1 and ids[B + i, len(r) - 1] == chat.eot_id


def test_phase3_prompts_end_with_the_generation_prompt_and_step3_scores_the_end_of_turn(tmp_path, tok, chat):
    from utils.model.reward_model import end_score_index

    train, _ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 3, SEED, tok, 64,
                                        apply_chat_template=True)
    raw, rows = phase_rows(3)
    assert sorted(s["prompt"] for s in train.samples) == sorted(chat.prompt(raw.get_prompt_messages(r)) for r in rows)
    sample = train.samples[0]
    assert sample["input_ids"].tolist() == chat.encode(sample["prompt"])
    assert sample["prompt"].startswith("<s><|im_start|>user\n") and sample["prompt"].endswith(
        "<|im_start|>assistant\n")
    # a generated answer: left-padded prompt, 3 tokens and <|im_end|>, then the pad generate fills in
    batch = du.DataCollatorRLHF(32, tok.pad_token_id)([sample])
    P = batch["prompt"].shape[1]  # the prompt's length rounded up to a multiple of 8, ≤ 32
    assert P % 8 == 0 and P - 8 < len(sample["input_ids"]) <= P
    answer = chat.encode("It is calm.") + [chat.eot_id] + [tok.pad_token_id] * 4
    seq = torch.cat([batch["prompt"], torch.tensor([answer])], dim=1)
    assert int(end_score_index(seq, P, tok.pad_token_id, tok.eos_token_id)[0]) == P + len(answer) - 5


def test_dpo_sums_the_answer_turns_only(tok, chat):
    from step2_dpo_finetuning.main import dpo_loss_mask

    messages = [{"role": "user", "content": "Describe the lamp."}]
    prompt, chosen = chat.conversation_ids(messages, "It is bright.")
    _, rejected = chat.conversation_ids(messages, "Dark.")
    c, r = torch.tensor(prompt + chosen), torch.tensor(prompt + rejected)
    batch = du.DataCollatorReward(tok.pad_token_id, 64)([(c, r)])
    mask = dpo_loss_mask(batch["input_ids"], batch["attention_mask"]).tolist()
    width, n = len(mask[0]), len(prompt)
    assert mask[0] == [0] * n + [1] * len(chosen) + [0] * (width - len(c))  # the answer and its <|im_end|>
    assert mask[1] == [0] * n + [1] * len(rejected) + [0] * (width - len(r))


def test_cache_key_unchanged_without_the_template_and_separate_with_it(tmp_path, tok):
    args = (["x"], "2,4,4", 1, SEED, tok, 64, "<|endoftext|>", [], ["fp"])
    assert du.cache_key(*args) == du.cache_key(*args, chat_template=None)
    assert du.cache_key(*args) != du.cache_key(*args, chat_template=tok.chat_template)
    du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 1, SEED, tok, 64)
    du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 1, SEED, tok, 64, apply_chat_template=True)
    assert len(list(tmp_path.glob("traindata_phase1_*.pt"))) == 2


# --------------------------------------------------------------------------- row layouts
def test_local_layouts_become_messages_and_keep_their_dschat_text(tmp_path):
    rows = {
        "conv.json": [{"system": "Be kind.", "conversations": [
            {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye?"}],
            "chosen": {"from": "gpt", "value": "Bye."}, "rejected": {"from": "gpt", "value": "No."}}],
        "sft.json": [{"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello"}]}],
        "alpaca.json": [{"instruction": "Add", "input": "2 and 2", "output": "4", "system": "Be brief.",
                         "history": [["Hi", "Hello"]]}],
        "qa.json": [{"question": "What is 2+2?", "answer": "4"}],
        "hh.json": [{"chosen": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye?\n\nAssistant: Bye.",
                     "rejected": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye?\n\nAssistant: No."}],
        "prompt.json": [{"prompt": "Why?", "chosen": "Because.", "rejected": "No."}],
    }
    expected = {
        "conv.json": ([("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Bye?")],
                      " Be kind. Human: Hi Assistant: Hello Human: Bye? Assistant:"),
        "sft.json": ([("user", "Hi")], " Human: Hi Assistant:"),
        "alpaca.json": ([("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Add\n2 and 2")],
                        " Be brief. Human: Hi Assistant: Hello Human: Add\n2 and 2 Assistant:"),
        "qa.json": ([("user", "What is 2+2?")], " Human: What is 2+2? Assistant:"),
        "hh.json": ([("user", "Hi"), ("assistant", "Hello"), ("user", "Bye?")],
                    "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye?\n\nAssistant:"),
        "prompt.json": ([("user", "Why?")], " Human: Why? Assistant:"),
    }
    for name, data in rows.items():
        (tmp_path / name).write_text(json.dumps(data))
        raw = get_raw_dataset(str(tmp_path / name), str(tmp_path / "out"), SEED, -1).load()
        row = raw._train[0]
        messages, text = expected[name]
        assert [(m["role"], m["content"]) for m in raw.get_prompt_messages(row)] == messages, name
        assert raw.get_prompt(row) == text, name  # DeepSpeed-Chat's text as before


# --------------------------------------------------------------------------- the pad token
def test_a_pad_token_the_template_writes_is_replaced(tmp_path, tok):
    smol = load_hf_tokenizer("tiny-llama")
    smol.pad_token = "<|im_end|>"  # as SmolLM2-Instruct: pad = its end-of-turn token, written in every prompt
    chat = chat_format(smol, "smol")
    c, r = (torch.tensor(sum(chat.conversation_ids([{"role": "user", "content": "Hi"}], a), []))
            for a in ("It is calm.", "It is dark and cold."))
    ids = du.DataCollatorReward(smol.pad_token_id, 64)([(c, r)])["input_ids"]
    positions = torch.arange(ids.shape[1], dtype=torch.float).expand(ids.shape)
    _, read_at, _ = pairwise_reward_loss(positions[:1], positions[1:], ids[:1], ids[1:], smol.pad_token_id, 0)
    assert int(read_at[0]) < len(chat.prompt_ids([{"role": "user", "content": "Hi"}]))  # inside the prompt: why

    assert use_distinct_pad(smol, "smol") == "<|im_end|>" and smol.pad_token == "<unk>"
    assert use_distinct_pad(smol, "smol") is None  # once is enough
    ids = du.DataCollatorReward(smol.pad_token_id, 64)([(c, r)])["input_ids"]
    _, read_at, _ = pairwise_reward_loss(positions[:1], positions[1:], ids[:1], ids[1:], smol.pad_token_id, 0)
    assert int(read_at[0]) == len(c) - 1 and ids[0, len(c) - 1] == chat.eot_id

    no_unk = load_hf_tokenizer("tiny-llama")
    no_unk.pad_token, no_unk.unk_token = "<|im_end|>", "<|endoftext|>"  # the only candidate ends answers
    assert use_distinct_pad(no_unk, "x") == "<|im_end|>" and no_unk.pad_token == NEW_PAD
    assert tok.pad_token == "<pad>"  # tiny-llama's own pad is never written by its template: kept


# --------------------------------------------------------------------------- step 3 and chat.py
def test_step3_answers_end_at_the_end_of_turn_token():
    from step3_rlhf_finetuning.config import Step3Config
    from step3_rlhf_finetuning.main import parse_args
    from step3_rlhf_finetuning.ppo_trainer import end_of_answer_token_ids
    from utils.training import answer_end_token, load_tokenizer

    def config(argv):  # as step 3's main: the configuration from the flags and the tokenizer it loaded
        args = parse_args(argv)
        tokenizer = load_tokenizer(args, args.actor_model_name_or_path)
        return Step3Config.from_args(args, answer_end_token(args, tokenizer, args.actor_model_name_or_path))

    base = ["--actor_model_name_or_path", "tiny-llama", "--critic_model_name_or_path", "c", "--output_dir", "o",
            "--dtype", "fp32"]
    assert config(base).generation.eot_token is None
    templated = config(base + ["--apply_chat_template"])
    assert templated.generation.eot_token == "<|im_end|>"
    tok = load_hf_tokenizer("tiny-llama")
    assert end_of_answer_token_ids(tok, templated.generation.eot_token) == (
        tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)


def test_chat_py_answers_in_the_format_the_model_was_trained_in(tmp_path):
    """A step-1/DPO/step-3 folder records whether it was trained with --apply_chat_template (training_format.json):
    the demo's tiny-llama actor, trained on DeepSpeed-Chat's text, is not chatted with in ChatML though its
    tokenizer has the template; a folder trained with the template, or recording nothing, uses the template."""
    import shutil

    from inference.chatbot import Chatbot
    from utils.data.chat_template import TRAINING_FORMAT_FILE, trained_with_template, training_format_file
    from utils.model.model_utils import resolve_model_name_or_path

    for applied in (False, True):
        folder = tmp_path / str(applied)
        shutil.copytree(resolve_model_name_or_path("tiny-llama"), folder)
        (folder / TRAINING_FORMAT_FILE).write_text(training_format_file(applied)[TRAINING_FORMAT_FILE])
        assert trained_with_template(str(folder)) is applied
        bot = Chatbot(str(folder), max_new_tokens=4, device="cpu")
        assert (bot.chat is not None) is applied
        if not applied:
            assert bot.describe_format().endswith("(the format it was trained in)")
    assert trained_with_template(str(tmp_path)) is None  # nothing recorded: the template when there is one
    forced = Chatbot(str(tmp_path / "False"), max_new_tokens=4, device="cpu", apply_chat_template=True)
    assert forced.chat is not None  # the flag still wins


def test_chat_py_uses_the_template_when_the_model_has_one(monkeypatch):
    from inference.chatbot import Chatbot

    bot = Chatbot("tiny-llama", max_new_tokens=8, device="cpu")
    assert bot.describe_format() == "format: the model's chat template (answers end with '<|im_end|>')"
    assert bot.generate_kwargs["eos_token_id"] == list(bot.chat.stop_ids)
    seen = []

    def generate(input_ids, attention_mask, **kwargs):
        seen.append(bot.tokenizer.decode(input_ids[0]))
        answer = bot.chat.encode("It is bright.") + [bot.chat.eot_id]
        return torch.cat([input_ids, torch.tensor([answer])], dim=1)

    monkeypatch.setattr(bot.model, "generate", generate)
    assert bot.reply("Describe the lamp.") == "It is bright."
    assert seen[-1] == CHATML_PROMPT
    bot.reply("And the river?")
    assert seen[-1] == (CHATML_PROMPT + "It is bright.<|im_end|>\n<|im_start|>user\nAnd the river?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    bot.clear()
    bot.reply("Hi")
    assert seen[-1] == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    dschat = Chatbot("tiny-llama", max_new_tokens=8, device="cpu", apply_chat_template=False)
    assert dschat.chat is None and "(--no-apply_chat_template)" in dschat.describe_format()
    assert Chatbot("tiny-opt", max_new_tokens=8, device="cpu").describe_format() == (
        "format: DeepSpeed-Chat's ' Human: … Assistant:' text (tiny-opt has no chat template)")
    with pytest.raises(UserInputError, match="^tiny-opt has no chat template; drop --apply_chat_template$"):
        Chatbot("tiny-opt", device="cpu", apply_chat_template=True)


def test_chat_template_history_drops_the_oldest_turns(monkeypatch):
    from inference.chatbot import Chatbot

    bot = Chatbot("tiny-llama", max_new_tokens=8, device="cpu")
    monkeypatch.setattr(bot, "max_positions", 8 + 24)  # a 24-token prompt budget
    bot.messages = [{"role": "user", "content": "a long old question " * 5}, {"role": "assistant", "content": "Ok."}]
    messages, ids = bot._template_ids(bot.messages + [{"role": "user", "content": "Hi"}])
    assert messages == [{"role": "user", "content": "Hi"}] and ids[0].tolist() == bot.chat.prompt_ids(messages)


# --------------------------------------------------------------------------- end to end
OMP = {"OMP_NUM_THREADS": "1"}


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.smoke
@pytest.mark.slow
def test_every_step_runs_with_the_template(tmp_path):
    data = ["--data_path", SMALL, "--data_output_path", tmp_path / "data", "--apply_chat_template"]
    lm = [*data, "--per_device_train_batch_size", 8, "--max_seq_len", 48, "--max_steps", 3]
    actor, reward = tmp_path / "actor", tmp_path / "reward"
    out = _ok(run_entry("step1_supervised_finetuning/main.py", "--model_name_or_path", "tiny-llama", *lm,
                        "--output_dir", actor, env=OMP))
    assert "answers with '<|im_end|>', padding with '<pad>'" in out.stdout
    assert "(3 of them run: --max_steps 3)" in out.stdout and "| 0/3 [" in out.stderr  # the bar counts 3
    assert "<|im_start|>" in (actor / "chat_template.jinja").read_text()
    out = _ok(run_entry("step2_reward_model_finetuning/main.py", "--model_name_or_path", "tiny-llama", *lm,
                        "--num_padding_at_beginning", 0, "--output_dir", reward, env=OMP))
    assert "| 0/3 [" in out.stderr
    out = _ok(run_entry("step2_dpo_finetuning/main.py", "--model_name_or_path", actor, *lm,
                        "--output_dir", tmp_path / "dpo", "--eval_iters", 1, env=OMP))
    assert "| 0/3 [" in out.stderr
    _ok(run_entry("step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", actor,
                  "--critic_model_name_or_path", reward, *data, "--num_padding_at_beginning", 0,
                  "--max_prompt_seq_len", 32, "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 4,
                  "--per_device_training_batch_size", 4, "--max_steps", 1, "--output_dir", tmp_path / "step3",
                  "--num_warmup_steps", 0, env=OMP))  # one step at the warm-up's learning rate 0 would change nothing
    out = _ok(run_entry("step2_reward_model_finetuning/rw_eval.py", "--model_name_or_path", reward,
                        "--apply_chat_template", "--prompt", "Describe the lamp.", "--answer", "It is bright."))
    assert "score" in out.stdout
    out = _ok(run_entry("step1_supervised_finetuning/prompt_eval.py", "--model_name_or_path_baseline", "tiny-llama",
                        "--model_name_or_path_finetune", actor, "--apply_chat_template", "--max_new_tokens", 4,
                        "--prompts", "Human: Describe the lamp. Assistant:"))
    assert "user\nDescribe the lamp.\nassistant\n" in out.stdout  # the template's text (special tokens dropped)
    proc = _ok(subprocess.run([sys.executable, str(REPO / "chat.py"), "--path", str(tmp_path / "step3"),
                               "--max_new_tokens", "4"], input="Describe the lamp.\nquit\n", capture_output=True,
                              text=True, timeout=300))
    assert "format: the model's chat template (answers end with '<|im_end|>')" in proc.stderr
    assert proc.stdout.startswith("Assistant: ")


@pytest.mark.slow
def test_a_step_refuses_a_model_without_a_template_in_one_line(tmp_path):
    proc = run_entry("step1_supervised_finetuning/main.py", "--model_name_or_path", "tiny-opt", "--data_path", SMALL,
                     "--data_output_path", tmp_path / "data", "--output_dir", tmp_path / "out",
                     "--apply_chat_template", env=OMP)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        "error: --model_name_or_path tiny-opt has no chat template; drop --apply_chat_template"]
    assert not (tmp_path / "out").exists()
