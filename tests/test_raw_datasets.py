"""Raw-dataset adapters: every named adapter on in-memory rows, every local format,
the real shared files, and the user-facing errors. No downloads."""
import gzip
import json
import os
from pathlib import Path

import pytest

from utils.data import hub_datasets as hub
from utils.data import raw_datasets as rd
from utils.data.local_datasets import LocalJsonFileDataset, LocalPathDataset
from utils.data.prompt_dataset import RAW_FORMAT_VERSION
from utils.errors import UserInputError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def strings(ds, row):
    return (ds.get_prompt(row), ds.get_chosen(row), ds.get_rejected(row),
            ds.get_prompt_and_chosen(row), ds.get_prompt_and_rejected(row))


def make(cls, tmp_path, train, eval=None, **kw):
    return cls.from_rows(train, eval, output_path=str(tmp_path / "out"), seed=1234, **kw)


# --------------------------------------------------------------------------- hub adapters
def test_dahoas_rm_static_and_full_hh(tmp_path):
    row = {"prompt": "\n\nHuman: Hi there?\n\nAssistant:", "response": " Hello.",
           "chosen": " Hello.", "rejected": " Go away."}
    for cls in (hub.DahoasRmstaticDataset, hub.DahoasFullhhrlhfDataset):
        ds = make(cls, tmp_path, [row, row], [row])
        assert strings(ds, row) == (
            "\n\nHuman: Hi there?\n\nAssistant:", " Hello.", " Go away.",
            "\n\nHuman: Hi there?\n\nAssistant: Hello.", "\n\nHuman: Hi there?\n\nAssistant: Go away.")
        assert len(ds.get_train_data()) == 2 and len(ds.get_eval_data()) == 1


def test_dahoas_synthetic(tmp_path):
    row = {"prompt": "Name a fruit.", "chosen": "Apple.", "rejected": "Car."}
    ds = make(hub.DahoasSyntheticinstructgptjpairwiseDataset, tmp_path, [row] * 3)
    assert strings(ds, row) == (" Human: Name a fruit. Assistant:", " Apple.", " Car.",
                                " Human: Name a fruit. Assistant: Apple.",
                                " Human: Name a fruit. Assistant: Car.")


def test_yitingxie(tmp_path):
    row = {"prompt": "\n\nHuman: Why turkeys?\n\n", "chosen": "Assistant: Tradition.",
           "rejected": "Assistant: No idea."}
    ds = make(hub.YitingxieRlhfrewarddatasetsDataset, tmp_path, [row], [row])
    assert strings(ds, row) == (
        "\n\nHuman: Why turkeys?\n\nAssistant:", " Tradition.", " No idea.",
        "\n\nHuman: Why turkeys?\n\nAssistant: Tradition.",
        "\n\nHuman: Why turkeys?\n\nAssistant: No idea.")


def test_webgpt(tmp_path):
    a = {"question": {"full_text": "Why is the sky blue?"}, "answer_0": "Rayleigh scattering [1].",
         "answer_1": "Magic [2] (source) really.", "score_0": 1.0, "score_1": -1.0}
    b = dict(a, score_0=-0.5, score_1=0.5)
    tie = dict(a, score_0=0.0, score_1=0.0)
    ds = make(hub.OpenaiWebgptcomparisonsDataset, tmp_path, [a, b, tie])
    p = " Human: Why is the sky blue? Assistant:"
    assert strings(ds, a) == (p, " Rayleigh scattering.", " Magic really.",
                              p + " Rayleigh scattering.", p + " Magic really.")
    assert strings(ds, b)[1:3] == (" Magic really.", " Rayleigh scattering.")
    assert strings(ds, tie)[1:3] == (" Rayleigh scattering.", " Magic really.")  # ties: answer_0


def test_shp(tmp_path):
    a = {"history": "Best pizza?", "human_ref_A": "Margherita", "human_ref_B": "Pineapple", "labels": 1}
    b = dict(a, labels=0)
    ds = make(hub.StanfordnlpSHPDataset, tmp_path, [a, b], [a])
    p = " Human: Best pizza? Assistant:"
    assert strings(ds, a) == (p, " Margherita", " Pineapple", p + " Margherita", p + " Pineapple")
    assert strings(ds, b)[1:3] == (" Pineapple", " Margherita")


def test_pvduy_role_tags_with_colon_only_and_a_leading_space(tmp_path):
    # deliberate difference: the reference replaces every "USER" ("USERname" -> "Humanname") and adds no
    # leading space, so its prompts do not start like every other adapter's " Human: ..."
    row = {"prompt": "USER: Hi ASSISTANT: Hello! USER: Name a USERname. ASSISTANT:", "label": "bob42"}
    ds = make(hub.PvduySharegptalpacaoavicunaformatDataset, tmp_path, [row], [row])
    p = " Human: Hi Assistant: Hello! Human: Name a USERname. Assistant:"
    assert strings(ds, row) == (p, " bob42", None, p + " bob42", None)


def test_zhihu(tmp_path):
    row = {"INSTRUCTION": "什么是猫？", "RESPONSE": "一种动物。", "SOURCE": "Zhihu", "METADATA": "{}"}
    ds = make(hub.Wangrui6ZhihuKOLDataset, tmp_path, [row] * 3)
    assert strings(ds, row) == (" Human: 什么是猫？ Assistant:", " 一种动物。", None,
                                " Human: 什么是猫？ Assistant: 一种动物。", None)


@pytest.mark.parametrize("cls", [hub.CohereMiraclzhqueries2212Dataset, hub.CohereMiracljaqueries2212Dataset])
def test_miracl(tmp_path, cls):
    row = {"query_id": "1", "query": "q?",
           "positive_passages": [{"docid": "a", "text": "good", "title": "t"}, {"docid": "b", "text": "x", "title": ""}],
           "negative_passages": [{"docid": "c", "text": "bad", "title": "t"}]}
    no_neg = dict(row, negative_passages=[])
    ds = make(cls, tmp_path, [row, no_neg], [row])
    p = " Human: q? Assistant:"
    assert strings(ds, row) == (p, " good", " bad", p + " good", p + " bad")
    assert strings(ds, no_neg)[2:] == (None, p + " good", None)


def test_hc3_chinese(tmp_path):
    row = {"id": "0", "question": "天为什么是蓝的？", "human_answers": ["散射。", "other"], "chatgpt_answers": ["x"]}
    empty = dict(row, human_answers=[])
    ds = make(hub.HelloSimpleAIHC3ChineseDataset, tmp_path, [row, empty, row])
    p = " Human: 天为什么是蓝的？ Assistant:"
    assert strings(ds, row) == (p, " 散射。", None, p + " 散射。", None)
    assert ds.get_chosen(empty) is None and ds.get_prompt_and_chosen(empty) is None
    assert hub.HelloSimpleAIHC3ChineseDataset.hub_config == "all"


@pytest.mark.parametrize("cls,lang", [(hub.MkqaChineseDataset, "zh_cn"), (hub.MkqaJapaneseDataset, "ja")])
def test_mkqa(tmp_path, cls, lang):
    row = {"example_id": 1, "queries": {"en": "capital of France?", "zh_cn": "法国首都？", "ja": "フランスの首都？"},
           "answers": {"en": [{"text": "Paris", "type": 1}], "zh_cn": [{"text": "巴黎", "type": 1}],
                       "ja": [{"text": "パリ", "type": 1}]}}
    ds = make(cls, tmp_path, [row] * 3)
    q, a = row["queries"][lang], row["answers"][lang][0]["text"]
    p = f" Human: {q} Assistant:"
    assert strings(ds, row) == (p, " " + a, None, p + " " + a, None)
    assert cls.hub_id == "mkqa"


def test_qg_jaquad(tmp_path):
    row = {"question": "質問？", "sentence": "文。", "paragraph": "段落。", "answer": "答え"}
    ds = make(hub.LmqgQgjaquadDataset, tmp_path, [row], [row])
    assert strings(ds, row) == (" Human: 質問？ Assistant:", " 文。", None, " Human: 質問？ Assistant: 文。", None)


def test_qag_jaquad(tmp_path):
    row = {"questions": ["一つ目？", "二つ目？"], "answers": ["a", "b"], "paragraph": "段落。",
           "questions_answers": "..."}
    ds = make(hub.LmqgQagjaquadDataset, tmp_path, [row], [row])
    assert strings(ds, row) == (" Human: 一つ目？ Assistant:", " 段落。", None,
                                " Human: 一つ目？ Assistant: 段落。", None)


def test_every_hub_name_dispatches_without_download(tmp_path):
    for name, cls in hub.HUB_DATASETS:
        ds = rd.get_raw_dataset(name, str(tmp_path), 1234, -1)
        assert type(ds) is cls and ds.dataset_name == name
        assert name in ds.fingerprint() and "/" not in ds.dataset_name_clean
    assert type(rd.get_raw_dataset("my-mirror/Dahoas/rm-static", str(tmp_path), 1, 0)) is hub.DahoasRmstaticDataset


def test_hub_offline_error(tmp_path, monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'Dahoas/rm-static' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    ds = rd.get_raw_dataset("Dahoas/rm-static", str(tmp_path), 1234, -1)
    with pytest.raises(UserInputError) as e:
        ds.get_train_data()
    msg = str(e.value)
    assert "Dahoas/rm-static" in msg and "hub" in msg and "local path" in msg


def test_hub_load_path_uses_splits_and_config(tmp_path, monkeypatch):
    import datasets
    calls = []
    rows = [{"id": str(i), "question": f"q{i}", "human_answers": [f"a{i}"], "chatgpt_answers": []} for i in range(20)]

    def fake(name, *config):
        calls.append((name, config))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    monkeypatch.setattr(datasets, "load_dataset", fake)
    ds = rd.get_raw_dataset("Hello-SimpleAI/HC3-Chinese", str(tmp_path), 1234, -1)
    train, eval_ = ds.get_train_data(), ds.get_eval_data()
    assert calls == [("Hello-SimpleAI/HC3-Chinese", ("all",))]
    assert (len(train), len(eval_)) == (18, 2)
    assert ds.get_chosen(train[0]).startswith(" a")


def test_hub_adapter_missing_column(tmp_path):
    with pytest.raises(UserInputError) as e:  # from_rows validates at once
        make(hub.StanfordnlpSHPDataset, tmp_path, [{"history": "x", "human_ref_A": "a", "labels": 1}])
    assert "stanfordnlp/SHP" in str(e.value) and "human_ref_B" in str(e.value) and "row 1" in str(e.value)


def test_hub_name_that_is_a_local_save_to_disk_folder(tmp_path, monkeypatch):
    import datasets
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "chosen": f" c{i}", "rejected": f" r{i}"} for i in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk("Dahoas/rm-static")
    ds = rd.get_raw_dataset("Dahoas/rm-static", str(tmp_path / "out"), 1234, -1)
    assert ds.fingerprint().startswith("local:")
    assert len(ds.get_train_data()) == 4 and len(ds.get_eval_data()) == 2
    assert ds.get_prompt_and_chosen(ds.get_train_data()[1]) == "\n\nHuman: q1\n\nAssistant: c1"


# --------------------------------------------------------------------------- 9:1 split
def test_nine_to_one_split(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(50)]
    ds = make(hub.DahoasSyntheticinstructgptjpairwiseDataset, tmp_path, rows)
    train, eval_ = ds.get_train_data(), ds.get_eval_data()
    assert (len(train), len(eval_)) == (45, 5)
    seen = sorted(r["prompt"] for r in list(train) + list(eval_))
    assert seen == sorted(r["prompt"] for r in rows)
    files = sorted(os.listdir(tmp_path / "out"))
    assert files == [f"Dahoas_synthetic_instruct_gptj_pairwise_seed1234_train_eval_9,1_{i}.npy" for i in (0, 1)]
    again = make(hub.DahoasSyntheticinstructgptjpairwiseDataset, tmp_path, rows)
    assert list(again.get_eval_data()) == list(eval_)


# --------------------------------------------------------------------------- local/jsonfile
def test_local_jsonfile(tmp_path, monkeypatch):
    """Deliberate difference: data/ of the current folder (DeepSpeed-Chat: data/ of its own checkout)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError) as e:
        rd.get_raw_dataset("local/jsonfile", str(tmp_path / "out"), 1234, -1)
    assert "local/jsonfile" in str(e.value) and "train.json" in str(e.value)
    (tmp_path / "data").mkdir()
    row = {"prompt": "Human: Hi Assistant:", "chosen": "Hello", "rejected": "Bye"}
    (tmp_path / "data" / "train.json").write_text(json.dumps([row, dict(row, rejected=None)]))
    with pytest.raises(UserInputError) as e:
        rd.get_raw_dataset("local/jsonfile", str(tmp_path / "out"), 1234, -1)
    assert "eval.json" in str(e.value)
    (tmp_path / "data" / "eval.json").write_text(json.dumps([row]))
    ds = rd.get_raw_dataset("local/jsonfile", str(tmp_path / "out"), 1234, -1)
    assert type(ds) is LocalJsonFileDataset
    train = ds.get_train_data()
    assert len(train) == 2 and len(ds.get_eval_data()) == 1
    assert strings(ds, train[0]) == (" Human: Hi Assistant:", " Hello", " Bye",
                                     " Human: Hi Assistant: Hello", " Human: Hi Assistant: Bye")
    assert ds.get_rejected(train[1]) is None and ds.get_prompt_and_rejected(train[1]) is None
    (tmp_path / "data" / "eval.json").write_text(json.dumps([{"prompt": "x", "chosen": 3}]))
    with pytest.raises(UserInputError) as e:
        rd.get_raw_dataset("local/jsonfile", str(tmp_path / "out"), 1234, -1).get_eval_data()
    assert "eval.json" in str(e.value) and "'chosen'" in str(e.value) and "row 1" in str(e.value)


# --------------------------------------------------------------------------- local paths
PC_ROWS = [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},
           {"prompt": " Human: Hi Assistant:", "chosen": " Hello", "rejected": None},
           {"prompt": "Name a colour.", "chosen": "Red", "rejected": "Seven"}]


def load(path, tmp_path):
    return rd.get_raw_dataset(str(path), str(tmp_path / "out"), 1234, -1)


def all_rows(ds):
    return list(ds.get_train_data()) + list(ds.get_eval_data())


def check_pc(ds):
    rows = {ds.get_prompt(r): r for r in all_rows(ds)}
    assert len(rows) == 3
    r = rows[" Human: What is 2+2? Assistant:"]
    assert strings(ds, r) == (" Human: What is 2+2? Assistant:", " 4", " 5",
                              " Human: What is 2+2? Assistant: 4", " Human: What is 2+2? Assistant: 5")
    r = rows[" Human: Hi Assistant:"]
    assert strings(ds, r) == (" Human: Hi Assistant:", " Hello", None, " Human: Hi Assistant: Hello", None)


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("fmt", ["json", "jsonlines.json", "jsonl", "jsonl.gz", "json.gz", "parquet"])
def test_local_file_formats(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(PC_ROWS, indent=2))
    elif fmt == "parquet":
        write_parquet(path, PC_ROWS)
    elif fmt == "json.gz":
        with gzip.open(path, "wt") as f:
            json.dump(PC_ROWS, f)
    else:
        write_jsonl(path, PC_ROWS, gzip.open if fmt.endswith(".gz") else open)
    ds = load(path, tmp_path)
    assert type(ds) is LocalPathDataset
    assert (len(ds.get_train_data()), len(ds.get_eval_data())) == (3, 0)  # 9:1 of 3 rows
    check_pc(ds)
    assert ds.fingerprint().startswith("local:") and str(path) in ds.fingerprint()


def test_save_to_disk_dataset_and_dict(tmp_path):
    import datasets
    datasets.Dataset.from_list(PC_ROWS).save_to_disk(str(tmp_path / "single"))
    ds = load(tmp_path / "single", tmp_path)
    check_pc(ds)
    assert isinstance(ds.get_train_data(), datasets.Dataset)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(PC_ROWS[:2]),
                          "validation": datasets.Dataset.from_list(PC_ROWS[2:])}).save_to_disk(str(tmp_path / "dd"))
    ds = load(tmp_path / "dd", tmp_path)
    assert (len(ds.get_train_data()), len(ds.get_eval_data())) == (2, 1)
    check_pc(ds)
    assert ds.get_prompt(ds.get_eval_data()[0]) == " Human: Name a colour. Assistant:"
    # an all-null optional column; the 9:1 select must not write into the folder
    rows = [{"prompt": f"q{i}", "chosen": f"c{i}", "rejected": None} for i in range(20)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "nulls"))
    listing = sorted(os.listdir(tmp_path / "nulls"))
    ds = load(tmp_path / "nulls", tmp_path)
    train = ds.get_train_data()
    assert (len(train), len(ds.get_eval_data())) == (18, 2)
    assert ds.get_rejected(train[0]) is None and ds.get_prompt_and_rejected(train[0]) is None
    assert sorted(os.listdir(tmp_path / "nulls")) == listing
    assert load(tmp_path / "nulls", tmp_path).fingerprint() == ds.fingerprint()


def test_save_to_disk_other_layout_and_bad_type(tmp_path):
    import datasets
    datasets.Dataset.from_list([{"instruction": "Say hi", "input": "", "output": "hi"}] * 2).save_to_disk(
        str(tmp_path / "alp"))
    ds = load(tmp_path / "alp", tmp_path)
    assert strings(ds, all_rows(ds)[0]) == (" Human: Say hi Assistant:", " hi", None,
                                             " Human: Say hi Assistant: hi", None)
    datasets.Dataset.from_list([{"prompt": "p", "chosen": 1}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(UserInputError) as e:
        load(tmp_path / "bad", tmp_path).get_train_data()
    assert "'chosen'" in str(e.value) and "strings" in str(e.value) and "bad" in str(e.value)


def test_folder_of_split_files(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", PC_ROWS[:2])
    (folder / "test.json").write_text(json.dumps(PC_ROWS[2:]))
    (folder / "training_args.json").write_text("{}")  # not a split file
    ds = load(folder, tmp_path)
    assert (len(ds.get_train_data()), len(ds.get_eval_data())) == (2, 1)
    check_pc(ds)
    # hub-snapshot style: data/train-*.parquet shards, no eval -> 9:1
    snap = tmp_path / "snap"
    (snap / "data").mkdir(parents=True)
    rows = [dict(PC_ROWS[0], prompt=f"q{i}") for i in range(20)]
    write_parquet(snap / "data" / "train-00000-of-00002.parquet", rows[:10])
    write_parquet(snap / "data" / "train-00001-of-00002.parquet", rows[10:])
    ds = load(snap, tmp_path)
    assert (len(ds.get_train_data()), len(ds.get_eval_data())) == (18, 2)
    assert len(ds.fingerprint().split(";")) == 2


def test_rm_static_style(tmp_path):
    rows = [
        {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: How are you?\n\nAssistant: Fine, thanks.",
         "rejected": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: How are you?\n\nAssistant: Go away."},
        {"chosen": "\n\nHuman: A?\n\nAssistant: B\n\nHuman: C?\n\nAssistant: D",
         "rejected": "\n\nHuman: A?\n\nAssistant: X\n\nHuman: Y?\n\nAssistant: Z"},  # diverges early
    ]
    path = tmp_path / "hh.jsonl"
    write_jsonl(path, rows)
    ds = load(path, tmp_path)
    got = {ds.get_prompt(r): r for r in all_rows(ds)}
    p = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: How are you?\n\nAssistant:"
    assert strings(ds, got[p]) == (p, " Fine, thanks.", " Go away.", rows[0]["chosen"], rows[0]["rejected"])
    p2 = "\n\nHuman: A?\n\nAssistant: B\n\nHuman: C?\n\nAssistant:"
    assert strings(ds, got[p2])[:3] == (p2, " D", " Z")


def test_llama_factory_layout(tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": "Hi"}],
         "chosen": {"from": "gpt", "value": "Hello!"}, "rejected": {"from": "gpt", "value": "What?"}},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "A?"},
                           {"from": "gpt", "value": "B."}, {"from": "human", "value": "C?"}],
         "chosen": {"from": "gpt", "value": "D."}, "rejected": {"from": "gpt", "value": "E."}},
    ]
    path = tmp_path / "dpo.json"
    path.write_text(json.dumps(rows))
    ds = load(path, tmp_path)
    got = {ds.get_chosen(r): r for r in all_rows(ds)}
    assert strings(ds, got[" Hello!"]) == (" Human: Hi Assistant:", " Hello!", " What?",
                                           " Human: Hi Assistant: Hello!", " Human: Hi Assistant: What?")
    p = " Be brief. Human: A? Assistant: B. Human: C? Assistant:"
    assert strings(ds, got[" D."]) == (p, " D.", " E.", p + " D.", p + " E.")
    # SFT conversations (no chosen): the last gpt turn is the answer
    sft = [{"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}]
    (tmp_path / "sft.json").write_text(json.dumps(sft))
    ds = load(tmp_path / "sft.json", tmp_path)
    assert strings(ds, all_rows(ds)[0]) == (" Human: Q Assistant:", " A", None, " Human: Q Assistant: A", None)
    bad = [dict(rows[0], conversations=[{"from": "observation", "value": "x"}])]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserInputError) as e:
        load(tmp_path / "bad.json", tmp_path).get_train_data()
    assert "bad.json" in str(e.value) and "conversations[0].from" in str(e.value) and "observation" in str(e.value)


def test_alpaca_layouts(tmp_path):
    rows = [{"instruction": "Translate.", "input": "bonjour", "output": "hello"},
            {"instruction": "Say hi.", "input": "", "output": "hi"},
            {"instruction": "And?", "output": "then", "history": [["First?", "One."]], "system": "Sys."}]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(rows))
    ds = load(path, tmp_path)
    got = {ds.get_chosen(r): r for r in all_rows(ds)}
    assert strings(ds, got[" hello"]) == (" Human: Translate.\nbonjour Assistant:", " hello", None,
                                          " Human: Translate.\nbonjour Assistant: hello", None)
    assert ds.get_prompt(got[" hi"]) == " Human: Say hi. Assistant:"
    assert ds.get_prompt(got[" then"]) == " Sys. Human: First? Assistant: One. Human: And? Assistant:"
    pref = [{"instruction": "Pick.", "input": "", "chosen": "good", "rejected": "bad"}]
    (tmp_path / "pref.jsonl").write_text(json.dumps(pref[0]) + "\n")
    ds = load(tmp_path / "pref.jsonl", tmp_path)
    assert strings(ds, all_rows(ds)[0]) == (" Human: Pick. Assistant:", " good", " bad",
                                             " Human: Pick. Assistant: good", " Human: Pick. Assistant: bad")


def test_question_answer_layout(tmp_path):
    write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "answer": "2\n#### 2"}])
    ds = load(tmp_path / "qa.jsonl", tmp_path)
    assert strings(ds, all_rows(ds)[0]) == (" Human: 1+1? Assistant:", " 2\n#### 2", None,
                                             " Human: 1+1? Assistant: 2\n#### 2", None)


def test_empty_strings_pass_through(tmp_path):
    write_jsonl(tmp_path / "e.jsonl", [{"prompt": "q", "chosen": "", "rejected": ""}])
    ds = load(tmp_path / "e.jsonl", tmp_path)
    r = all_rows(ds)[0]
    assert strings(ds, r) == (" Human: q Assistant:", "", "", " Human: q Assistant:", " Human: q Assistant:")
    syn = make(hub.DahoasSyntheticinstructgptjpairwiseDataset, tmp_path, [{"prompt": "", "chosen": "", "rejected": "x"}])
    assert strings(syn, {"prompt": "", "chosen": "", "rejected": "x"}) == ("", "", " x", "", " x")


# --------------------------------------------------------------------------- real shared data
def test_real_hh_rlhf(tmp_path):
    path = SHARED / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    if not path.is_file():
        pytest.skip("shared data absent")
    ds = load(path, tmp_path)
    train, eval_ = ds.get_train_data(), ds.get_eval_data()
    assert len(train) + len(eval_) == 2312 and len(eval_) == round(2312 * 0.1)
    for row in (train[0], eval_[0], train[len(train) - 1]):
        assert ds.get_prompt(row).endswith("\n\nAssistant:") and ds.get_prompt(row).startswith("\n\nHuman:")
        assert not ds.get_chosen(row).startswith("\n\nHuman")
        assert ds.get_rejected(row) is not None
        assert ds.get_prompt_and_chosen(row) == ds.get_prompt(row) + ds.get_chosen(row)


def test_real_llama_factory_dpo(tmp_path):
    path = SHARED / "llama-factory-demo" / "dpo_en_demo.json"
    if not path.is_file():
        pytest.skip("shared data absent")
    ds = load(path, tmp_path)
    rows = all_rows(ds)
    assert len(rows) == 300
    for row in rows[:20]:
        assert ds.get_prompt(row).endswith(" Assistant:") and " Human: " in ds.get_prompt(row)
        assert ds.get_chosen(row).startswith(" ") and ds.get_rejected(row).startswith(" ")


# --------------------------------------------------------------------------- builtin
def test_builtin(tmp_path):
    from utils.data import builtin
    name = "builtin/preference-small"
    ds = rd.get_raw_dataset(name, str(tmp_path), 1234, -1)
    train, eval_ = ds.get_train_data(), ds.get_eval_data()
    assert (len(train), len(eval_)) == builtin.SIZES[name]
    row = train[0]
    assert strings(ds, row) == (row["prompt"], row["chosen"], row["rejected"],
                                row["prompt"] + row["chosen"], row["prompt"] + row["rejected"])
    assert ds.fingerprint() == f"builtin:{name}:v{builtin.VERSION}:raw{RAW_FORMAT_VERSION}"
    with pytest.raises(UserInputError) as e:
        rd.get_raw_dataset("builtin/nope", str(tmp_path), 1234, -1)
    assert "builtin/nope" in str(e.value) and "builtin/preference" in str(e.value)


# --------------------------------------------------------------------------- errors
def error_of(path, tmp_path):
    with pytest.raises(UserInputError) as e:
        load(path, tmp_path).get_train_data()
    return str(e.value)


def test_malformed_json_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(PC_ROWS[0]) + "\n\n" + '{"prompt": "x", "chosen": \n')
    msg = error_of(path, tmp_path)
    assert "broken.jsonl" in msg and "line 3" in msg and "malformed JSON" in msg


def test_malformed_json_list(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n {"prompt": "a", "chosen": "b"},\n {"prompt": oops}\n]')
    msg = error_of(path, tmp_path)
    assert "broken.json" in msg and "line 3" in msg


def test_missing_column(tmp_path):
    path = tmp_path / "missing.jsonl"
    write_jsonl(path, [PC_ROWS[0], {"prompt": "only a prompt", "rejected": "r"}])
    msg = error_of(path, tmp_path)
    assert "missing.jsonl" in msg and "row 2" in msg and "'chosen'" in msg and str(path) in msg
    hh = tmp_path / "hh.jsonl"
    write_jsonl(hh, [{"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"},
                     {"chosen": "\n\nHuman: a\n\nAssistant: b"}])
    msg = error_of(hh, tmp_path)
    assert "hh.jsonl" in msg and "row 2" in msg and "'rejected'" in msg
    (tmp_path / "nocols.json").write_text(json.dumps([{"text": "hello"}]))
    msg = error_of(tmp_path / "nocols.json", tmp_path)
    assert "nocols.json" in msg and "'text'" in msg and "prompt" in msg


def test_wrong_type(tmp_path):
    path = tmp_path / "types.json"
    path.write_text(json.dumps([PC_ROWS[0], PC_ROWS[2], {"prompt": "q", "chosen": 42}]))
    msg = error_of(path, tmp_path)
    assert "types.json" in msg and "row 3" in msg and "'chosen'" in msg and "int" in msg
    (tmp_path / "notobj.jsonl").write_text(json.dumps(PC_ROWS[0]) + "\n[1, 2]\n")
    msg = error_of(tmp_path / "notobj.jsonl", tmp_path)
    assert "notobj.jsonl" in msg and "line 2" in msg


def test_empty_files(tmp_path):
    for name, content in (("empty.jsonl", ""), ("blank.json", "  \n\n"), ("nolist.json", "[]")):
        (tmp_path / name).write_text(content)
        msg = error_of(tmp_path / name, tmp_path)
        assert name in msg and "empty" in msg
    with gzip.open(tmp_path / "empty.jsonl.gz", "wt"):
        pass
    assert "empty" in error_of(tmp_path / "empty.jsonl.gz", tmp_path)
    write_parquet(tmp_path / "empty.parquet", [])
    assert "empty.parquet" in error_of(tmp_path / "empty.parquet", tmp_path)


def test_unknown_name_and_missing_path(tmp_path):
    with pytest.raises(UserInputError) as e:
        rd.get_raw_dataset("someone/unknown-set", str(tmp_path), 1234, -1)
    msg = str(e.value)
    assert "someone/unknown-set" in msg and "Dahoas/rm-static" in msg and "local path" in msg and "exist" in msg
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(UserInputError) as e:
        rd.get_raw_dataset(str(missing), str(tmp_path), 1234, -1)
    assert str(missing) in str(e.value) and "exist" in str(e.value)


def test_unsupported_file_and_folder_without_train(tmp_path):
    (tmp_path / "data.csv").write_text("prompt,chosen\na,b\n")
    with pytest.raises(UserInputError) as e:
        load(tmp_path / "data.csv", tmp_path)
    assert "data.csv" in str(e.value) and ".jsonl" in str(e.value)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.json").write_text("[]")
    with pytest.raises(UserInputError) as e:
        load(tmp_path / "folder", tmp_path)
    assert "folder" in str(e.value) and "train" in str(e.value)


# --------------------------------------------------------------------------- fingerprint
def test_fingerprint_follows_file_edits(tmp_path):
    path = tmp_path / "fp.jsonl"
    write_jsonl(path, PC_ROWS)
    before = load(path, tmp_path)
    fp1, clean1 = before.fingerprint(), before.dataset_name_clean
    assert str(path) in fp1
    write_jsonl(path, PC_ROWS[:2] + [dict(PC_ROWS[2], chosen="Blue")])
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    after = load(path, tmp_path)
    assert after.fingerprint() != fp1
    assert after.dataset_name_clean != clean1 and after.dataset_name_clean.startswith("local_fp.jsonl_")
    assert load(path, tmp_path).fingerprint() == after.fingerprint()  # stable when unchanged
