"""Step 2's ``--kwise`` (InstructGPT's K-wise batching): the pairs grouped by prompt, each distinct answer of a batch
forwarded once, the loss averaged per prompt then over prompts. By hand: the grouping, the answers' indices, the
loss; then the reward model's K-wise pass against its pair-by-pair one, and a tiny step-2 run."""
import json
import math

import pytest
import torch

from tests.conftest import run_entry
from utils.data.comparisons import dedup_answers, group_pairs, ranked_pairs
from utils.data.data_utils import DataCollatorKwise, DataCollatorReward, PromptDataset, group_by_prompt
from utils.model.reward_model import kwise_loss

OMP = {"OMP_NUM_THREADS": "1"}


# --------------------------------------------------------------------------- grouping and answer indices (by hand)

def test_group_pairs_by_hand():
    # prompt A's answers a1 a2 a3 (3 pairs), prompt B's b1 b2 (1 pair), in a shuffled order
    pairs = [("a1", "a2"), ("b1", "b2"), ("a3", "a2"), ("a1", "a3")]
    assert group_pairs(pairs) == [[0, 2, 3], [1]]
    # x-y and z-w are two groups until y-z joins them (a later pair merges earlier groups)
    assert group_pairs([("x", "y"), ("z", "w"), ("y", "z")]) == [[0, 1, 2]]
    # unrelated pairs (hh-rlhf): one group each
    assert group_pairs([("c", "d"), ("e", "f")]) == [[0], [1]]
    assert group_pairs([]) == []


def test_collected_pairs_group_back_into_their_prompts():
    # what collect_comparisons.py writes: every pair of differently scored answers of each prompt, then shuffled
    # (step 2's split); texts begin with their prompt, as tokenised texts do
    rows = ranked_pairs("P:", ["w", "x", "y", "z"], [3, 2, 2, 1]) + ranked_pairs("Q:", ["u", "v"], [0, 1])
    assert len(rows) == 5 + 1  # 6 pairs of 4 answers, less the tie x = y
    order = [4, 0, 5, 2, 1, 3]
    keys = [(rows[i]["prompt"] + rows[i]["chosen"], rows[i]["prompt"] + rows[i]["rejected"]) for i in order]
    groups = group_pairs(keys)
    assert [[order[i] for i in g] for g in groups] == [[4, 0, 2, 1, 3], [5]]


def test_dedup_answers_by_hand():
    texts, chosen, rejected = dedup_answers([("a1", "a2"), ("a1", "a3"), ("a3", "a2"), ("b1", "b2")])
    assert texts == ["a1", "a2", "a3", "b1", "b2"]  # 5 distinct answers forwarded for 4 pairs
    assert chosen == [0, 0, 2, 3] and rejected == [1, 2, 1, 4]


# --------------------------------------------------------------------------- the loss (by hand)

def test_kwise_loss_by_hand():
    # end-score loss −logσ(c − r) = ln(1 + e^−(c−r)). Prompt A: 3 answers scored 2, 0, 1 → pairs (2>0), (2>1),
    # (1>0), differences 2, 1, 1; prompt B: 2 answers scored 0.5, 0.5 → difference 0.
    chosen = torch.tensor([2.0, 2.0, 1.0, 0.5])
    rejected = torch.tensor([0.0, 1.0, 0.0, 0.5])
    losses = -torch.nn.functional.logsigmoid(chosen - rejected)
    # ln(1+e^−2) = 0.126928, ln(1+e^−1) = 0.313262, ln 2 = 0.693147
    # A: (0.126928 + 2·0.313262)/3 = 0.251151; B: 0.693147; K-wise = (0.251151 + 0.693147)/2 = 0.472149
    assert kwise_loss(losses, torch.tensor([0, 0, 0, 1])).item() == pytest.approx(0.472149, abs=1e-6)
    # the ordinary mean over pairs weighs A three times: (0.126928 + 2·0.313262 + 0.693147)/4 = 0.361650
    assert losses.mean().item() == pytest.approx(0.361650, abs=1e-6)
    # group ids are labels only: any values, any order
    assert kwise_loss(losses, torch.tensor([7, 7, 7, 3])).item() == pytest.approx(0.472149, abs=1e-6)
    shuffled = kwise_loss(losses[[3, 0, 1, 2]], torch.tensor([3, 7, 7, 7]))
    assert shuffled.item() == pytest.approx(0.472149, abs=1e-6)


def test_kwise_loss_with_one_pair_per_prompt_is_the_mean():
    losses = torch.tensor([0.1, 0.7, 0.4])
    assert kwise_loss(losses, torch.arange(3)).item() == pytest.approx(0.4)


def test_kwise_loss_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[N\] losses and \[N\] groups"):
        kwise_loss(torch.ones(3), torch.zeros(2, dtype=torch.long))


# --------------------------------------------------------------------------- the batches

def t(*ids):
    return torch.tensor(ids, dtype=torch.int32)


def test_kwise_collator_by_hand():
    A, B, C = t(1, 2, 3), t(1, 2, 4), t(1, 2, 5, 6)  # prompt 1 2's answers
    D, E = t(7, 8), t(7, 9)  # prompt 7's
    prompts = [[(A, B), (A, C), (C, B)], [(D, E)]]
    batch = DataCollatorKwise(pad_token_id=0, max_seq_len=64, pad_to_multiple=8)(prompts)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [1, 2, 4, 0, 0, 0, 0, 0],
                                           [1, 2, 5, 6, 0, 0, 0, 0], [7, 8, 0, 0, 0, 0, 0, 0],
                                           [7, 9, 0, 0, 0, 0, 0, 0]]  # 5 rows for 4 pairs (8 in a pairwise batch)
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 3, 4, 2, 2]
    assert batch["chosen_index"].tolist() == [0, 0, 2, 3] and batch["rejected_index"].tolist() == [1, 2, 1, 4]
    assert batch["pair_group"].tolist() == [0, 0, 0, 1]


def test_prompts_batch_whole_and_every_pair_once_an_epoch():
    from utils.checkpoint import resumable_loader

    # 3 prompts: 3 pairs, 1 pair, 2 pairs, stored shuffled as step 2's data are
    p = {f"{prompt}{i}": t(first, 1, i) for first, prompt in ((10, "a"), (11, "b"), (12, "c")) for i in range(3)}
    pairs = [(p["a0"], p["a1"]), (p["b0"], p["b1"]), (p["a0"], p["a2"]), (p["c0"], p["c1"]), (p["a2"], p["a1"]),
             (p["c2"], p["c1"])]
    dataset = PromptDataset(pairs, 2, {"kept": 6})
    dataset.cache_key = "key"
    grouped = group_by_prompt(dataset)
    assert len(grouped) == 3 and grouped.cache_key == "key"
    assert [[int(c[0]) for c, _ in group] for group in grouped.samples] == [[10, 10, 10], [11], [12, 12]]
    loader = resumable_loader(grouped, 2, seed=1, collate_fn=DataCollatorKwise(0, 16))
    assert len(loader) == 2  # the batch size counts prompts: 2 + 1
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        seen = []
        for batch in loader:
            ids = batch["input_ids"]
            groups = batch["pair_group"]
            for g in groups.unique():
                assert len({int(ids[i, 0]) for i in batch["chosen_index"][groups == g]}) == 1  # one prompt a group
            seen += [(tuple(ids[c, :3].tolist()), tuple(ids[r, :3].tolist()))
                     for c, r in zip(batch["chosen_index"], batch["rejected_index"])]
        assert sorted(seen) == sorted((tuple(c.tolist()), tuple(r.tolist())) for c, r in pairs)


# --------------------------------------------------------------------------- the reward model's K-wise pass

@pytest.fixture(scope="module")
def opt():
    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer

    torch.manual_seed(0)
    tokenizer = load_hf_tokenizer("tiny-opt")
    model = create_critic_model("tiny-opt", tokenizer, None, num_padding_at_beginning=1).eval()
    torch.nn.init.normal_(model.v_head.weight, std=1.0)  # scores clearly apart
    return model, tokenizer


def _texts(tok, prompt, answers):
    return [torch.tensor(tok(prompt + a + tok.eos_token)["input_ids"], dtype=torch.int32) for a in answers]


LAMP = " Human: Describe the lamp. Assistant:"
DOOR = " Human: Describe the door. Assistant:"


@pytest.mark.parametrize("loss", ["span", "end"])
def test_kwise_with_one_pair_per_prompt_is_the_ordinary_loss(opt, loss):
    model, tok = opt
    model.loss = loss
    a, b = _texts(tok, LAMP, [" The lamp is bright and kind.", " The lamp is dull."])
    c, d = _texts(tok, DOOR, [" The door is open.", " The door is closed and rude and cold."])
    pairs = [(a, b), (d, c)]
    with torch.no_grad():
        ordinary = model(**DataCollatorReward(tok.pad_token_id, 128)(pairs))
        kwise = model(**DataCollatorKwise(tok.pad_token_id, 128)([[pair] for pair in pairs]))
    assert kwise["loss"].item() == pytest.approx(ordinary["loss"].item(), abs=1e-5)
    assert torch.allclose(kwise["chosen_mean_scores"], ordinary["chosen_mean_scores"], atol=1e-5)
    assert torch.allclose(kwise["rejected_mean_scores"], ordinary["rejected_mean_scores"], atol=1e-5)
    model.loss = "span"


@pytest.mark.parametrize("loss", ["span", "end"])
def test_kwise_pass_is_the_pairs_losses_averaged_per_prompt(opt, loss):
    model, tok = opt
    model.loss = loss
    lamp = _texts(tok, LAMP, [" The lamp is bright and kind and calm.", " The lamp is dull.", " A lamp."])
    door = _texts(tok, DOOR, [" The door is open.", " The door is closed and rude and cold."])
    prompts = [[(lamp[0], lamp[1]), (lamp[0], lamp[2]), (lamp[2], lamp[1])], [(door[1], door[0])]]
    batch = DataCollatorKwise(tok.pad_token_id, 128)(prompts)
    assert batch["input_ids"].shape[0] == 5  # each distinct answer once
    out = model(**batch)
    out["loss"].backward()  # trains like the pairwise loss
    assert model.v_head.weight.grad is not None and model.v_head.weight.grad.abs().sum() > 0
    model.zero_grad()
    with torch.no_grad():  # each pair on its own, in its own (shorter) batch
        alone = [model(**DataCollatorReward(tok.pad_token_id, 128)([pair])) for group in prompts for pair in group]
    losses = [x["loss"].item() for x in alone]
    expected = ((losses[0] + losses[1] + losses[2]) / 3 + losses[3]) / 2
    assert out["loss"].item() == pytest.approx(expected, abs=1e-5)
    assert out["loss"].item() != pytest.approx(sum(losses) / 4, abs=1e-4)  # not the pairs' plain mean
    assert out["chosen_mean_scores"].tolist() == pytest.approx([x["chosen_mean_scores"].item() for x in alone],
                                                               abs=1e-5)
    model.loss = "span"


def test_kwise_eval_scores_each_answer_once_with_the_pairwise_numbers(opt):
    """Step 2's --kwise eval (kwise_loaders): the pairwise eval's pairs, scores and accuracy, each distinct answer
    forwarded once (7 rows, not 2 × 6 pairs)."""
    import logging
    from argparse import Namespace

    from step2_reward_model_finetuning.main import evaluate_reward, kwise_loaders
    from utils.training import make_eval_loader

    model, tok = opt
    model.loss = "end"
    lamp = _texts(tok, LAMP, [" The lamp is bright and kind and calm.", " The lamp is dull.", " A lamp.",
                              " The lamp is warm."])
    door = _texts(tok, DOOR, [" The door is open.", " The door is closed and rude and cold.", " A door."])
    pairs = [(lamp[0], lamp[1]), (door[0], door[1]), (lamp[0], lamp[2]), (lamp[3], lamp[1]), (door[2], door[1]),
             (lamp[2], lamp[1])]
    dataset = PromptDataset(pairs, 2, {"kept": len(pairs)})
    collate = DataCollatorReward(tok.pad_token_id, 128)
    pairwise = make_eval_loader(dataset, collate, 4)
    _, kwise = kwise_loaders(dataset, dataset, collate, Namespace(
        per_device_train_batch_size=1, per_device_eval_batch_size=1, seed=0), logging.getLogger("test_kwise"))
    assert sum(len(b["input_ids"]) for b in pairwise) == 12 and len(pairwise) == 2
    assert sum(len(b["input_ids"]) for b in kwise) == 7 and len(kwise) == 2  # a prompt a batch: 4 + 3 answers
    try:
        a = evaluate_reward(model, pairwise, torch.device("cpu"), eval_iters=0)
        b = evaluate_reward(model, kwise, torch.device("cpu"), eval_iters=0)
    finally:
        model.eval()
        model.loss = "span"
    assert 0 < a["acc"] < 1 and b["acc"] == a["acc"]  # the same pairs, compared alike
    assert (b["chosen"], b["rejected"]) == (pytest.approx(a["chosen"], abs=1e-5),
                                            pytest.approx(a["rejected"], abs=1e-5))


# --------------------------------------------------------------------------- a tiny step-2 run

def _comparisons(path, prompts: range, seed: int):
    """collect_comparisons.py's layout: 4 answers a prompt, every differently scored pair."""
    import random

    rng = random.Random(seed)
    nouns = ["lamp", "door", "cat", "tree", "cup", "road", "bird", "chair", "book", "lake", "hill", "ship", "coat"]
    words = ["kind", "calm", "warm", "dull", "rude", "cold", "bright", "old"]
    rows = []
    for i in prompts:
        noun = nouns[i % len(nouns)]
        answers = [f" The {noun} is " + " and ".join(rng.sample(words, 3)) + "." for _ in range(4)]
        scores = [sum(w in a for w in ("kind", "calm", "warm", "bright")) for a in answers]
        rows += ranked_pairs(f" Human: Describe the {noun} number {i}. Assistant:", answers, scores)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.slow
def test_step2_kwise_trains_under_zero3(tmp_path):
    data = tmp_path / "comparisons"
    data.mkdir()
    rows = _comparisons(data / "train.jsonl", range(24), seed=3)
    _comparisons(data / "eval.jsonl", range(24, 30), seed=4)  # other prompts
    proc = run_entry("step2_reward_model_finetuning/main.py", "--model_name_or_path", "tiny-opt", "--data_path", data,
                     "--data_split", "0,1,0", "--data_output_path", tmp_path / "cache", "--output_dir", tmp_path / "rm",
                     "--per_device_train_batch_size", 4, "--max_seq_len", 64, "--num_train_epochs", 1,
                     "--eval_iters", 2, "--zero_stage", 3, "--reward_loss", "end", "--kwise", "--dropout", 0.0,
                     "--learning_rate", 1e-3, "--print_loss", env=OMP)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if "K-wise batches:" in x)
    pairs, prompts = (int(line.split("K-wise batches: ")[1].split(" pairs")[0]),
                      int(line.split(" pairs of ")[1].split(" prompts")[0]))
    assert pairs == len(rows) and prompts == len({r["prompt"] for r in rows}) > 1  # every prompt's pairs found again
    metrics = [json.loads(x) for x in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m["phase"] == "train"]
    assert len(train) == math.ceil(prompts / 4) and all(math.isfinite(m["loss"]) for m in train)
    assert (tmp_path / "rm" / "reward_model.json").is_file()
