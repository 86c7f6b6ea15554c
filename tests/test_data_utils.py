"""Phase datasets and collators (utils/data/data_utils.py) with the tiny-opt tokenizer:
what each phase's samples hold, how batches are padded, sft-only data, the 9:1
train/eval split, the tokenised-data cache, and the real HH-RLHF file."""
import json
import os
import re

import pytest
import torch

from tests.conftest import Payload, shared_data
from utils.data import data_utils as du
from utils.data.raw_datasets import get_raw_dataset
from utils.data.split import split_indices
from utils.model.model_utils import load_hf_tokenizer

SMALL = "builtin/preference-small"  # 400 train / 80 eval rows
SEED = 1234


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("tiny-opt")


def rows_of_phase(name, split, phase, data_split="2,4,4", out="/unused"):
    """The raw rows the seeded split gives to ``phase`` (0-based), computed directly."""
    raw = get_raw_dataset(name, out, SEED, -1)
    data = raw.get_train_data() if split == "train" else raw.get_eval_data()
    return raw, [data[int(i)] for i in split_indices(len(data), data_split, SEED)[phase]]


def ids(tok, text):
    return tuple(tok(text)["input_ids"])


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def qa_rows(n, tag="row"):
    return [{"prompt": f"Describe {tag} {i}.", "chosen": f"It is {tag} {i}.", "rejected": f"No {i}."}
            for i in range(n)]


# --------------------------------------------------------------------------- phase 1
def test_phase1_samples_are_prompt_chosen_eos_of_the_split_rows(tmp_path, tok):
    train, eval_ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 1, SEED, tok, 64,
                                            end_of_conversation_token=tok.eos_token)
    assert (len(train), len(eval_)) == (80, 16)  # 0.2 * 400, 0.2 * 80
    raw, rows = rows_of_phase(SMALL, "train", 0)
    expected = sorted(ids(tok, raw.get_prompt_and_chosen(r) + tok.eos_token) for r in rows)
    assert sorted(tuple(s.tolist()) for s in train.samples) == expected
    eos = tok.eos_token_id
    for s in train.samples:
        assert s[0] == tok.bos_token_id and s[-1] == eos  # tiny-opt: BOS = EOS = pad = 0
        assert (s == eos).sum() == 2  # BOS and the appended end-of-text, nothing else


def test_sft_collator_hand_example():
    batch = du.DataCollatorSFT(pad_token_id=0, max_seq_len=16)([torch.tensor([0, 6, 7]), torch.tensor([8, 0])])
    assert batch["input_ids"].tolist() == [[0, 6, 7, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    # padding -> -100; real tokens equal to the pad id (BOS/EOS of OPT-like tokenizers) are kept
    assert batch["labels"].tolist() == [[0, 6, 7] + [-100] * 5, [8, 0] + [-100] * 6]
    # the batch's longest (10) rounds up to 16 but never beyond max_seq_len
    assert du.DataCollatorSFT(0, 12)([torch.arange(1, 11)])["input_ids"].shape == (1, 12)


def test_phase1_batch_right_padded(tmp_path, tok):
    train, _ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 1, SEED, tok, 64,
                                        end_of_conversation_token=tok.eos_token)
    samples = train.samples[:6]
    batch = du.DataCollatorSFT(tok.pad_token_id, 64)(samples)
    longest = max(len(s) for s in samples)
    width = ((longest + 7) // 8) * 8
    assert batch["input_ids"].shape == batch["labels"].shape == (6, width)
    for i, s in enumerate(samples):
        n = len(s)
        assert batch["input_ids"][i, :n].tolist() == s.tolist()
        assert (batch["input_ids"][i, n:] == tok.pad_token_id).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
        assert batch["labels"][i, :n].tolist() == s.tolist()  # loss on prompt AND answer, EOS included
        assert (batch["labels"][i, n:] == -100).all()


# --------------------------------------------------------------------------- phase 2
def test_phase2_pairs_and_collator(tmp_path, tok):
    train, eval_ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 2, SEED, tok, 64)
    assert (len(train), len(eval_)) == (160, 32)  # 0.4 * 400, 0.4 * 80
    raw, rows = rows_of_phase(SMALL, "train", 1)
    eot = "<|endoftext|>"
    expected = sorted((ids(tok, raw.get_prompt_and_chosen(r) + eot), ids(tok, raw.get_prompt_and_rejected(r) + eot))
                      for r in rows)
    assert sorted((tuple(c.tolist()), tuple(r.tolist())) for c, r in train.samples) == expected

    samples = train.samples[:3]
    batch = du.DataCollatorReward(tok.pad_token_id, 64)(samples)
    width = batch["input_ids"].shape[1]
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (6, width) and width % 8 == 0
    for i, seq in enumerate([c for c, _ in samples] + [r for _, r in samples]):  # chosen rows, then rejected
        assert batch["input_ids"][i, :len(seq)].tolist() == seq.tolist()
        assert batch["attention_mask"][i].sum() == len(seq)
        assert (batch["input_ids"][i, len(seq):] == tok.pad_token_id).all()


# --------------------------------------------------------------------------- phase 3
def test_phase3_prompts_dropped_over_limit_and_left_padded(tmp_path, tok):
    logs = []
    limit = 12
    train, _ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", str(tmp_path), 3, SEED, tok, limit, log=logs.append)
    raw, rows = rows_of_phase(SMALL, "train", 2)
    lengths = [len(ids(tok, raw.get_prompt(r))) for r in rows]
    too_long = sum(n > limit for n in lengths)
    assert 0 < too_long < len(rows)  # the limit bites, but not everywhere
    assert len(train) == len(rows) - too_long
    assert sorted(len(s["input_ids"]) for s in train.samples) == sorted(n for n in lengths if n <= limit)
    assert train.stats["skipped"] == {f"prompt longer than {limit} tokens": too_long}
    assert any(f"phase 3 train: kept {len(train)} rows, skipped {too_long} × prompt longer than {limit} tokens" in m
               for m in logs)

    samples = train.samples[:5]
    batch = du.DataCollatorRLHF(limit, tok.pad_token_id)(samples)
    assert batch["prompt"].shape == batch["prompt_att_mask"].shape == (5, limit)  # exactly the limit
    for i, sample in enumerate(samples):
        s = sample["input_ids"]
        assert batch["prompt"][i, limit - len(s):].tolist() == s.tolist()
        assert batch["prompt_att_mask"][i].tolist() == [0] * (limit - len(s)) + [1] * len(s)
        # the prompt's text and its dataset row travel with it, for reward functions
        assert list(ids(tok, batch["prompt_text"][i])) == s.tolist()
        row = batch["rows"][i]
        assert row["prompt"] == batch["prompt_text"][i] and row["reference_answer"] == row["chosen"]
        assert set(row) == {"prompt", "chosen", "rejected", "kind", "reference_answer"}


def test_phase3_rows_carry_gsm8k_reference_answers(tmp_path, tok):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {n} + 1?", "answer": f"{n} + 1 = <<{n}+1>>.\n#### {n + 1}",
                                        "meta": {"nested": True}}) + "\n" for n in range(40)))
    train, _ = du.create_prompt_dataset(-1, [str(path)], "0,0,1", str(tmp_path / "cache"), 3, SEED, tok, 64)
    for sample in train.samples:
        row = sample["row"]
        n = int(row["question"].split()[2])
        assert row["reference_answer"].endswith(f"#### {n + 1}") and row["meta"] == {"nested": True}  # JSON values
        assert sample["prompt"].endswith("Assistant:") and row["question"] in sample["prompt"]


def test_rlhf_collator_hand_example():
    batch = du.DataCollatorRLHF(5, pad_token_id=9)([torch.tensor([1, 2, 3]), torch.tensor([4])])
    assert batch["prompt"].tolist() == [[9, 9, 1, 2, 3], [9, 9, 9, 9, 4]]
    assert batch["prompt_att_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert batch["prompt_text"] == ["", ""] and batch["rows"] == [{}, {}]  # bare tensors: no text, no row
    batch = du.DataCollatorRLHF(3, pad_token_id=9)([{"input_ids": torch.tensor([1, 2]), "prompt": "ab", "row": {"k": 1}}])
    assert batch["prompt"].tolist() == [[9, 1, 2]] and batch["prompt_text"] == ["ab"] and batch["rows"] == [{"k": 1}]


# --------------------------------------------------------------------------- sft-only data, 9:1 split
def test_sft_only_data_goes_whole_into_phase1_only(tmp_path, tok):
    sft = tmp_path / "sft.jsonl"
    write_jsonl(sft, qa_rows(10, "sft"))  # no eval file: split 9:1 -> 9 train rows, 1 eval row
    out = str(tmp_path / "out")
    train, eval_ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", out, 1, SEED, tok, 64,
                                            sft_only_data_path=[str(sft)])
    assert (len(train), len(eval_)) == (80 + 9, 16 + 1)
    texts = [tok.decode(s) for s in train.samples]
    assert sum("It is sft" in t for t in texts) == 9
    train2, eval2 = du.create_prompt_dataset(-1, [SMALL], "2,4,4", out, 2, SEED, tok, 64,
                                             sft_only_data_path=[str(sft)])
    assert (len(train2), len(eval2)) == (160, 32)
    assert not any("sft" in tok.decode(c) for c, _ in train2.samples)


def test_nine_to_one_split_for_a_set_without_eval(tmp_path, tok):
    data = tmp_path / "twenty.jsonl"
    write_jsonl(data, qa_rows(20))
    train, eval_ = du.create_prompt_dataset(-1, [str(data)], "1,0,0", str(tmp_path / "out"), 1, SEED, tok, 64)
    # perm = arange(20) shuffled with RandomState(1234):
    #   [3, 13, 2, 16, 14, 5, 4, 0, 8, 18, 17, 11, 10, 9, 7, 1, 19, 12, 6, 15]
    # 9:1 -> b = [0, 18, 20]: eval = rows 6 and 15, train = the other 18
    def row_numbers(dataset):
        return sorted(int(re.search(r"It is row (\d+)\.", tok.decode(s)).group(1)) for s in dataset.samples)

    assert row_numbers(eval_) == [6, 15]
    assert row_numbers(train) == sorted(set(range(20)) - {6, 15})


# --------------------------------------------------------------------------- the cache
class CountingIds:
    def __init__(self):
        self.calls = 0
        self.real = du._ids

    def __call__(self, *a, **k):
        self.calls += 1
        return self.real(*a, **k)


def cache_files(out):
    return sorted(f for f in os.listdir(out) if f.endswith(".pt"))


def test_cache_reused_then_invalidated_by_eot_and_by_local_file_edits(tmp_path, tok, monkeypatch):
    counter = CountingIds()
    monkeypatch.setattr(du, "_ids", counter)
    data = tmp_path / "local.jsonl"
    write_jsonl(data, qa_rows(30))
    out = str(tmp_path / "out")

    def build(eot="<|endoftext|>"):
        counter.calls = 0
        train, _ = du.create_prompt_dataset(-1, [str(data), SMALL], "2,4,4", out, 1, SEED, tok, 64,
                                            end_of_conversation_token=eot)
        return train, counter.calls

    first, calls = build()
    assert calls > 0 and len(cache_files(out)) == 2
    mtimes = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in cache_files(out)}
    again, calls = build()
    assert calls == 0  # nothing tokenised: read from the cache
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in cache_files(out)} == mtimes
    assert [s.tolist() for s in again.samples] == [s.tolist() for s in first.samples]

    other_eot, calls = build(eot="<|eot|>")  # the reference's key ignores the eot token
    assert calls > 0 and len(cache_files(out)) == 4
    assert not any(s.tolist() == t.tolist() for s, t in zip(other_eot.samples, first.samples))

    write_jsonl(data, qa_rows(40, "changed"))  # edit the local source
    edited, calls = build()
    assert calls > 0
    texts = [tok.decode(s) for s in edited.samples]
    assert any("changed" in t for t in texts) and not any("It is row" in t for t in texts)


def test_cache_is_keyed_by_content_not_by_size_and_modification_time(tmp_path, tok):
    """chosen and rejected swapped in place: the same size, the modification time set back; a cache keyed on
    path + size + mtime would hand back the old pairs, reversed preferences."""
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f" Human: Describe thing {i}. Assistant:", "chosen": " It is good.",
             "rejected": " It is bad!"} for i in range(40)]
    write_jsonl(data, rows)
    out = str(tmp_path / "out")
    first, _ = du.create_prompt_dataset(-1, [str(data)], "0,1,0", out, 2, SEED, tok, 64)
    stat = os.stat(data)
    write_jsonl(data, [dict(r, chosen=r["rejected"], rejected=r["chosen"]) for r in rows])
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(data).st_size == stat.st_size and os.stat(data).st_mtime_ns == stat.st_mtime_ns
    swapped, _ = du.create_prompt_dataset(-1, [str(data)], "0,1,0", out, 2, SEED, tok, 64)
    assert swapped.cache_key != first.cache_key and len(cache_files(out)) == 4
    assert sorted(tok.decode(c) for c, _ in swapped.samples) == sorted(tok.decode(r) for _, r in first.samples)


@pytest.mark.parametrize("damage", ["truncated", "payload", "not_a_cache"])
def test_a_damaged_or_planted_cache_is_rebuilt_and_runs_nothing(tmp_path, tok, damage):
    out = str(tmp_path / "out")
    first, _ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", out, 1, SEED, tok, 64)
    train_file = os.path.join(out, [f for f in cache_files(out) if f.startswith("train")][0])
    marker = tmp_path / "payload-ran"
    if damage == "truncated":
        with open(train_file, "r+b") as f:
            f.truncate(os.path.getsize(train_file) // 2)
    elif damage == "payload":
        torch.save({"samples": [], "stats": {}, "x": Payload(marker)}, train_file)
    else:
        torch.save([1, 2, 3], train_file)
    lines = []
    again, _ = du.create_prompt_dataset(-1, [SMALL], "2,4,4", out, 1, SEED, tok, 64, log=lines.append)
    assert any("is damaged or holds more than data" in line and "rebuilding it" in line for line in lines), lines
    assert [s.tolist() for s in again.samples] == [s.tolist() for s in first.samples]
    assert not marker.exists()


# --------------------------------------------------------------------------- real data
def test_hh_rlhf_file_through_the_same_code_path(tmp_path, tok):
    path = shared_data("hh-rlhf", "harmless-base-test.jsonl.gz")
    train, eval_ = du.create_prompt_dataset(-1, [str(path)], "2,4,4", str(tmp_path), 2, SEED, tok, 512)
    # 2312 rows, no eval split: 9:1 -> 2081 train (2080.8) / 231 eval; phase 2 share 0.4:
    # train b = [0, 417, 1249, 2081] -> 832 pairs, eval b = [0, 47, 139, 231] -> 92 pairs
    assert len(train) + sum(train.stats["skipped"].values()) == 832
    assert len(eval_) + sum(eval_.stats["skipped"].values()) == 92
    assert len(train) > 600 and len(eval_) > 60  # pairs skipped: identical after truncation to 512, empty answers
    for chosen, rejected in train.samples[:20]:
        assert len(chosen) <= 512 and len(rejected) <= 512 and not torch.equal(chosen, rejected)
        text = tok.decode(chosen)
        assert "\n\nHuman:" in text and "\n\nAssistant:" in text


def test_check_data_sources_reads_local_files_but_not_the_hub(tmp_path, monkeypatch):
    from utils.data import hub_datasets
    from utils.errors import UserInputError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b"}\n{"prompt": oops}\n')
    with pytest.raises(UserInputError, match="line 2"):
        du.check_data_sources([SMALL, str(bad)], str(tmp_path), SEED)

    def no_hub(*a, **k):
        raise AssertionError("the hub must not be contacted")

    monkeypatch.setattr(hub_datasets, "_load_hub", no_hub)
    du.check_data_sources(["Dahoas/rm-static", SMALL], str(tmp_path), SEED)
    with pytest.raises(UserInputError, match="not a supported dataset name"):
        du.check_data_sources(["nope/nothing"], str(tmp_path), SEED)


def test_batches_are_rounded_to_128_on_a_gpu_and_8_on_a_cpu():
    assert du.pad_multiple(torch.device("cuda", 0)) == 128 and du.pad_multiple(torch.device("cpu")) == 8
    samples = [torch.arange(1, 101), torch.arange(1, 31)]
    assert du.DataCollatorSFT(0, 512, 128)(samples)["input_ids"].shape == (2, 128)
    assert du.DataCollatorSFT(0, 512)(samples)["input_ids"].shape == (2, 104)
    assert du.DataCollatorSFT(0, 120, 128)(samples)["input_ids"].shape == (2, 120)  # never beyond max_seq_len
    pairs = [(torch.arange(1, 200), torch.arange(1, 50))]
    assert du.DataCollatorReward(0, 512, 128)(pairs)["input_ids"].shape == (2, 256)


def test_one_dataset_is_shuffled_like_a_blend():
    """Deliberate difference: DeepSpeed-Chat leaves a single dataset in split order; here one dataset and a
    blend take the same seeded shuffle (so a partial evaluation, --eval_iters, sees another subset)."""
    one = du._concat_shuffled([du.PromptDataset(list(range(10)), 2, {"skipped": {"empty": 1}})], 1234, 2)
    assert sorted(one.samples) == list(range(10)) and one.samples != list(range(10))
    assert one.samples == [7, 2, 9, 1, 0, 8, 4, 5, 6, 3] and one.stats == {"kept": 10, "skipped": {"empty": 1}}


def test_sft_only_sets_are_mixed_in_after_the_blend_as_the_reference():
    """As DeepSpeed-Chat: the --data_path sets are concatenated and shuffled with the seed, then the
    --sft_only_data_path sets are appended and the whole is shuffled again with the seed (a single shuffle of
    everything, as before, gave [101, 2, 1, 0, 100, 10, 11, 12, 3])."""
    def dataset(rows):
        return du.PromptDataset(list(rows), 1, {"skipped": {}})

    data, sft = [dataset([0, 1, 2, 3]), dataset([10, 11, 12])], [dataset([100, 101])]
    # RandomState(1234).shuffle(arange(7)) orders the blend [2, 1, 12, 0, 10, 11, 3]; with the sft rows appended,
    # RandomState(1234).shuffle(arange(9)) = [8, 2, 1, 0, 7, 4, 5, 6, 3] picks:
    assert du.blend(data, [], SEED, 1).samples == [2, 1, 12, 0, 10, 11, 3]
    assert du.blend(data, sft, SEED, 1).samples == [101, 12, 1, 2, 100, 10, 11, 3, 0]


class CharTokenizer:
    """One id per character, BOS 0 first in each row (as OPT's tokenizer adds its BOS)."""

    def __call__(self, texts):
        return {"input_ids": [[0] + [ord(c) for c in text] for text in texts]}


def test_unsupervised_text_drops_blank_rows_and_packs_one_stream(tmp_path):
    """Deliberate difference (step 3's --unsupervised_dataset_name): DeepSpeed-Chat keeps blank rows (each a lone
    BOS token) and packs every 1000-row `datasets.map` batch on its own, dropping each
    batch's tail (or keeping a batch shorter than a block as one short sample); here blank rows are dropped and the
    whole stream is packed, only its last tail dropped."""
    from utils.data.unsupervised import TOKENIZE_BATCH, get_unsupervised_data, pack_tokens

    write_jsonl(tmp_path / "text.jsonl", [{"text": "ab"}, {"text": ""}, {"text": " "}, {"text": "cd"}])
    data = get_unsupervised_data(str(tmp_path / "text.jsonl"), None, CharTokenizer(), block_size=3,
                                 log=lambda m: None)
    # [0 a b] [0 c d]; with the blank rows kept: [0 a b 0 0 32 0 c d] -> [0 a b] [0 0 32] [0 c d]
    assert [data[i]["input_ids"].tolist() for i in range(len(data))] == [[0, 97, 98], [0, 99, 100]]
    # 1001 rows of 2 tokens = 2002 tokens: 667 full blocks of 3 across the 1000-row boundary (per-batch packing
    # gives 666 blocks from the first 1000 rows' 2000 tokens, then the last row as a short [0, 97] sample)
    assert TOKENIZE_BATCH == 1000
    blocks = pack_tokens(["a"] * 1001, CharTokenizer(), block_size=3)
    assert blocks.shape == (667, 3) and blocks[-1].tolist() == [0, 97, 0]  # tokens 1998-2000 of 0-2001
