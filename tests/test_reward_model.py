"""RewardModel (forward / forward_value score positions) and step-2 folders (save, strict load)."""
import json
import os

import pytest
import torch

from utils.errors import UserInputError
from utils.model.critic import (MARKER_FILE, WEIGHTS_FILE, create_critic_model, load_reward_model,
                                save_reward_model, zero_value_head)
from utils.model.model_utils import load_hf_tokenizer, resolve_model_name_or_path
from utils.model.reward_model import count_leading_pads, end_score_index
from utils.rl_math import pairwise_reward_loss

# --------------------------------------------------------------------------- end_score_index (hand-made ids)

PAD = EOS = 0  # OPT-style: BOS = EOS = pad = 0


def test_end_index_opt_style_with_eos_and_padding():
    ids = torch.tensor([[0, 5, 6, 7, 8, 0, 0, 0],   # prompt 0 5 6, answer 7 8, EOS, pads
                        [0, 5, 6, 9, 0, 0, 0, 0]])  # answer 9
    assert end_score_index(ids, 3, PAD, EOS, 1).tolist() == [4, 3]
    # prompt_length 0: the leading BOS (= pad) is skipped thanks to num_padding_at_beginning
    assert end_score_index(ids, 0, PAD, EOS, 1).tolist() == [4, 3]
    # per-row prompt lengths
    assert end_score_index(ids, torch.tensor([3, 2]), PAD, EOS, 1).tolist() == [4, 3]


def test_end_index_without_eos_is_last_position():
    ids = torch.tensor([[0, 5, 6, 7, 8, 9]])
    assert end_score_index(ids, 3, PAD, EOS, 1).tolist() == [5]


def test_end_index_llama_style_reads_the_eos_like_step_2():
    # pad != eos: the first pad after the prompt is the one after the EOS, so the end score
    # sits ON the EOS -- exactly where step 2's pairwise loss reads it (c - 1).
    pad, eos = 0, 2
    ids = torch.tensor([[1, 5, 6, 7, 8, 2, 0, 0],   # EOS at 5, first pad at 6 -> 5
                        [1, 5, 6, 7, 0, 0, 0, 0],   # no EOS, first pad at 4 -> the last real token 3
                        [1, 5, 6, 2, 0, 0, 0, 0],   # empty answer: EOS at 3, first pad at 4 -> 3
                        [1, 5, 6, 7, 8, 9, 9, 9]])  # no pad at all -> T - 1 = 7
    assert end_score_index(ids, 3, pad, eos, 0).tolist() == [5, 3, 3, 7]


def test_end_index_left_padded_prompt():
    # step 3 layout: prompt left-padded to P = 4 (pads and BOS inside the prompt are ignored)
    ids = torch.tensor([[0, 0, 0, 5, 7, 8, 0, 0]])
    assert end_score_index(ids, 4, PAD, EOS, 1).tolist() == [5]


def test_count_leading_pads():
    assert count_leading_pads(torch.tensor([0, 5, 0]), 0) == 1
    assert count_leading_pads(torch.tensor([1, 5, 0]), 0) == 0


# --------------------------------------------------------------------------- tiny models

def _tokenize(tokenizer, texts):
    return tokenizer(texts, padding=True, return_tensors="pt")


@pytest.fixture(scope="module")
def opt():
    torch.manual_seed(0)
    tokenizer = load_hf_tokenizer("tiny-opt")
    model = create_critic_model("tiny-opt", tokenizer, None, num_padding_at_beginning=1).eval()
    torch.nn.init.normal_(model.v_head.weight, std=1.0)  # make scores clearly position-dependent
    return model, tokenizer


PROMPT = " Human: Describe the lamp. Assistant:"
GOOD = " The lamp is bright and kind and calm."
BAD = " The lamp is dull and rude."


def test_forward_pairwise_scores_at_last_answer_token_opt(opt):
    model, tok = opt
    eot = tok.eos_token
    batch = _tokenize(tok, [PROMPT + GOOD + eot, PROMPT + BAD + eot])  # chosen row, rejected row (B = 1)
    ids = batch["input_ids"]
    assert ids[0, 0] == tok.pad_token_id  # OPT-style BOS = pad: npab 1
    with torch.no_grad():
        out = model(**batch)
        values = model.forward_value(**batch, return_value_only=True)
    # hand-computed positions: the token before each row's EOS
    c_eos = int((ids[0, 1:] == tok.eos_token_id).nonzero()[0]) + 1
    r_eos = int((ids[1, 1:] == tok.eos_token_id).nonzero()[0]) + 1
    assert torch.allclose(out["chosen_mean_scores"], values[0, c_eos - 1:c_eos])
    assert torch.allclose(out["rejected_mean_scores"], values[1, r_eos - 1:r_eos])
    loss, _, _ = pairwise_reward_loss(values[:1], values[1:], ids[:1], ids[1:], tok.pad_token_id, 1)
    assert torch.allclose(out["loss"], loss)
    # forward_value reads the same positions (OPT: pad = eos)
    prompt_len = len(tok(PROMPT)["input_ids"])
    with torch.no_grad():
        end = model.forward_value(**batch, prompt_length=prompt_len)["chosen_end_scores"]
    assert torch.allclose(end, torch.stack([out["chosen_mean_scores"][0], out["rejected_mean_scores"][0]]))


def test_end_score_loss_reads_only_the_end_scores(opt):
    """--reward_loss end (InstructGPT's): -log σ(chosen end score - rejected end score), the span loss otherwise."""
    model, tok = opt
    batch = _tokenize(tok, [PROMPT + GOOD + tok.eos_token, PROMPT + BAD + tok.eos_token])
    with torch.no_grad():
        span = model(**batch)
        model.loss = "end"
        try:
            end = model(**batch)
        finally:
            model.loss = "span"
    c, r = span["chosen_mean_scores"], span["rejected_mean_scores"]
    assert torch.allclose(end["loss"], torch.nn.functional.softplus(r - c).mean())  # -log σ(c - r) = softplus(r - c)
    assert not torch.allclose(end["loss"], span["loss"])  # the span loss averages other positions too
    assert torch.equal(end["chosen_mean_scores"], c)
    with pytest.raises(ValueError, match="unknown reward loss 'mean'"):
        type(model)(model.rwtransformer, tok, 1, loss="mean")


def test_forward_value_padding_does_not_change_scores(opt):
    model, tok = opt
    eot = tok.eos_token
    short, long = PROMPT + BAD + eot, PROMPT + GOOD + " And more words here." + eot
    prompt_len = len(tok(PROMPT)["input_ids"])
    with torch.no_grad():
        padded = model.forward_value(**_tokenize(tok, [short, long]), prompt_length=prompt_len)["chosen_end_scores"]
        alone = model.forward_value(**_tokenize(tok, [short]), prompt_length=prompt_len)["chosen_end_scores"]
        # without EOS (answer cut at the length limit) the last position counts
        cut = _tokenize(tok, [PROMPT + BAD])
        no_eos = model.forward_value(**cut, prompt_length=prompt_len)
    assert torch.allclose(padded[0], alone[0], atol=1e-5)
    assert torch.allclose(no_eos["chosen_end_scores"], no_eos["values"][:, -1])


def test_forward_and_forward_value_read_the_same_position_llama():
    torch.manual_seed(0)
    tok = load_hf_tokenizer("tiny-llama")
    model = create_critic_model("tiny-llama", tok, None, num_padding_at_beginning=0).eval()
    assert tok.pad_token_id != tok.eos_token_id
    batch = _tokenize(tok, [PROMPT + GOOD + tok.eos_token, PROMPT + BAD + tok.eos_token])
    ids = batch["input_ids"]
    with torch.no_grad():
        out = model(**batch)
        values = model.forward_value(**batch, return_value_only=True)
        end = model.forward_value(**batch, prompt_length=len(tok(PROMPT)["input_ids"]))["chosen_end_scores"]
    c_eos = int((ids[0] == tok.eos_token_id).nonzero()[0])
    r_eos = int((ids[1] == tok.eos_token_id).nonzero()[0])
    assert torch.allclose(out["chosen_mean_scores"], values[0, c_eos:c_eos + 1])  # reference rule: at the EOS
    assert torch.allclose(out["rejected_mean_scores"], values[1, r_eos:r_eos + 1])
    # forward_value (step 3's reward) reads the same position as step 2's training
    assert torch.allclose(end, torch.stack([values[0, c_eos], values[1, r_eos]]))


# --------------------------------------------------------------------------- folders

def test_save_load_round_trip_with_lora_fused(opt, tmp_path):
    from utils.lora import convert_linear_layer_to_lora

    _, tok = opt
    torch.manual_seed(1)
    model = create_critic_model("tiny-opt", tok, None, num_padding_at_beginning=1).eval()
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    for name, p in model.named_parameters():
        if "lora_left_weight" in name:
            torch.nn.init.normal_(p, std=0.5)  # a non-trivial LoRA update
    batch = _tokenize(tok, [PROMPT + GOOD + tok.eos_token, PROMPT + BAD + tok.eos_token])
    with torch.no_grad():
        before = model.forward_value(**batch, prompt_length=5)
    save_reward_model(model, tok, str(tmp_path / "rm"))

    files = set(os.listdir(tmp_path / "rm"))
    assert {"config.json", WEIGHTS_FILE, MARKER_FILE} <= files
    marker = json.loads((tmp_path / "rm" / MARKER_FILE).read_text())
    assert marker["num_padding_at_beginning"] == 1
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "rm" / WEIGHTS_FILE)))
    assert "v_head.weight" in keys and not any("lora" in k for k in keys)

    loaded, tok2 = load_reward_model(str(tmp_path / "rm"))
    assert loaded.num_padding_at_beginning == 1 and not loaded.training
    with torch.no_grad():
        after = loaded.forward_value(**batch, prompt_length=5)
    assert torch.allclose(before["values"], after["values"], atol=1e-5)
    assert torch.allclose(before["chosen_end_scores"], after["chosen_end_scores"], atol=1e-5)
    assert tok2(PROMPT)["input_ids"] == tok(PROMPT)["input_ids"]


def test_a_zeroed_value_head_gives_values_0_and_still_learns(tmp_path):
    """Step 3's --critic_value_head zero: the step-2 folder loads whole (backbone and head), then every value is 0;
    the head's gradient is not, so the critic learns its values; the backbone's weights are the folder's."""
    tok = load_hf_tokenizer("tiny-opt")
    torch.manual_seed(2)
    model = create_critic_model("tiny-opt", tok, None, num_padding_at_beginning=1)
    torch.nn.init.normal_(model.v_head.weight, std=1.0)
    save_reward_model(model, tok, str(tmp_path / "rm"))
    critic = create_critic_model(str(tmp_path / "rm"), tok, None, 1, rlhf_training=True)
    backbone = {k: v.clone() for k, v in critic.state_dict().items() if not k.startswith("v_head")}
    batch = _tokenize(tok, [PROMPT + GOOD + tok.eos_token])
    assert critic.forward_value(**batch, return_value_only=True).abs().max() > 0
    values = zero_value_head(critic).forward_value(**batch, return_value_only=True)
    assert torch.equal(values, torch.zeros_like(values))
    ((values - 1.0) ** 2).mean().backward()
    assert critic.v_head.weight.grad.abs().max() > 0
    assert all(torch.equal(v, backbone[k]) for k, v in critic.state_dict().items() if k in backbone)


@pytest.mark.parametrize("prefix", ["rwtransformer.", "rwtranrsformer."])  # since / before its October 2023 fix
def test_loads_reference_checkpoint_layout(opt, tmp_path, prefix):
    """A DeepSpeed-Chat step-2 folder (pytorch_model.bin, no marker) loads, with either key prefix it has saved."""
    model, tok = opt
    folder = tmp_path / "ref"
    folder.mkdir()
    model.config.save_pretrained(folder)
    tok.save_pretrained(folder)
    state = {k.replace("rwtransformer.", prefix): v for k, v in model.state_dict().items()}
    torch.save(state, folder / "pytorch_model.bin")
    loaded = create_critic_model(str(folder), tok, None, 1, rlhf_training=True)
    assert torch.equal(loaded.v_head.weight, model.v_head.weight)
    from utils.preflight import check_causal_lm_path  # as chat.py's or step 3's causal LM: refused, not random

    with pytest.raises(UserInputError, match=r"--path .*: its weights are a reward model's .* not a causal language"):
        check_causal_lm_path("--path", str(folder))


def test_step1_folder_is_not_a_reward_model(opt):
    _, tok = opt
    folder = resolve_model_name_or_path("tiny-opt")  # a causal-LM folder, like a step-1 output
    with pytest.raises(UserInputError, match=r"not a step-2 reward model folder.*v_head"):
        create_critic_model(folder, tok, None, 1, rlhf_training=True)


def test_missing_keys_and_folders_are_user_errors(opt, tmp_path):
    from safetensors.torch import load_file, save_file

    model, tok = opt
    save_reward_model(model, tok, str(tmp_path / "rm"))
    weights = tmp_path / "rm" / WEIGHTS_FILE
    state = load_file(str(weights))
    del state["v_head.weight"]
    del state["rwtransformer.decoder.final_layer_norm.weight"]
    save_file(state, str(weights))
    with pytest.raises(UserInputError, match=r"rm.*missing.*final_layer_norm.weight.*v_head.weight"):
        create_critic_model(str(tmp_path / "rm"), tok, None, 1, rlhf_training=True)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tmp_path / "rm" / "config.json").read_text())
    with pytest.raises(UserInputError, match=r"empty is not a step-2 reward model folder: missing"):
        load_reward_model(str(empty))
    with pytest.raises(UserInputError, match="no such folder"):
        load_reward_model(str(tmp_path / "nowhere"))


# --------------------------------------------------------------------------- bf16: the value head runs in fp32

class _Bf16Backbone(torch.nn.Module):
    """Stand-in backbone: token id -> a fixed 2-d hidden state, in bf16 (as under DeepSpeed bf16)."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": 2})()
        table = torch.zeros(10, 2)
        table[:, 0] = 1.40625          # a large offset common to every token (exactly representable)
        table[7, 1] = 0.00390625       # token 7 (only in the chosen answer) adds 0.5 * 2^-8 to the score
        self.table = torch.nn.Parameter(table.to(torch.bfloat16), requires_grad=False)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return (self.table[input_ids],)


def test_bf16_scores_keep_differences_below_bf16_resolution():
    # chosen and rejected differ by 0.00195 at |score| 1.41, under bf16's step there (2^-7 = 0.0078):
    # a bf16 head (DeepSpeed-Chat, and this project before the fix) rounds both to 1.40625, so the
    # pair ties (accuracy 0, loss exactly ln 2) -- the "collapse" seen on a GPU in bf16.
    from utils.model.reward_model import RewardModel

    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    model = RewardModel(_Bf16Backbone(), tokenizer, num_padding_at_beginning=1).to(torch.bfloat16)
    with torch.no_grad():
        model.v_head.weight.copy_(torch.tensor([[1.0, 0.5]], dtype=torch.bfloat16))
    ids = torch.tensor([[0, 5, 7, 0],    # chosen: BOS, prompt 5, answer 7, EOS
                        [0, 5, 6, 0]])   # rejected: answer 6
    out = model(ids, attention_mask=torch.ones_like(ids))
    assert out["chosen_mean_scores"].dtype == torch.float32
    assert out["chosen_mean_scores"].item() == pytest.approx(1.40625 + 0.001953125, abs=1e-6)
    assert out["rejected_mean_scores"].item() == pytest.approx(1.40625, abs=1e-6)
    assert out["chosen_mean_scores"].item() > out["rejected_mean_scores"].item()
    # loss over the diverging span [2, 3): -log sigmoid(0.001953) < ln 2
    assert out["loss"].item() == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(0.001953125)).item(),
                                               abs=1e-6)
    assert out["loss"].item() < 0.6931
    values = model.forward_value(ids, prompt_length=2)
    assert values["values"].dtype == torch.float32
    assert values["chosen_end_scores"].tolist() == pytest.approx([1.40625 + 0.001953125, 1.40625], abs=1e-6)


# --------------------------------------------------------------------------- best-of-n and accuracy per group (scoring)

def test_best_of_n_by_hand():
    from utils.model.scoring import best_of_n

    nan, inf = float("nan"), float("inf")
    scores = torch.tensor([[0.1, 0.7, 0.3],
                           [0.5, 0.9, 0.9],       # a tie: the first of the equal ones
                           [nan, 0.2, nan],       # NaN is never chosen ...
                           [nan, nan, nan],       # ... unless the whole row is NaN: the first answer
                           [-inf, nan, -inf],     # -inf is a score (a NaN is not, though torch.argmax takes it)
                           [nan, 2.0, inf]])
    assert best_of_n(scores).tolist() == [1, 1, 1, 0, 0, 2]
    assert best_of_n(scores).dtype == torch.long
    assert torch.argmax(scores[2]).item() == 0  # why best_of_n masks NaN
    assert best_of_n(torch.tensor([[3.0]])).tolist() == [0]
    with pytest.raises(ValueError, match="P, N ≥ 1"):
        best_of_n(torch.tensor([1.0, 2.0]))


def test_regularized_best_of_n_by_hand():
    """z(score) + β·z(consensus), z within each row (population std): a larger β moves the pick toward the answer
    most like the others; β 0 is best_of_n; the reward model's scale does not matter; NaN is never picked."""
    from utils.model.scoring import best_of_n, regularized_best_of_n

    nan = float("nan")
    # row 0: z(score) = [-1.2247, 1.2247, 0] (mean 2, std √(2/3)), z(consensus) = [-0.7071, -0.7071, 1.4142]
    #   β 0.5: [-1.578, 0.871, 0.707] → 1;  β 1: [-1.932, 0.518, 1.414] → 2
    # row 1: equal scores (z 0): the consensus decides for any β > 0 (best_of_n takes the first)
    # row 2: the NaN answer is left out of both z's: z(score) [·, -1, 1], z(consensus) [·, 1, -1]
    #   β 0.5: [·, -0.5, 0.5] → 2;  β 1: [·, 0, 0], a tie → 1, the first;  β 2: [·, 1, -1] → 1;
    #   never the NaN one, though its consensus is the highest
    scores = torch.tensor([[1.0, 3.0, 2.0], [2.0, 2.0, 2.0], [nan, 1.0, 3.0]])
    consensus = torch.tensor([[0.0, 0.0, 3.0], [0.0, 1.0, 0.5], [9.0, 1.0, 0.0]])
    assert regularized_best_of_n(scores, consensus, 0.5).tolist() == [1, 1, 2]
    assert regularized_best_of_n(scores, consensus, 1.0).tolist() == [2, 1, 1]
    assert regularized_best_of_n(scores, consensus, 2.0).tolist() == [2, 1, 1]
    assert regularized_best_of_n(scores, consensus, 0.0).tolist() == best_of_n(scores).tolist() == [1, 0, 2]
    assert regularized_best_of_n(100 * scores - 7, consensus, 0.5).tolist() == [1, 1, 2]  # scale-free
    assert regularized_best_of_n(scores, consensus, 1.0).dtype == torch.long
    with pytest.raises(ValueError, match="beta must be ≥ 0"):
        regularized_best_of_n(scores, consensus, -1.0)
    with pytest.raises(ValueError, match="consensus"):
        regularized_best_of_n(scores, consensus[:, :2], 1.0)


def test_pair_accuracy_by_group_by_hand():
    from utils.model.scoring import pair_accuracy_by_group

    chosen = torch.tensor([1.0, 0.0, 2.0, 0.5, float("nan")])
    rejected = torch.tensor([0.0, 1.0, 2.0, 0.0, 0.0])
    groups = ["length", "length", "keyword", ["keyword", "format"], "format"]
    # right: pair 0 (1 > 0) and pair 3 (0.5 > 0); pair 2 ties (wrong, as step 2's eval), pair 4's NaN is wrong
    out = pair_accuracy_by_group(chosen, rejected, groups)
    assert out["overall"] == {"pairs": 5, "correct": 2, "accuracy": 0.4}
    assert out["groups"] == {"format": {"pairs": 2, "correct": 1, "accuracy": 0.5},
                             "keyword": {"pairs": 2, "correct": 1, "accuracy": 0.5},
                             "length": {"pairs": 2, "correct": 1, "accuracy": 0.5}}
    assert list(out["groups"]) == ["format", "keyword", "length"]
    empty = pair_accuracy_by_group([], [], [])
    assert empty["overall"]["pairs"] == 0 and empty["groups"] == {}
    with pytest.raises(ValueError, match="2 chosen, 2 rejected scores, 1 groups"):
        pair_accuracy_by_group([1.0, 2.0], [0.0, 0.0], ["a"])


def test_score_answers_scores_each_answer_and_pads_ragged_rows_with_nan(opt):
    from utils.model.scoring import best_of_n, score_answers, score_texts

    model, tok = opt
    prompts = [PROMPT, " Human: Describe the door. Assistant:"]
    answers = [[GOOD, BAD, " The lamp."], [" The door is open."]]
    scores = score_answers(model, tok, prompts, answers, 128, tok.eos_token, batch_size=2)
    assert scores.shape == (2, 3) and torch.isnan(scores[1, 1:]).all()
    one_by_one = [score_texts(model, tok, [(p, a)], 128, tok.eos_token)[0] for p, row in zip(prompts, answers)
                  for a in row]
    assert scores[0].tolist() + scores[1, :1].tolist() == pytest.approx(one_by_one, abs=1e-5)
    assert best_of_n(scores)[1].item() == 0  # the padding is never the best


def test_score_texts_scores_each_distinct_pair_once_longest_first_and_answers_in_order(opt, monkeypatch):
    from utils.model.scoring import score_pair_sides, score_texts

    model, tok = opt
    rows = []  # the rows of each forward_value batch
    forward_value = model.forward_value

    def counting(**kw):
        rows.append(kw["input_ids"].shape[0])
        return forward_value(**kw)

    monkeypatch.setattr(model, "forward_value", counting)  # the module's model: put back after the test
    lamp = " The lamp."
    pairs = [(PROMPT, lamp), (PROMPT, GOOD), (PROMPT, BAD), (PROMPT, GOOD), [PROMPT, lamp]]  # 3 distinct
    scores = score_texts(model, tok, pairs, 128, tok.eos_token, batch_size=2)
    assert rows == [2, 1]  # 3 texts scored, not 5
    rows.clear()
    alone = {a: score_texts(model, tok, [(PROMPT, a)], 128, tok.eos_token)[0] for a in (lamp, GOOD, BAD)}
    assert scores == pytest.approx([alone[lamp], alone[GOOD], alone[BAD], alone[GOOD], alone[lamp]], abs=1e-5)
    assert scores[1] == scores[3] and scores[0] == scores[4]  # equal pairs, equal scores
    batches = []
    monkeypatch.setattr(model, "forward_value",
                        lambda **kw: batches.append(kw["attention_mask"].sum(1).tolist()) or forward_value(**kw))
    score_texts(model, tok, [(PROMPT, lamp), (PROMPT, GOOD), (PROMPT, BAD)], 128, tok.eos_token, batch_size=2)
    assert [len(b) for b in batches] == [2, 1] and min(batches[0]) >= batches[1][0]  # the longest two first
    comparisons = [{"prompt": PROMPT, "chosen": GOOD, "rejected": BAD},
                   {"prompt": PROMPT, "chosen": GOOD, "rejected": lamp},
                   {"prompt": PROMPT, "chosen": lamp, "rejected": BAD}]
    batches.clear()
    chosen, rejected = score_pair_sides(model, tok, comparisons, 128, tok.eos_token, batch_size=8)
    assert [len(b) for b in batches] == [3]  # six sides, three answers
    assert chosen == pytest.approx([alone[GOOD], alone[GOOD], alone[lamp]], abs=1e-5)
    assert rejected == pytest.approx([alone[BAD], alone[lamp], alone[BAD]], abs=1e-5)
