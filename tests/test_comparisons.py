"""Comparisons of the actor's own answers (utils/data/comparisons.py, step2_reward_model_finetuning/
collect_comparisons.py): the pairs by hand, a real collection read by step 2, and a labelling function that
fails, each one clear line with nothing half-written."""
import json
import os

import pytest

from tests.conftest import run_entry
from utils.errors import UserInputError
from utils.data.builtin import quality
from utils.data.comparisons import ranked_pairs
from utils.data.rule_score import asked_object

COLLECT = "step2_reward_model_finetuning/collect_comparisons.py"
OMP = {"OMP_NUM_THREADS": "1"}


def test_ranked_pairs_by_hand():
    # "a" twice (first score kept), "c" ties with "a": pairs (a, b) and (b, c), the better one chosen
    pairs = ranked_pairs("P", ["a", "b", "a", " c"], [1, 3, 2, 1])
    assert [(p["chosen"], p["rejected"], p["chosen_score"], p["rejected_score"]) for p in pairs] == \
        [(" b", " a", 3.0, 1.0), (" b", " c", 3.0, 1.0)]
    assert all(p["prompt"] == "P" for p in pairs)
    assert ranked_pairs("P", ["x", "y"], [2, 2]) == []  # all tied: no pair
    assert len(ranked_pairs("P", list("abcd"), [4, 3, 2, 1])) == 6  # K·(K−1)/2
    assert ranked_pairs("P", ["", "  ", "z"], [9, 8, 1]) == []  # empty answers are not compared
    gapped = ranked_pairs("P", list("abcd"), [0.0, 0.05, 0.3, 1.0], min_gap=0.3)  # closer than 0.3: a tie
    assert [(p["chosen"], p["rejected"]) for p in gapped] == [(" c", " a"), (" d", " a"), (" d", " b"), (" d", " c")]


def base(tmp_path, *extra):
    return ["--actor_model_name_or_path", "tiny-llama", "--data_path", "builtin/demonstrations-small",
            "--data_output_path", tmp_path / "data", "--num_answers", 4, "--max_prompts", 12, "--max_eval_prompts",
            4, "--max_new_tokens", 12, "--output_dir", tmp_path / "out", *extra]


@pytest.mark.slow
def test_collected_comparisons_are_ranked_by_the_labeller_and_train_step2(tmp_path):
    proc = run_entry(COLLECT, *base(tmp_path, "--label_fn", "builtin_preference"), env=OMP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "comparisons.json").read_text())
    files = ["answers.jsonl", "comparisons.json", "eval.jsonl", "train.jsonl"] if report["eval"]["pairs"] else \
        ["answers.jsonl", "comparisons.json", "train.jsonl"]  # a random actor's eval answers may all tie
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == files  # not the run's manifest
    assert report["train"]["prompts"] == 12 and report["eval"]["prompts"] == 4 and report["train"]["answers"] == 48
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == report["train"]["pairs"] > 0
    for row in rows:  # the labeller's order, recomputed
        noun = asked_object(row["prompt"])
        assert quality(row["chosen"], noun) == row["chosen_score"] > row["rejected_score"] == \
            quality(row["rejected"], noun)
    kept = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [len(k["answers"]) for k in kept] == [4] * 16 and [k["split"] for k in kept] == ["train"] * 12 + ["eval"] * 4
    assert all(k["scores"] == [quality(a, asked_object(k["prompt"])) for a in k["answers"]] for k in kept)
    # the same answers labelled again by another labeller, no actor: its pairs, the sampling settings kept
    relabelled = run_entry(COLLECT, "--from_answers", out, "--label_fn", "builtin_rule", "--output_dir",
                           tmp_path / "again", env=OMP)
    assert relabelled.returncode == 0, relabelled.stderr[-3000:]
    again = json.loads((tmp_path / "again" / "comparisons.json").read_text())
    assert again["train"]["answers"] == 48 and again["settings"]["from_answers"] == str(out)
    assert again["settings"]["actor_model_name_or_path"] == "tiny-llama" and again["settings"]["label_fn"] == \
        "builtin_rule"
    again = run_entry(COLLECT, *base(tmp_path, "--label_fn", "builtin_preference"), env=OMP)
    assert again.returncode == 2 and "already holds comparisons" in again.stderr  # no silent overwrite
    (out / "my_notes.md").write_text("mine")  # --overwrite replaces the earlier collection, nothing else
    again = run_entry(COLLECT, *base(tmp_path, "--label_fn", "builtin_preference", "--overwrite"), env=OMP)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "set the earlier run's answers.jsonl, comparisons.json" in again.stdout
    assert "left in place: my_notes.md" in again.stdout
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(files + ["my_notes.md"])
    assert (out / "my_notes.md").read_text() == "mine"
    os.remove(out / "my_notes.md")
    step2 = run_entry("step2_reward_model_finetuning/main.py", "--model_name_or_path", "tiny-llama", "--data_path",
                      out, "--data_split", "0,1,0", "--data_output_path", tmp_path / "data", "--output_dir",
                      tmp_path / "rm", "--max_seq_len", 64, "--max_steps", 2, "--num_padding_at_beginning", 0,
                      "--reward_loss", "end", env=OMP)
    assert step2.returncode == 0, step2.stderr[-3000:]
    assert (tmp_path / "rm" / "reward_model.json").is_file()


def test_from_answers_labels_an_earlier_collections_answers_by_hand(tmp_path):
    """--from_answers: the answers.jsonl an earlier collection kept, labelled by another --label_fn with --min_gap,
    pairs by hand (ties and near-ties left out), no actor loaded, the rows' constraint types kept."""
    from step2_reward_model_finetuning import collect_comparisons as cc

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    lines = [{"split": "train", "prompt": " Human: a Assistant:", "row": {"instruction_id_list": ["x:y"]},
              "answers": ["aaaa", "b", "cc", "ddd"], "scores": [0, 0, 0, 0]},
             {"split": "train", "prompt": " Human: b Assistant:", "row": {}, "answers": ["ee", "ff"], "scores": [0, 0]},
             {"split": "eval", "prompt": " Human: c Assistant:", "row": {}, "answers": ["g", "hhh"], "scores": [1, 2]}]
    (earlier / "answers.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    labeller = tmp_path / "by_length.py"
    labeller.write_text("def label(prompts, answers, rows):\n    return [len(a) / 10 for a in answers]\n")
    args = cc.parse_args(["--from_answers", str(earlier), "--label_fn", f"{labeller}:label", "--min_gap", "0.15",
                          "--output_dir", str(tmp_path / "out")])
    report = cc.main(args)
    pairs = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    # lengths 4, 1, 2, 3 → scores .4 .1 .2 .3: gaps ≥ .15 are (a, b), (a, c), (d, b); "ee"/"ff" tie
    assert [(p["chosen"], p["rejected"], p["instruction_id_list"]) for p in pairs] == [
        (" aaaa", " b", ["x:y"]), (" aaaa", " cc", ["x:y"]), (" ddd", " b", ["x:y"])]
    assert [p["chosen"] for p in map(json.loads, (tmp_path / "out" / "eval.jsonl").read_text().splitlines())] == [
        " hhh"]
    assert report["train"] == {"prompts": 2, "answers": 6, "pairs": 3, "prompts_without_pairs": 1,
                               "mean_score": pytest.approx(1.4 / 6)}
    kept = [json.loads(line) for line in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    assert kept[0]["scores"] == [0.4, 0.1, 0.2, 0.3] and [k["answers"] for k in kept] == [k["answers"] for k in lines]
    for bad, message in ((["--actor_model_name_or_path", "tiny-llama"], "one of the two"),
                         (["--min_gap", "-1"], "--min_gap must be a number ≥ 0")):
        with pytest.raises(UserInputError, match=message):
            cc.validate(cc.parse_args(["--from_answers", str(earlier), "--label_fn", "f", "--output_dir", "o", *bad]))
    with pytest.raises(UserInputError, match="no answers.jsonl there"):
        cc.validate(cc.parse_args(["--from_answers", str(tmp_path), "--label_fn", "f", "--output_dir", "o"]))
    with pytest.raises(UserInputError, match="is the --output_dir"):  # --overwrite would move the answers away
        cc.validate(cc.parse_args(["--from_answers", str(earlier), "--label_fn", "f", "--output_dir",
                                   str(earlier / "."), "--overwrite"]))


LABELLERS = {
    "raises": ("def label(prompts, answers, rows):\n    raise KeyError('score')\n",
               "--label_fn {f}:label raised KeyError: 'score' on row 0 (prompt"),
    "wrong_count": ("def label(prompts, answers, rows):\n    return [0.0, 1.0]\n",
                    "--label_fn {f}:label returned 2 scores for 48 answers"),
    "nan": ("def label(prompts, answers, rows):\n    return [float('nan')] * len(answers)\n",
            "--label_fn {f}:label returned nan for row 0"),
    "all_tied": ("def label(prompts, answers, rows):\n    return [1.0] * len(answers)\n",
                 "gave every answer of every prompt the same score: no pair to train on"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LABELLERS))
def test_a_labelling_function_that_fails_is_refused_in_one_line(tmp_path, case):
    code, message = LABELLERS[case]
    labeller = tmp_path / "labeller.py"
    labeller.write_text(code)
    proc = run_entry(COLLECT, *base(tmp_path, "--label_fn", f"{labeller}:label"), env=OMP)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and message.format(f=labeller) in errors[0], errors
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


@pytest.mark.slow
def test_bad_collector_flags_are_refused_before_any_model(tmp_path):
    for extra, message in ((["--num_answers", "1"], "--num_answers must be ≥ 2"),
                           (["--label_fn", "nope"], "--label_fn nope: unknown reward function"),
                           (["--top_p", "0"], "sampling needs")):
        args = base(tmp_path, *extra) + ([] if "--label_fn" in extra else ["--label_fn", "builtin_rule"])
        proc = run_entry(COLLECT, *args, env=OMP)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_the_collector_samples_from_bf16_weights_when_asked(tmp_path, monkeypatch):
    """``--dtype bf16``: the actor that samples has bf16 weights, the answers kept are the ones those weights sample
    (the same seed and batch drawn again here), and the settings say so."""
    import torch

    import utils.answers
    from step2_reward_model_finetuning import collect_comparisons
    from utils.answers import generate_answers, load_for_answers
    from utils.data.chat_template import chat_format
    from utils.model.tiny import resolve_model_path

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    loaded = []

    def recording(*args, **kwargs):
        model, tokenizer = load_for_answers(*args, **kwargs)
        loaded.append(next(model.parameters()).dtype)
        return model, tokenizer

    monkeypatch.setattr(utils.answers, "load_for_answers", recording)
    (tmp_path / "by_length.py").write_text("def score(prompts, answers, rows):\n"
                                           "    return [float(len(a)) for a in answers]\n")
    args = collect_comparisons.parse_args([str(a) for a in base(tmp_path, "--label_fn",
                                                                 f"{tmp_path / 'by_length.py'}:score", "--dtype",
                                                                 "bf16", "--apply_chat_template")])
    args.max_prompts, args.max_eval_prompts = 3, 1
    collect_comparisons.main(args)
    assert loaded == [torch.bfloat16]
    kept = [json.loads(line) for line in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    settings = json.loads((tmp_path / "out" / "comparisons.json").read_text())["settings"]
    assert settings["dtype"] == "bf16" and len(kept) == 4
    model, tokenizer = load_for_answers(resolve_model_path("tiny-llama"), apply_chat_template=True,
                                        dtype=torch.bfloat16)
    train = [k for k in kept if k["split"] == "train"]
    again = generate_answers(model, tokenizer, [k["prompt"] for k in train], 12,
                             {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, per_prompt=4, seed=args.seed,
                             batch_size=args.batch_size, chat=chat_format(tokenizer))
    assert [a for k in train for a in k["answers"]] == again
    args.dtype, args.overwrite = None, True  # the default: fp32 on a CPU
    collect_comparisons.main(args)
    assert loaded == [torch.bfloat16, torch.float32]


def test_short_cuts_by_hand():
    from utils.data.comparisons import short_cuts

    answers = ["Rome is old. It has a forum.\n\nP.S. Visit it.", "Paris is big! It has a tower.", "One line only.",
               "Oslo is cold.\nIt is north."]
    # answer 0's last line, answer 1's first sentence; answer 2 is one line (its cut would be itself): nothing
    assert short_cuts(answers, 3) == ["P.S. Visit it.", "Paris is big!"]
    assert short_cuts(answers, 4) == ["P.S. Visit it.", "Paris is big!", "Oslo is cold."]  # 3: a first sentence
    assert short_cuts(answers[:1], 0) == [] and short_cuts([], 2) == []
    # a cut already among the answers, or already cut, is not added twice
    assert short_cuts(["x y.\nTail.", "Tail. More.", "z.\nTail."], 3) == ["Tail."]
    assert short_cuts(["Only.", "  "], 2) == []


def test_short_answers_join_the_train_prompts_only(tmp_path, monkeypatch):
    """``--short_answers 2``: each train prompt's kept answers are its K sampled ones and their cuts
    (:func:`short_cuts` of them, scored by the labeller like the rest, in pairs); the eval prompts' are the K sampled
    ones alone, so pair accuracy is measured on sampled answers only. The actor's answers are stood in for by
    answers with lines and sentences (the tiny actor's have neither)."""
    from step2_reward_model_finetuning import collect_comparisons
    from utils.data.comparisons import short_cuts

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(collect_comparisons, "sample", lambda model, tokenizer, args, rows, split: [
        [f"{split} {i} opens. It goes on a while.\nP.S. {i} ends.", f"{split} {i} is short. Then a longer tail.",
         f"{split} {i} once.", f"{split} {i} twice, with more words."] for i in range(len(rows))])
    (tmp_path / "by_length.py").write_text("def score(prompts, answers, rows):\n"
                                           "    return [float(len(a)) for a in answers]\n")
    args = collect_comparisons.parse_args([str(a) for a in base(tmp_path, "--label_fn",
                                                                 f"{tmp_path / 'by_length.py'}:score",
                                                                 "--short_answers", "2")])
    args.max_prompts, args.max_eval_prompts = 3, 2
    collect_comparisons.main(args)
    kept = [json.loads(line) for line in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "out" / "comparisons.json").read_text())["settings"]["short_answers"] == 2
    train, evals = [k for k in kept if k["split"] == "train"], [k for k in kept if k["split"] == "eval"]
    assert [len(k["answers"]) for k in evals] == [4, 4]
    for i, k in enumerate(train):
        assert k["answers"][4:] == short_cuts(k["answers"][:4], 2) == [f"P.S. {i} ends.", f"train {i} is short."]
        assert k["scores"][4:] == [float(len(a)) for a in k["answers"][4:]]
    pairs = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    cuts = {" " + a for k in train for a in k["answers"][4:]}
    assert any(p["rejected"] in cuts for p in pairs)
    with pytest.raises(UserInputError, match="--short_answers must be ≥ 0"):
        args.short_answers = -1
        collect_comparisons.validate(args)
