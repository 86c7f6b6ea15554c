"""Tokenizer/model loading and saving (utils/model/model_utils.py): offline local
folders, padding rules, embedding resize and dropout, user errors, atomic saves."""
import os
import shutil
import socket

import pytest
import torch

from utils.errors import UserInputError
from utils.model import model_utils as mu
from utils.model.tiny import resolve_model_path


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    """A plain copy of the tiny-opt folder (not a built-in name)."""
    path = tmp_path_factory.mktemp("models") / "my-opt"
    shutil.copytree(resolve_model_path("tiny-opt"), path)
    return str(path)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_tokenizer_from_local_folder_offline(opt_dir, no_network):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    tok = mu.load_hf_tokenizer(opt_dir)
    assert tok("The lamp is bright.")["input_ids"][0] == tok.bos_token_id


def test_pad_rules(opt_dir):
    opt = mu.load_hf_tokenizer(opt_dir)  # OPT-like: pad = eos
    assert opt.pad_token == opt.eos_token == "<|endoftext|>" and opt.pad_token_id == opt.eos_token_id
    assert opt.padding_side == "right"
    llama = mu.load_hf_tokenizer("tiny-llama")  # Llama with its own pad keeps it
    assert llama.pad_token == "<pad>" and llama.pad_token_id != llama.eos_token_id
    assert llama.padding_side == "right"


def test_llama_without_pad_gets_one(tmp_path):
    from transformers import AutoTokenizer

    src = resolve_model_path("tiny-llama")
    dst = tmp_path / "llama-no-pad"
    tok = AutoTokenizer.from_pretrained(src)
    tok.pad_token = None
    tok.save_pretrained(dst)
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    assert AutoTokenizer.from_pretrained(dst).pad_token is None
    loaded = mu.load_hf_tokenizer(str(dst))
    assert loaded.pad_token == "[PAD]" and len(loaded) == len(tok) + 1


def test_create_hf_model_resizes_to_multiple_of_8_and_applies_dropout(opt_dir):
    from transformers import AutoModelForCausalLM

    tok = mu.load_hf_tokenizer(opt_dir)
    n = len(tok)
    k = (3 - n) % 8 + 8  # n + k = 8m + 3: not a multiple of 8
    tok.add_special_tokens({"additional_special_tokens": [f"<x{i}>" for i in range(k)]})
    expected = n + k + 5  # rounded up to the next multiple of 8
    model = mu.create_hf_model(AutoModelForCausalLM, opt_dir, tok, dropout=0.3)
    assert model.get_input_embeddings().weight.shape[0] == expected
    assert model.get_output_embeddings().weight.shape[0] == expected
    assert model.config.vocab_size == expected
    assert model.config.dropout == 0.3 and model.config.attention_dropout == 0.3  # the folder has 0.1 and 0.0
    assert model.model.decoder.layers[0].dropout == 0.3
    assert model.config.end_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    untouched = mu.create_hf_model(AutoModelForCausalLM, opt_dir, mu.load_hf_tokenizer(opt_dir))
    assert untouched.config.dropout == 0.1 and untouched.get_input_embeddings().weight.shape[0] == (n + 7) // 8 * 8


def test_dropout_also_sets_gpt2_style_fields():
    """Deliberate difference: DeepSpeed-Chat's --dropout sets only dropout, attention_dropout, hidden_dropout and
    activation_dropout, so on a GPT-2-style config (resid_pdrop, embd_pdrop, attn_pdrop) it changed nothing."""
    from transformers import GPT2Config, OPTConfig

    gpt2 = mu.configure_dropout(GPT2Config(), 0.0)
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop) == (0.0, 0.0, 0.0)  # 0.1 each by default
    opt = mu.configure_dropout(OPTConfig(), 0.25)
    assert (opt.dropout, opt.attention_dropout) == (0.25, 0.25)
    assert not hasattr(opt, "resid_pdrop")  # no field is added where a model has none
    assert mu.configure_dropout(GPT2Config(), None).resid_pdrop == 0.1  # None keeps the model's


def test_saved_pad_id_is_the_tokenizers_so_the_eos_embedding_keeps_training(tmp_path):
    """Deliberate difference: DeepSpeed-Chat saves config.pad_token_id = eos. A Llama-style model built from such a
    folder (steps 2 and 3 start from step 1's) has padding_idx = EOS in its embedding, whose row then gets no
    gradient; here the saved pad id is the tokenizer's pad (tiny-llama: 0, a real Llama's added [PAD]: 32000)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = mu.load_hf_tokenizer("tiny-llama")
    assert tok.pad_token_id != tok.eos_token_id
    mu.save_hf_format(mu.create_hf_model(AutoModelForCausalLM, "tiny-llama", tok), tok, str(tmp_path / "actor"))
    config = AutoConfig.from_pretrained(tmp_path / "actor")
    assert (config.pad_token_id, config.end_token_id) == (tok.pad_token_id, tok.eos_token_id)
    # two conversations in a row: the EOS is an input the next tokens' losses depend on
    ids = torch.tensor([tok(" Human: Hi Assistant: Hello" + tok.eos_token + " Human: Bye Assistant: Bye")["input_ids"]])
    assert tok.eos_token_id in ids[0, :-1]

    def eos_row_grad(model):
        model(input_ids=ids, labels=ids).loss.backward()
        return model.get_input_embeddings().weight.grad[tok.eos_token_id].abs().sum().item()

    assert eos_row_grad(AutoModelForCausalLM.from_pretrained(tmp_path / "actor")) > 0
    config.pad_token_id = config.eos_token_id  # DeepSpeed-Chat's rule
    assert eos_row_grad(AutoModelForCausalLM.from_config(config)) == 0


def test_missing_folder_and_folder_without_config(tmp_path):
    from transformers import AutoModelForCausalLM

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(UserInputError, match="no-such-model"):
        mu.load_hf_tokenizer(missing)
    with pytest.raises(UserInputError, match="no-such-model"):
        mu.create_hf_model(AutoModelForCausalLM, missing, None)
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a model")
    with pytest.raises(UserInputError, match=r"empty-model has no config\.json"):
        mu.load_hf_tokenizer(str(empty))
    with pytest.raises(UserInputError, match=r"empty-model has no config\.json"):
        mu.create_hf_model(AutoModelForCausalLM, str(empty), None)


def test_folder_with_config_only_is_a_user_error(opt_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(os.path.join(opt_dir, "config.json"), folder / "config.json")
    # transformers alone returns an empty GPT2Tokenizer here, which encodes every text to []
    with pytest.raises(UserInputError, match="no usable tokenizer in .*config-only"):
        mu.load_hf_tokenizer(str(folder))
    with pytest.raises(UserInputError, match="cannot load the model weights for .*config-only"):
        mu.create_hf_model(AutoModelForCausalLM, str(folder), mu.load_hf_tokenizer(opt_dir))


def test_save_hf_format_is_atomic(opt_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    tok = mu.load_hf_tokenizer(opt_dir)
    model = mu.create_hf_model(AutoModelForCausalLM, opt_dir, tok)
    out = tmp_path / "actor"
    mu.save_hf_format(model, tok, str(out))
    (out / "training.log").write_text("log of the first run\n")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert "model.safetensors" in before and "config.json" in before

    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)  # a different model, whose save fails half-way

    def broken_save(save_directory, **kwargs):
        with open(os.path.join(save_directory, "model.safetensors"), "wb") as f:
            f.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model, "save_pretrained", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        mu.save_hf_format(model, tok, str(out))
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["actor"]  # no temporary folders left behind

    monkeypatch.undo()
    mu.save_hf_format(model, tok, str(out))  # a good save replaces the model, keeps other files
    assert (out / "training.log").read_text() == "log of the first run\n"
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["actor"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(reloaded.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_loading_info_in_a_line_or_two():
    assert mu.describe_loading_info({"missing_keys": set(), "unexpected_keys": set()}, "m") == []
    assert mu.describe_loading_info({"unexpected_keys": {"lm_head.weight"}, "missing_keys": set()}, "opt") == [
        "opt: its LM head (lm_head.weight) is not part of this model and is left out"]
    lines = mu.describe_loading_info({"unexpected_keys": {"lm_head.weight", "extra.a", "extra.b"},
                                      "missing_keys": {f"layers.{i}.w" for i in range(5)}}, "m", shown=2)
    assert lines == ["m: its LM head (lm_head.weight) is not part of this model and is left out",
                     "warning: m: 2 checkpoint weights unused: extra.a, extra.b",
                     "warning: m: 5 weights not in the checkpoint, initialised randomly: layers.0.w, layers.1.w and 3 more"]


def test_a_backbone_from_a_causal_lm_folder_says_so_in_one_line(capfd):
    # transformers 5 prints a multi-line "LOAD REPORT" table (UNEXPECTED lm_head.weight) when step 2 builds its
    # backbone from a causal LM with an untied head (tiny-llama, Llama; OPT ties it and saves none)
    from transformers import AutoModel

    tokenizer = mu.load_hf_tokenizer("tiny-llama")
    mu.create_hf_model(AutoModel, "tiny-llama", tokenizer)
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "UNEXPECTED" not in out + err
    assert "tiny-llama: its LM head (lm_head.weight) is not part of this model and is left out" in out
