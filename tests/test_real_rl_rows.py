"""The real-model bench's reward-model and PPO rows (bench/bench_real_rl.py: ``rm``, ``ppo_fn``, ``ppo``) and its
reworded held-out set (bench/ifeval_data.py): the held-out instructions never reach the comparison collector, the
reworded wordings appear in no training row, each row's command lines carry the right flags, the reward model's
measures by hand, and the whole path (collect → step 2 → step 3 PPO) on the tiny model."""
import importlib
import importlib.util
import json
import os
import re
from argparse import Namespace
from pathlib import Path

import pytest

from bench import ifeval_data as builder
from tests.conftest import run_entry, shared_data
from utils.ifeval import check, describe, instructions_of

REPO = Path(__file__).resolve().parent.parent
OMP = {"OMP_NUM_THREADS": "1"}


def load_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as `python bench/bench_real_rl.py` has it: its reward beside it
    spec = importlib.util.spec_from_file_location("bench_real_rl", REPO / "bench" / "bench_real_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def options(bench, **changes):
    """The bench's defaults (its own parser), with ``changes``."""
    return Namespace(**dict(vars(bench.build_parser().parse_args([])), **changes))


def tiny_ifeval(tmp_path, n=40, heldout=10) -> dict:
    """The builder's four files from a tiny alpaca-like list of ``n`` instructions, ``heldout`` held out."""
    rows = [{"instruction": f"Describe the colour number {i} of the rainbow in detail", "input": "",
             "output": f"Colour {i} glows warmly, shimmering against quiet evening skies after rain."}
            for i in range(n)]
    files = builder.build(rows, seed=5, heldout=heldout, types=builder.TYPES)
    out = tmp_path / "ifeval"
    out.mkdir()
    for name, part in files.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return {"dir": str(out), "train": str(out / "train.jsonl"), **{name: part for name, part in files.items()}}


def tiny_reward_model(tmp_path):
    """``(reward model, tokenizer)``: an untrained tiny reward model (seeded), saved and loaded as step 2's are."""
    import torch

    from utils.model.critic import create_critic_model, load_reward_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    model = resolve_model_path("tiny-llama")
    tokenizer = load_hf_tokenizer(model, apply_chat_template=True)
    torch.manual_seed(0)
    save_reward_model(create_critic_model(model, tokenizer, None, 0), tokenizer, str(tmp_path / "rm"))
    return load_reward_model(str(tmp_path / "rm"), apply_chat_template=True)


# --------------------------------------------------------------------------- the held-out prompts stay out

def test_the_heldout_prompts_never_reach_the_comparison_collector(tmp_path, monkeypatch):
    """The ``rm`` row's collector answers prompts of train.jsonl only: what it would answer (its own data reading,
    on the bench's command line) holds no instruction of heldout.jsonl or heldout_reworded.jsonl, and its eval
    prompts (the pair accuracy's) are instructions none of its training prompts are."""
    from step2_reward_model_finetuning import collect_comparisons

    monkeypatch.chdir(REPO)  # the steps run from the repository's root (the label function's path)
    bench = load_bench(monkeypatch)
    data = tiny_ifeval(tmp_path)
    opts = options(bench, model="tiny-llama", rm_eval_prompts=6, seed=3)
    paths = bench.rm_paths(str(tmp_path / "work"))
    bench.write_rm_prompts(data, paths["prompts"], opts)
    collect, step2 = bench.rm_commands("tiny-llama", paths, opts)
    assert collect[0] == "step2_reward_model_finetuning/collect_comparisons.py"
    args = collect_comparisons.parse_args(collect[1:])
    assert args.data_path == [paths["prompts"]] and args.label_fn == bench.RM_LABELS["kept"]
    answered = collect_comparisons.check_data(args)  # {"train": [(prompt, row)], "eval": [...]}: what it answers
    held = {r["instruction"] for r in data["heldout.jsonl"] + data["heldout_reworded.jsonl"]}
    held_prompts = {r["prompt"] for r in data["heldout.jsonl"] + data["heldout_reworded.jsonl"]}
    assert len(held) == 10 and len(held_prompts) == 20
    seen = {split: [row["instruction"] for _, row in rows] for split, rows in answered.items()}
    assert len(seen["train"]) == 24 and len(seen["eval"]) == 6  # 30 training instructions: 6 kept for the eval
    assert not held & set(seen["train"] + seen["eval"])
    for prompt, _ in answered["train"] + answered["eval"]:
        assert not any(instruction in prompt for instruction in held), prompt
    assert not set(seen["train"]) & set(seen["eval"])
    assert set(seen["train"] + seen["eval"]) == {r["instruction"] for r in data["train.jsonl"]}
    # the split is the seed's, not the file's order, and the same every time
    again = bench.rm_prompt_rows(data["train.jsonl"], 6, 3)
    assert {r["instruction"] for r in again[1]} == set(seen["eval"])
    assert {r["instruction"] for r in bench.rm_prompt_rows(data["train.jsonl"], 6, 4)[1]} != set(seen["eval"])


# --------------------------------------------------------------------------- the reworded set

def test_every_type_has_three_other_wordings_that_ask_for_what_its_checker_checks():
    for instruction_id in builder.DRAWS:
        choices = builder.REWORDINGS[instruction_id]
        for options in (choices.values() if isinstance(choices, dict) else [choices]):
            assert len(options) >= 3 and len(set(options)) == len(options), instruction_id
    # the kwargs fill in as IFEval's text does: lists quoted, numbers and relations in place
    kwargs = {"forbidden_words": ["flour", "eggs"]}
    assert builder.reword("keywords:forbidden_words", kwargs, 0) == 'Never use the words "flour" and "eggs" in your ' \
                                                                    "answer."
    assert builder.reword("length_constraints:number_words", {"relation": "less than", "num_words": 30}, 0) == \
        "Keep your reply under 30 words."
    assert builder.reword("length_constraints:number_words", {"relation": "at least", "num_words": 30}, 0) == \
        "Write 30 words or more."


def test_the_reworded_set_is_the_heldout_set_in_wordings_no_training_row_uses():
    """On the bench's own data (the shared alpaca demo, its seed and types): the reworded rows are the held-out rows
    with other prompts (ids, kwargs, instruction and reference unchanged, so the checker checks the same), every
    wording of a type is used, and no wording's own text (nor any reworded constraint) occurs in a training row's
    prompt; a forbidden word never appears in the prompt outside the list that forbids it."""
    rows = builder.read_alpaca(str(shared_data("llama-factory-demo", "alpaca_en_demo.json")))
    types = ("punctuation:no_comma", "startend:end_checker", "keywords:existence", "keywords:forbidden_words",
             "length_constraints:number_words", "detectable_format:number_bullet_lists",
             "detectable_content:postscript", "detectable_format:title",
             "detectable_format:number_highlighted_sections")  # bench_real_rl.TYPES
    files = builder.build(rows, seed=1234, heldout=220, types=types)
    train, held, reworded = files["train.jsonl"], files["heldout.jsonl"], files["heldout_reworded.jsonl"]
    assert len(reworded) == len(held) == 220
    training_text = "\n".join(r["prompt"] for r in train)
    used = {}
    for template_row, row in zip(held, reworded):
        unchanged = [k for k in template_row if k != "prompt"]
        assert set(row) == set(template_row) and all(row[k] == template_row[k] for k in unchanged)
        assert row["prompt"] != template_row["prompt"] and row["prompt"].startswith(
            builder.with_period(row["instruction"]))
        for instruction_id, kwargs in instructions_of(row):
            texts = [builder.reword(instruction_id, kwargs, w) for w in range(3)]
            found = [w for w, text in enumerate(texts) if text in row["prompt"]]
            assert len(found) == 1 and describe(instruction_id, kwargs) not in row["prompt"], row["prompt"]
            used.setdefault(instruction_id, set()).update(found)
            assert texts[found[0]] not in training_text
            if instruction_id == "keywords:forbidden_words":  # the rest of the prompt keeps the ban
                assert check(instruction_id, kwargs, row["prompt"].replace(texts[found[0]], "")), row["prompt"]
    assert used == {t: {0, 1, 2} for t in types}  # every wording of every type is asked
    for instruction_id in types:  # and no wording's own words, three or more in a row, are in any training prompt
        choices = builder.REWORDINGS[instruction_id]
        for text in (sum(choices.values(), ()) if isinstance(choices, dict) else choices):
            for chunk in re.split(r"\{\w+\}", text):
                words = chunk.split()
                for i in range(len(words) - 2):
                    assert " ".join(words[i:i + 3]) not in training_text, (instruction_id, words[i:i + 3])


# --------------------------------------------------------------------------- the rows' command lines

def test_each_rows_command_lines_carry_the_right_flags(tmp_path, monkeypatch):
    """``ppo_fn``: step 3 PPO with a critic from the ``rm`` row's reward model, scored by the checker, with every
    other flag the GRPO row's (seed, budget, sampling, precision); ``ppo``: the same against the reward model alone;
    ``--ppo_args`` last, overriding; ``rm``: the collector (8 answers a prompt, the checker as labeller, its
    prompts folder, every eval prompt) and step 2 with the knobs the issue lists."""
    from step2_reward_model_finetuning import collect_comparisons
    from step2_reward_model_finetuning.main import parse_args as step2_args
    from step3_rlhf_finetuning.main import parse_args as step3_args
    from step3_rlhf_finetuning.main import validate_step3
    from utils.arguments import validate_common

    monkeypatch.chdir(REPO)
    bench = load_bench(monkeypatch)
    opts = options(bench, seed=7, steps=30, eval_every=10, prompts=4, group=8, dtype="bf16", autocast=True,
                   generation_dtype="bf16")
    data, reward = {"train": "train.jsonl"}, str(tmp_path / "rm" / "reward")
    grpo = step3_args(bench.grpo_command("model", data, str(tmp_path / "grpo"), opts)[1:])
    ppo_fn = step3_args(bench.ppo_command("model", data, str(tmp_path / "ppo_fn"), reward, opts,
                                          reward_fn=bench.GUARDED)[1:])
    ppo = step3_args(bench.ppo_command("model", data, str(tmp_path / "ppo"), reward, opts)[1:])
    for args in (ppo_fn, ppo):
        validate_step3(args)
        assert (args.advantage_estimator, args.critic_model_name_or_path) == ("gae", reward)
        assert (args.num_padding_at_beginning, args.critic_learning_rate) == (0, 5e-6)
    assert (grpo.advantage_estimator, grpo.reward_fn, ppo_fn.reward_fn, ppo.reward_fn) == \
        ("grpo", bench.GUARDED, bench.GUARDED, None)
    differs = {"advantage_estimator", "loss_agg", "reward_fn", "critic_model_name_or_path", "output_dir",
               "data_output_path", "num_padding_at_beginning", "critic_learning_rate"}  # the critic's, and the paths'
    assert grpo.loss_agg == "token_mean" and ppo.loss_agg != "token_mean"  # PPO keeps DeepSpeed-Chat's loss
    same = {k for k in vars(grpo) if k not in differs}
    assert {k: getattr(ppo_fn, k) for k in same} == {k: getattr(grpo, k) for k in same}  # the GRPO row's budget
    assert {k: getattr(ppo, k) for k in same} == {k: getattr(grpo, k) for k in same}
    assert (ppo.seed, ppo.max_steps, ppo.save_interval, ppo.n_samples_per_prompt, ppo.torch_autocast) == \
        (7, 30, 10, 8, True)
    tuned = bench.ppo_command("model", data, "out", reward, options(bench, ppo_args="--lam 0.9 --kl_ctl 0.1"))
    assert (step3_args(tuned[1:]).lam, step3_args(tuned[1:]).kl_ctl) == (0.9, 0.1)
    # a row killed during training (checkpoints, no actor/) is resumed: no --overwrite, which would set them aside
    assert "--overwrite" in bench.ppo_command("model", data, str(tmp_path / "ppo"), reward, opts)
    states = tmp_path / "ppo" / "checkpoints" / "step-00000010" / "actor" / "state"
    states.mkdir(parents=True)
    (states / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert "--overwrite" not in bench.ppo_command("model", data, str(tmp_path / "ppo"), reward, opts)
    assert "--overwrite" in bench.grpo_command("model", data, str(tmp_path / "grpo"), opts)

    opts = options(bench, seed=7, rm_model="other", rm_lr=1e-5, rm_epochs=2, rm_steps=50, rm_kwise=True,
                   num_padding_at_beginning=1, rm_prompts=100)
    paths = bench.rm_paths(str(tmp_path / "w"))
    collect, step2 = bench.rm_commands("model", paths, opts)
    c = collect_comparisons.parse_args(collect[1:])
    assert (c.actor_model_name_or_path, c.label_fn, c.num_answers, c.temperature, c.min_gap) == \
        ("model", "bench/ifeval_reward.py:ifeval_kept", 8, 1.0, 0.0)
    assert (c.data_path, c.data_split, c.max_prompts, c.max_eval_prompts) == ([paths["prompts"]], "0,1,0", 100, 0)
    assert c.apply_chat_template and c.seed == 7 and c.output_dir == paths["comparisons"]
    s = step2_args(step2[1:])
    validate_common(s)
    assert (s.model_name_or_path, s.data_path, s.data_split) == ("other", [paths["comparisons"]], "0,1,0")
    assert (s.learning_rate, s.num_train_epochs, s.max_steps, s.num_padding_at_beginning) == (1e-5, 2, 50, 1)
    assert (s.kwise, s.reward_loss, s.eval_iters, s.output_dir) == (True, "end", 0, paths["reward"])
    assert s.lr_scheduler_type == "constant"
    collect, step2 = bench.rm_commands("model", paths, options(bench, rm_label="guarded", rm_min_gap=0.1,
                                                               rm_scheduler="cosine"))
    c = collect_comparisons.parse_args(collect[1:])
    assert (c.label_fn, c.min_gap, step2_args(step2[1:]).lr_scheduler_type) == (bench.GUARDED, 0.1, "cosine")
    assert bench.step2_has_kwise()  # this checkout's step 2 takes it
    default = step2_args(bench.rm_commands("model", paths, options(bench))[1][1:])  # the measured settings
    assert (default.kwise, default.learning_rate, default.lr_scheduler_type, default.num_train_epochs,
            default.per_device_train_batch_size) == (True, 1e-4, "constant", 2, 4)
    # precision: fp32 by default; --rm_dtype bf16 trains under autocast over fp32 weights, and --generation_dtype
    # bf16 has the collector sample from bf16 weights
    default_collect = collect_comparisons.parse_args(bench.rm_commands("model", paths, options(bench))[0][1:])
    assert (default.dtype, default.torch_autocast, default_collect.dtype) == ("fp32", False, None)
    assert default_collect.short_answers == 0  # the measured recipe cuts none
    cut = bench.rm_commands("model", paths, options(bench, rm_short_answers=2))[0]
    assert collect_comparisons.parse_args(cut[1:]).short_answers == 2
    # another run's answers labelled again: no actor, no sampling flags, this run's labelling and output
    again = collect_comparisons.parse_args(bench.rm_commands("model", paths, options(
        bench, rm_answers_from="/runs/a", rm_short_answers=2, rm_label="guarded"))[0][1:])
    assert (again.from_answers, again.actor_model_name_or_path) == ("/runs/a/rm/comparisons", None)
    assert (again.label_fn, again.short_answers, again.output_dir) == (bench.GUARDED, 2, paths["comparisons"])
    fast = bench.rm_commands("model", paths, options(bench, rm_dtype="bf16", generation_dtype="bf16"))
    s, c = step2_args(fast[1][1:]), collect_comparisons.parse_args(fast[0][1:])
    validate_common(s)
    assert (s.dtype, s.torch_autocast, c.dtype) == ("bf16", True, "bf16")
    assert not step2_args(bench.rm_commands("model", paths, options(bench, rm_kwise=False))[1][1:]).kwise
    assert step2_args(bench.rm_commands("model", paths, options(bench))[1][1:]).model_name_or_path == "model"
    # the 0.792 reward model's collection: 200 instructions, 32 prompts a generate call; step 2 evaluated every 22
    c = collect_comparisons.parse_args(bench.rm_commands("model", paths, options(bench))[0][1:])
    assert (c.max_prompts, c.batch_size, default.eval_interval) == (200, 32, 22)


def test_ppo_ptx_mixes_alpacas_answers_to_the_training_instructions_only(tmp_path, monkeypatch):
    """``--ppo_ptx C``: both PPO rows get step 3's LM loss weighted C on ``ptx-<hash>.jsonl`` beside the data: one
    chat conversation a training row, its instruction without the constraints and alpaca's answer, as the template
    writes them; no held-out instruction; step 3 packs it into LM blocks; another model's template, another file
    (not the first model's text). Off (no flags) by default."""
    from step3_rlhf_finetuning.main import parse_args as step3_args
    from step3_rlhf_finetuning.main import validate_step3
    from utils.data.chat_template import chat_format
    from utils.data.unsupervised import get_unsupervised_data
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    monkeypatch.chdir(REPO)
    bench = load_bench(monkeypatch)
    data, model = tiny_ifeval(tmp_path), resolve_model_path("tiny-llama")
    reward = str(tmp_path / "rm" / "reward")
    off = step3_args(bench.ppo_command(model, data, str(tmp_path / "ppo"), reward, options(bench))[1:])
    assert off.unsupervised_dataset_name is None and not list((tmp_path / "ifeval").glob("ptx*"))
    paths = set()
    for reward_fn in (None, bench.GUARDED):  # the ppo and ppo_fn rows alike
        on = step3_args(bench.ppo_command(model, data, str(tmp_path / "ppo"), reward, options(bench, ppo_ptx=0.5),
                                          reward_fn=reward_fn)[1:])
        validate_step3(on)
        assert on.unsup_coef == 0.5
        paths.add(on.unsupervised_dataset_name)
    (ptx,) = paths
    assert os.path.dirname(ptx) == str(tmp_path / "ifeval") and re.fullmatch(r"ptx-[0-9a-f]{8}\.jsonl",
                                                                               os.path.basename(ptx))
    texts = [json.loads(line)["text"] for line in open(ptx).read().splitlines()]
    tokenizer = load_hf_tokenizer(model, apply_chat_template=True)
    fmt = chat_format(tokenizer)
    train = data["train.jsonl"]
    assert len(texts) == len(train) > 0
    for text, row in zip(texts, train):
        turn = [{"role": "user", "content": row["instruction"]}]
        assert text == fmt.prompt(turn) + fmt.answer(turn, row["reference_output"])
        assert row["instruction"] != row["prompt"] and row["prompt"] not in text  # the constraints left out
        assert text.endswith(row["reference_output"].strip() + fmt.eot)
    heldout = {r["instruction"] for r in data["heldout.jsonl"]}
    assert heldout and not any(h in text for h in heldout for text in texts)
    blocks = get_unsupervised_data(ptx, None, tokenizer, 32, log=lambda _: None)
    assert len(blocks) > 0 and blocks[0]["labels"].tolist() == blocks[0]["input_ids"].tolist()
    as_written = bench.ptx_texts  # another model's template writes other text: another file, the first one kept
    monkeypatch.setattr(bench, "ptx_texts", lambda rows, fmt: [t.replace(fmt.eot, "</s>") for t in as_written(rows,
                                                                                                              fmt)])
    other = bench.write_ptx(data, model)
    assert other != ptx and json.loads(open(other).readline())["text"] == texts[0].replace(fmt.eot, "</s>")
    monkeypatch.setattr(bench, "ptx_texts", as_written)
    assert bench.write_ptx(data, model) == ptx and [json.loads(line)["text"] for line in open(ptx)] == texts
    from utils.errors import UserInputError

    for bad in ("-0.5", "nan"):
        with pytest.raises(UserInputError, match="--ppo_ptx"):
            bench.main(["--rows", "ppo", "--ppo_ptx", bad])


def test_unknown_rows_and_bad_knobs_are_refused_in_one_line(monkeypatch, tmp_path):
    from utils.errors import UserInputError

    bench = load_bench(monkeypatch)
    with pytest.raises(UserInputError, match="give grpo, trl, ppo_fn, rm or ppo"):
        bench.main(["--rows", "ppo,rw"])
    with pytest.raises(UserInputError, match="--rm_answers ≥ 2"):
        bench.main(["--rows", "rm", "--rm_answers", "1"])
    with pytest.raises(UserInputError, match="--best_of_temperature > 0"):
        bench.main(["--rows", "rm", "--best_of_temperature", "0"])
    with pytest.raises(UserInputError, match="--rm_collect_batch ≥ 1"):
        bench.main(["--rows", "rm", "--rm_collect_batch", "0"])
    for beta in ("-0.5", "nan"):
        with pytest.raises(UserInputError, match="--best_of_mbr ≥ 0"):
            bench.main(["--rows", "rm", "--best_of_mbr", beta])
    with pytest.raises(UserInputError, match="no .*answers.jsonl"):
        bench.main(["--rows", "rm", "--rm_answers_from", str(tmp_path / "nowhere")])
    (tmp_path / "rm" / "comparisons").mkdir(parents=True)
    (tmp_path / "rm" / "comparisons" / "answers.jsonl").write_text("")
    with pytest.raises(UserInputError, match="is the --work folder"):
        bench.main(["--rows", "rm", "--rm_answers_from", str(tmp_path), "--work", str(tmp_path)])


# --------------------------------------------------------------------------- the reward model's measures, by hand

def test_the_reward_models_measures_by_hand(tmp_path, monkeypatch):
    """Pair accuracy per type from the collector's pairs (a pair of a two-constraint prompt counts for both types),
    the lines the table prints, step 2's eval curve and step 3's reward from their metrics.jsonl, the best point."""
    from utils.model.scoring import pair_accuracy_by_group

    bench = load_bench(monkeypatch)
    kinds = [["punctuation:no_comma", "detectable_format:title"], ["punctuation:no_comma"], ["detectable_format:title"],
             None]
    chosen, rejected = [1.0, 0.2, 0.5, 3.0], [0.0, 0.7, 0.5, 1.0]  # right, wrong, a tie (wrong), right
    acc = pair_accuracy_by_group(chosen, rejected, kinds)
    result = {"pair_accuracy": acc, "step2_curve": {"0": 0.5, "20": 0.625, "40": 0.75}}
    assert bench.rm_lines(result) == [
        "reward model: pair accuracy 0.500 on 4 eval pairs (instructions none of its training pairs came from); "
        "step 2's eval accuracy by step: 0.50 → 0.62 → 0.75",
        "per type: title 0.50 (2), no_comma 0.50 (2)"]
    result["best_of_curve"] = {"1": {"strict": 0.4, "f1": 0.25}, "8": {"strict": 0.5, "f1": 0.24}}
    result["reworded"] = {"best_of_curve": {"1": {"strict": 0.2, "f1": 0.2}, "8": {"strict": 0.3, "f1": 0.215}}}
    assert bench.rm_lines(result)[2:] == ["best of m, template: m 1: strict 0.400 F1 0.250, m 8: strict 0.500 F1 0.240",
                                          "best of m, reworded: m 1: strict 0.200 F1 0.200, m 8: strict 0.300 F1 0.215"]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "phase": "eval", "acc": 0.5}, {"step": 1, "phase": "train", "reward": -0.25},
        {"step": 2, "phase": "train", "reward": 0.5}, {"step": 2, "phase": "eval", "acc": 0.75}]))
    assert bench.metrics_curve(str(metrics), "train", "reward") == {"1": -0.25, "2": 0.5}
    assert bench.metrics_curve(str(metrics), "eval", "acc") == {"0": 0.5, "2": 0.75}
    assert bench.metrics_curve(str(tmp_path / "absent.jsonl"), "train", "reward") == {}
    point = {"f1": 0.2, "length": 50.0, "bare": 0.0}
    curve = {"0": dict(point, strict=0.9), "10": dict(point, strict=0.45), "20": dict(point, strict=0.5),
             "30": dict(point, strict=0.5)}
    assert bench.best_point(curve) == {"step": 20, "strict": 0.5, "guards": True}  # after step 0; the first of equals
    assert bench.best_point({"0": curve["0"]}) == {}
    # the guards against step 0 (F1 0.25, so at least 0.225; at most 5 % bare): step 40 gains more but breaks both,
    # step 20 holds them (F1 0.23 ≥ 0.225, bare 0.05 ≤ 0.05), step 30 breaks F1 alone (0.22 < 0.225)
    base = {"strict": 0.4, "f1": 0.25, "length": 64.0, "bare": 0.02}
    run = {"0": base, "20": {"strict": 0.44, "f1": 0.23, "length": 68.0, "bare": 0.05},
           "30": {"strict": 0.50, "f1": 0.22, "length": 60.0, "bare": 0.03},
           "40": {"strict": 0.55, "f1": 0.20, "length": 46.0, "bare": 0.08}}
    assert bench.best_point(run) == {"step": 20, "strict": 0.44, "guards": True}
    del run["20"]  # no point holds the guards: the highest strict, said so
    assert bench.best_point(run) == {"step": 40, "strict": 0.55, "guards": False}
    del run["0"]  # nothing to judge the guards by
    assert bench.best_point(run) == {"step": 40, "strict": 0.55, "guards": None}
    png = tmp_path / "proxy.png"
    # the proxy, compliance and the content guard it must not break (F1 under 0.9 × step 0's at step 40)
    held = {"0": base, "40": {"strict": 0.55, "f1": 0.20, "length": 46.0, "bare": 0.08}}
    assert bench.proxy_plot({"1": -0.25, "2": 0.5}, "reward model's mean score", held, str(png)) == [
        "reward model's mean score", "held-out strict compliance", "held-out F1, constrained", "F1 guard"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    del held["0"]  # no step 0: no guard to draw
    assert bench.proxy_plot({"1": 0.5}, "checker's mean reward", held, str(png))[-1] == "held-out F1, constrained"


def test_the_proxy_is_the_reward_before_the_overlong_penalty_when_step_3_logged_it(tmp_path, monkeypatch):
    bench = load_bench(monkeypatch)
    path = tmp_path / "metrics.jsonl"
    rows = [{"phase": "train", "step": 1, "reward": -1.5, "task_reward": -0.5},
            {"phase": "eval", "step": 1, "reward": 9.0},
            {"phase": "train", "step": 2, "reward": 0.0, "task_reward": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.proxy_curve(str(path), "ppo") == ({"1": -0.5, "2": 0.5}, "reward model's mean score")
    # no penalty, no task_reward (step 3 logs it only with one): the reward is the proxy itself
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "task_reward"}) + "\n" for r in rows))
    assert bench.proxy_curve(str(path), "ppo_fn") == ({"1": -1.5, "2": 0.0}, "checker's mean reward")


def test_the_table_shows_both_sets_the_reward_model_and_the_best_point(monkeypatch):
    bench = load_bench(monkeypatch)
    per_type = {"punctuation:no_comma": 0.5}

    def evaluation(strict, reworded, **more):
        return {"strict": strict, "per_type": per_type, "type_counts": {"punctuation:no_comma": 4}, "f1": 0.25,
                "length": 60.0, "bare": 0.0, "reworded": {"strict": reworded, "per_type": {"punctuation:no_comma":
                                                                                           0.25}}, **more}

    acc = {"overall": {"pairs": 500, "correct": 400, "accuracy": 0.8},
           "groups": {"punctuation:no_comma": {"pairs": 500, "correct": 400, "accuracy": 0.8}}}
    results = {"base": evaluation(0.4, 0.3, plain_f1=0.3, kl=0.0, gsm8k=0.03),
               "rm": evaluation(0.55, 0.42, best_of=8, kl_bound=1.2, pair_accuracy=acc, step2_curve={"0": 0.5}),
               "ppo": evaluation(0.5, 0.35, plain_f1=0.3, kl=2.0, gsm8k=0.02,
                                 best={"step": 20, "strict": 0.52, "checkpoint": "w/ppo/checkpoints/step-20"}),
               "wall": {"rm": 600.0, "ppo": 1200.0}}  # the whole path: step 3 + the reward model's collect + step 2
    text = bench.table(results)
    assert "| 2.00 | 2.0 % | 20 + rm 10 min |" in text
    assert "| SmolLM2-135M-Instruct | 0.400 / 0.300 | 0.250 / 0.300 | 60.0 | 0.0 % | 0.00 | 3.0 % | — |" in text
    assert ("| + reward model's best of 8 (no RL) | 0.550 / 0.420 | 0.250 / — | 60.0 | 0.0 % | ≤ 1.20 | — "
            "| 10 min |" in text)
    assert "| `no_comma` (4) | 0.50 / 0.25 | 0.50 / 0.25 | 0.50 / 0.25 |" in text
    assert "reward model: pair accuracy 0.800 on 500 eval pairs" in text and "no_comma 0.80 (500)" in text
    assert "ppo: best held-out point step 20 (strict 0.520): w/ppo/checkpoints/step-20" in text
    assert "wall time of" not in text  # a run from before the host was kept: nothing made up
    results["host"] = {"rm": "AMD EPYC, 2 cores, bf16 instructions: avx512_bf16",
                       "ppo": "AMD EPYC, 2 cores, bf16 instructions: avx512_bf16", "grpo": "NVIDIA H200"}
    hosts = bench.table(results)
    assert "\nwall time of rm, ppo: AMD EPYC, 2 cores, bf16 instructions: avx512_bf16\n" in hosts
    assert "\nwall time of grpo: NVIDIA H200\n" in hosts
    results["ppo"]["best"]["guards"] = False
    assert "step 20 (strict 0.520; no point held the guards): w/ppo" in bench.table(results)
    # sampled at another temperature: the row says so, and has no KL bound to the base (evaluate_rm leaves it out)
    del results["rm"]["kl_bound"]
    results["rm"]["best_of_temperature"] = 0.7
    assert ("| + reward model's best of 8 at temperature 0.7 (no RL) | 0.550 / 0.420 | 0.250 / — | 60.0 | 0.0 % "
            "| — | — | 10 min |" in bench.table(results))
    results["rm"]["best_of_mbr"] = 0.5
    assert "| + reward model's best of 8 at temperature 0.7, consensus β 0.5 (no RL) | 0.550" in bench.table(results)


def test_one_draw_of_n_gives_the_best_of_m_curve_below_it(monkeypatch):
    """Best of m for m = 1, 2, 4, … < n and n, from the first m of each prompt's n answers, by hand: two held-out
    rows asking for no commas; the reward model's scores pick a comma-free answer in row 0 from m = 4 on, in row 1
    at m = 2 only (its best of 4 has a comma)."""
    import torch

    bench = load_bench(monkeypatch)
    assert bench.best_of_prefixes(8) == [1, 2, 4, 8] and bench.best_of_prefixes(6) == [1, 2, 4, 6]
    assert bench.best_of_prefixes(1) == [1] and bench.best_of_prefixes(16) == [1, 2, 4, 8, 16]
    row = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}], "reference_output": "a b c"}
    rows = [row, row]
    words = " ".join(["word"] * 12)
    sampled = [[f"a, {words}", f"b, {words}", f"c {words}", f"d, {words}"],
               [f"e, {words}", f"f {words}", f"g, {words}", f"h {words}"]]
    scores = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 1.0, 5.0, 0.5]])
    curve = bench.best_of_curve(rows, sampled, scores)
    assert list(curve) == ["1", "2", "4"]
    # row 0 picks a (m 1), b (m 2), c (m 4); row 1 picks e, f, g: comma-free picks 0+0, 0+1, 1+0
    assert [curve[m]["strict"] for m in curve] == [0.0, 0.5, 0.5]
    assert all(curve[m]["length"] == 13 and curve[m]["bare"] == 0.0 for m in curve)


def test_consensus_pulls_the_best_of_n_pick_toward_the_prompts_typical_answer(monkeypatch):
    """Consensus (each answer's mean unigram F1 against the prompt's other answers) by hand, and the pick it moves:
    the reward model's favourite "x y z" shares no word with the others (consensus 0), which share two of their
    three words (F1 2/3 with each other); at β 0.25 the favourite stays (z totals −0.84, 0.03, 1.21, −0.41), at
    β 1 the best-scored typical answer "a b d" wins (−0.41, 0.47, −0.09, 0.03), at β 2 too."""
    import torch

    bench = load_bench(monkeypatch)
    assert bench.consensus([["a b c", "a b d", "x y z"], ["only one"]]) == [
        pytest.approx([1 / 3, 1 / 3, 0.0]), [0.0]]  # "a b c"–"a b d": F1 2/3, each against two: (2/3 + 0) / 2
    sampled = [["a b c", "a b d", "x y z", "a b e"]]  # consensus: 4/9, 4/9, 0, 4/9 (2/3 with two of three)
    scores = torch.tensor([[1.0, 2.0, 4.0, 1.5]])  # z: −0.99, −0.11, 1.65, −0.55 (mean 2.125, std 1.1388)
    assert bench.consensus(sampled)[0] == pytest.approx([4 / 9, 4 / 9, 0.0, 4 / 9])
    assert bench.best_of_picks(sampled, scores, 0.0).tolist() == [2]
    assert bench.best_of_picks(sampled, scores, 0.25).tolist() == [2]  # consensus z: 0.577 ×3, −1.732
    assert bench.best_of_picks(sampled, scores, 1.0).tolist() == [1]
    assert bench.best_of_picks(sampled, scores, 2.0).tolist() == [1]
    row = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}], "reference_output": "a b d"}
    sweep = bench.mbr_sweep([row], sampled, scores)
    assert list(sweep) == ["0", "0.25", "0.5", "1", "2"]
    assert sweep["0"]["f1"] == 0.0 and sweep["1"]["f1"] == 1.0 and sweep["2"]["strict"] == 1.0
    assert bench.best_of_curve([row], sampled, scores, beta=1.0)["4"]["f1"] == 1.0
    assert bench.best_of_curve([row], sampled, scores)["4"]["f1"] == 0.0
    assert bench.mbr_sweep_lines({"best_of": 4, "mbr_sweep": sweep})[0].startswith(
        "best of 4 against β (z(score) + β z(consensus)), template: β 0: strict 1.000 F1 0.000, β 0.25: ")


def test_short_answer_pairs_by_hand(monkeypatch):
    """Each eval line's sampled answers against their cuts, the cuts scored by the labeller (here: 1 for 5 words or
    more, a stand-in for the substance guard), only pairs with a cut in them; the table's line."""
    bench = load_bench(monkeypatch)
    label = lambda prompts, answers, rows: [float(len(a.split()) >= 5) for a in answers]  # noqa: E731
    lines = [{"split": "eval", "prompt": "P", "row": {}, "scores": [1.0, 0.0, 1.0],
              "answers": ["One two three four. Five six seven.\nP.S. Bye now.", "Tiny. Tail.", "Solo line here ok."]},
             {"split": "eval", "prompt": "Q", "row": {}, "scores": [1.0], "answers": ["Just one sentence here now."]}]
    pairs = bench.short_answer_pairs(lines, label, 3)
    # P's cuts: answer 0's last line "P.S. Bye now." (0), answer 1's first sentence "Tiny." (0); answer 2 is one
    # line and one sentence: no cut. Pairs with a cut: answer 0 (1) and answer 2 (1) over each cut (0); answer 1
    # (0) ties with them. Q has no cut.
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [
        (" One two three four. Five six seven.\nP.S. Bye now.", " P.S. Bye now."),
        (" One two three four. Five six seven.\nP.S. Bye now.", " Tiny."),
        (" Solo line here ok.", " P.S. Bye now."), (" Solo line here ok.", " Tiny.")]
    assert bench.short_answer_pairs(lines, label, 1) == pairs[:1]  # k 1: answer 0 and its one cut
    r = {"pair_accuracy": {"overall": {"accuracy": 0.5, "pairs": 4}, "groups": {}},
         "short_pair_accuracy": {"pairs": 4, "correct": 1, "accuracy": 0.25, "short_chosen": 0}}
    assert bench.rm_lines(r)[2] == ("short answers: pair accuracy 0.250 on 4 eval pairs with a short answer cut "
                                    "from a sampled one (0 with the cut the better)")


def test_short_pair_accuracy_scores_the_short_pairs_with_the_reward_model(tmp_path, monkeypatch):
    """On an untrained tiny reward model: the accuracy is that of its own scores of the pairs
    :func:`short_answer_pairs` gives from the collection's eval lines (train lines left out), labelled by the row's
    labeller (ifeval_kept: a cut under 10 words keeps nothing)."""
    from utils.data.chat_template import chat_format
    from utils.model.scoring import score_texts

    bench = load_bench(monkeypatch)
    reward_model, reward_tokenizer = tiny_reward_model(tmp_path)
    row = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}], "reference_output": "x"}
    long = "The river runs through the old town and past the mill"
    lines = [{"split": split, "prompt": f" Human: {split} river? Assistant:", "row": row, "scores": [1.0, 1.0],
              "answers": [f"{long}.\nP.S. It is wide.", f"{long} today. It is calm."]} for split in ("train", "eval")]
    (tmp_path / "comparisons").mkdir()
    (tmp_path / "comparisons" / "answers.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    opts = options(bench, rm_answers=2, rm_max_seq_len=128, rm_dtype="fp32")
    result = bench.short_pair_accuracy({"comparisons": str(tmp_path / "comparisons")}, opts, reward_model,
                                       reward_tokenizer)
    from ifeval_reward import ifeval_kept  # beside the bench

    pairs = bench.short_answer_pairs(lines[1:], ifeval_kept, 2)
    # the cuts: "P.S. It is wide." (4 words: 0) and answer 1's first sentence (12 words, no comma: 1); the pairs:
    # each answer over the P.S., and the 12-word cut over it too (a cut the better one)
    assert len(pairs) == 3 and result["pairs"] == 3 and result["short_chosen"] == 1
    assert {p["rejected"] for p in pairs} == {" P.S. It is wide."}
    chat = chat_format(reward_tokenizer)
    chosen, rejected = (score_texts(reward_model, reward_tokenizer, [(p["prompt"], p[k]) for p in pairs], 128, "",
                                    chat=chat) for k in ("chosen", "rejected"))
    correct = sum(c > r for c, r in zip(chosen, rejected))
    assert result["correct"] == correct and result["accuracy"] == correct / 3


def test_best_of_ns_kl_bound_and_when_a_kept_rm_row_is_measured_again(monkeypatch):
    """log n − (n−1)/n by hand (n 8: 2.0794 − 0.875 = 1.2044; n 1: 0), only at temperature 1; a kept ``rm`` row is
    measured again when its n or temperature is not this run's (one from before the flag sampled at 1.0)."""
    bench = load_bench(monkeypatch)
    assert bench.best_of_n_kl_bound(8, 1.0) == pytest.approx(1.2044, abs=1e-4)
    assert bench.best_of_n_kl_bound(4, 1.0) == pytest.approx(1.3863 - 0.75, abs=1e-4)
    assert bench.best_of_n_kl_bound(1, 1.0) == 0.0
    assert bench.best_of_n_kl_bound(8, 0.7) is None
    opts = options(bench)  # the defaults: n 8 at temperature 1
    assert not bench.rm_row_stale({"best_of": 8, "best_of_temperature": 1.0}, opts)
    assert not bench.rm_row_stale({"best_of": 8}, opts)
    assert bench.rm_row_stale({"best_of": 4, "best_of_temperature": 1.0}, opts)
    assert bench.rm_row_stale({"best_of": 8}, options(bench, best_of_temperature=0.7))
    assert not bench.rm_row_stale({"best_of": 8, "best_of_temperature": 0.7}, options(bench, best_of_temperature=0.7))
    # sampled from fp32 weights (a row from before the flag too) is not sampled from bf16 ones
    assert bench.rm_row_stale({"best_of": 8}, options(bench, generation_dtype="bf16"))
    assert not bench.rm_row_stale({"best_of": 8, "generation_dtype": "bf16"}, options(bench, generation_dtype="bf16"))
    assert bench.rm_row_stale({"best_of": 8, "generation_dtype": "bf16"}, opts)
    # picked with another consensus β (a row from before the flag picked at β 0)
    assert bench.rm_row_stale({"best_of": 8}, options(bench, best_of_mbr=0.5))
    assert not bench.rm_row_stale({"best_of": 8, "best_of_mbr": 0.5}, options(bench, best_of_mbr=0.5))
    assert bench.rm_row_stale({"best_of": 8, "best_of_mbr": 0.5}, opts)


def test_a_best_of_draw_is_kept_and_reused_only_when_drawn_the_same_way(tmp_path, monkeypatch, capsys):
    """The rm row's draw (``WORK/best_of/*.json``): kept before scoring, reused when its settings match (sampled
    once), drawn again and replaced when they do not; another run's (``--best_of_answers_from``) reused and kept in
    this run's folder; no file without paths. The settings follow the prompts, n, seed and precision."""
    bench = load_bench(monkeypatch)
    calls = []

    def sample(answers):
        def draw():
            calls.append(answers)
            return answers
        return draw

    own = str(tmp_path / "own" / "best_of" / "heldout.json")
    settings = {"n": 2, "seed": 1}
    assert bench.sampled_answers([own], settings, sample([["a", "b"]])) == [["a", "b"]] and len(calls) == 1
    assert bench.sampled_answers([own], settings, sample([["x", "y"]])) == [["a", "b"]] and len(calls) == 1
    assert bench.sampled_answers([own], {**settings, "seed": 2}, sample([["c", "d"]])) == [["c", "d"]]
    assert json.loads(open(own).read()) == {"settings": {"n": 2, "seed": 2}, "answers": [["c", "d"]]}
    third = str(tmp_path / "third" / "best_of" / "heldout.json")
    assert bench.sampled_answers([third, own], {**settings, "seed": 2}, sample([["z"]])) == [["c", "d"]]
    assert len(calls) == 2 and json.loads(open(third).read())["answers"] == [["c", "d"]]
    assert bench.sampled_answers([], settings, sample([["e"]])) == [["e"]] and len(calls) == 3
    # the progress line counts the prompts so far (generate_answers reports each batch's, as tqdm's update takes)
    import torch

    import utils.answers
    import utils.data.chat_template
    import utils.model.scoring

    def fake_generate(model, tokenizer, prompts, length, sampling, per_prompt, seed, batch_size, chat, progress):
        for start in range(0, len(prompts), batch_size):
            progress(len(prompts[start:start + batch_size]))
        return ["answer"] * (len(prompts) * per_prompt)

    monkeypatch.setattr(utils.answers, "generate_answers", fake_generate)
    monkeypatch.setattr(utils.model.scoring, "score_answers", lambda *a, **k: torch.zeros(9, 2))
    monkeypatch.setattr(utils.data.chat_template, "chat_format", lambda tokenizer: None)
    capsys.readouterr()
    bench.best_of_n_answers(None, None, None, None, None, [f"p{i}" for i in range(9)],
                            options(bench, best_of=2, generation_dtype=None, rm_dtype="fp32"))
    assert capsys.readouterr().out.splitlines() == ["    best of 2: 8/9 prompts sampled",
                                                    "    best of 2: 9/9 prompts sampled"]
    # what a draw depends on
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"weights")
    opts = options(bench, best_of=8, best_of_temperature=0.7, answer_len=128, seed=1234, generation_dtype=None)
    base = bench.best_of_settings(str(tmp_path / "model"), ["p", "q"], opts)
    assert base == bench.best_of_settings(str(tmp_path / "model"), ["p", "q"], opts)
    assert base["dtype"] == "fp32" and base["n"] == 8 and base["temperature"] == 0.7 and base["seed"] == 1234
    for other in (bench.best_of_settings(str(tmp_path / "model"), ["p", "r"], opts),
                  bench.best_of_settings(str(tmp_path / "model"), ["p", "q"], options(bench, best_of=8,
                                         best_of_temperature=0.7, answer_len=128, seed=1234, generation_dtype="bf16"))):
        assert other != base
    (tmp_path / "model" / "model.safetensors").write_bytes(b"other weights")
    assert bench.best_of_settings(str(tmp_path / "model"), ["p", "q"], opts)["model"] != base["model"]


# --------------------------------------------------------------------------- pairs and best of n on the tiny model

def test_comparisons_carry_their_prompts_constraint_types(monkeypatch):
    """collect_comparisons.py keeps an IFEval row's instruction_id_list on each of its pairs (per-type accuracy);
    rows without one give the pairs as before."""
    from step2_reward_model_finetuning import collect_comparisons

    args = Namespace(label_fn="f", min_gap=0.0)
    rows = [(" Human: a Assistant:", {"instruction_id_list": ["punctuation:no_comma"]}), (" Human: b Assistant:", {})]
    answers = [[f"answer {i}" for i in range(3)], [f"answer {i}" for i in range(3, 6)]]
    pairs, counts, _, _ = collect_comparisons.label(lambda p, a, r: [float(x[-1]) for x in a], args, rows, answers,
                                                    "eval")
    assert counts == [3, 3] and [p.get("instruction_id_list") for p in pairs] == [["punctuation:no_comma"]] * 3 + [
        None] * 3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_best_of_n_keeps_each_prompts_highest_scored_sample(tmp_path, monkeypatch, precision):
    """The ``rm`` row's pick, on the tiny model and an untrained tiny reward model in its chat template: each
    prompt's answer is the one of its N samples the reward model scores highest (as scored apart here). In bf16
    (``--generation_dtype bf16 --rm_dtype bf16``) the samples are a bf16 copy's, scored under bf16 autocast, and
    the actor handed in stays fp32."""
    import contextlib
    import copy

    import torch

    from utils.data.chat_template import chat_format
    from utils.model.scoring import score_texts
    from utils.model.tiny import resolve_model_path

    bench = load_bench(monkeypatch)
    model = resolve_model_path("tiny-llama")
    reward_model, reward_tokenizer = tiny_reward_model(tmp_path)
    actor, actor_tokenizer, fmt = bench.load(model)
    opts = Namespace(best_of=4, best_of_temperature=0.7, answer_len=6, seed=3, rm_max_seq_len=128, best_of_mbr=0.0,
                     generation_dtype=None if precision == "fp32" else "bf16", rm_dtype=precision)
    prompts = ["Describe the lamp.", "Name a river. Do not use commas."]
    best, scores, samples = bench.best_of_n_answers(actor, actor_tokenizer, fmt, reward_model, reward_tokenizer,
                                                    prompts, opts)
    assert scores.shape == (2, 4) and len(best) == 2 and [len(row) for row in samples] == [4, 4]
    assert next(actor.parameters()).dtype == torch.float32
    from utils.answers import generate_answers

    sampler = actor if precision == "fp32" else copy.deepcopy(actor).to(torch.bfloat16)
    sampled = generate_answers(sampler, actor_tokenizer, [f" Human: {p} Assistant:" for p in prompts], 6,
                               {"temperature": 0.7, "top_k": 0, "top_p": 1.0}, per_prompt=4, seed=3, batch_size=8,
                               chat=fmt)
    with (contextlib.nullcontext() if precision == "fp32" else torch.autocast("cpu", dtype=torch.bfloat16)):
        apart = score_texts(reward_model, reward_tokenizer, [(f" Human: {prompts[i // 4]} Assistant:", " " + a)
                                                             for i, a in enumerate(sampled)], 128, "",
                            chat=chat_format(reward_tokenizer))
    for p in range(2):
        row = apart[4 * p:4 * p + 4]
        assert best[p] == sampled[4 * p + row.index(max(row))] and samples[p] == sampled[4 * p:4 * p + 4]
        assert scores[p].tolist() == pytest.approx(row, abs=1e-5)
    # kept in a file: the same draw, sampled once (generate_answers is not called again)
    keep = [str(tmp_path / "best_of" / "heldout.json")]
    opts.model = model
    assert bench.best_of_n_answers(actor, actor_tokenizer, fmt, reward_model, reward_tokenizer, prompts, opts,
                                   keep)[2] == samples
    import utils.answers

    monkeypatch.setattr(utils.answers, "generate_answers", lambda *a, **k: pytest.fail("sampled again"))
    again, again_scores, again_samples = bench.best_of_n_answers(actor, actor_tokenizer, fmt, reward_model,
                                                                 reward_tokenizer, prompts, opts, keep)
    assert again == best and again_samples == samples and again_scores.tolist() == scores.tolist()


# --------------------------------------------------------------------------- the whole path on the tiny model

@pytest.mark.smoke
@pytest.mark.slow
def test_the_whole_path_runs_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    """The ``ppo`` row's commands on the tiny model and tiny IFEval-style data: the model's own answers to the
    training prompts ranked by the checker → step 2 → (bench_ppo_advantages.py's table on them) → step 3 PPO
    against that reward model alone, its critic's value head zeroed and its advantages whitened, with a checkpoint
    the bench finds and the reward curve its proxy plot reads; no held-out instruction in any comparison, and the
    eval pairs carry their constraint types."""
    from utils.model.tiny import resolve_model_path

    monkeypatch.chdir(REPO)
    bench = load_bench(monkeypatch)
    model = resolve_model_path("tiny-llama")
    data = tiny_ifeval(tmp_path, n=24, heldout=6)
    # the guarded label: its content term tells the tiny model's 8-token answers apart, which all fail the
    # default (kept) label's 10-word guard alike
    opts = options(bench, model=model, rm_eval_prompts=4, rm_answers=3, answer_len=8, rm_steps=2, rm_batch=4,
                   rm_eval_interval=1, steps=2, eval_every=1, prompts=2, group=2, lr=1e-4, rm_label="guarded",
                   ppo_args="--critic_value_head zero --whiten_advantages --lam 1.0")
    paths = bench.rm_paths(str(tmp_path / "work"))
    bench.write_rm_prompts(data, paths["prompts"], opts)
    collect, step2 = bench.rm_commands(model, paths, opts)
    for cmd in (collect, step2):
        proc = run_entry(*cmd, env=OMP, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pairs = {split: [json.loads(line) for line in open(os.path.join(paths["comparisons"], f"{split}.jsonl"))]
             for split in ("train", "eval")}
    held = {r["instruction"] for r in data["heldout.jsonl"]}
    assert pairs["train"] and pairs["eval"]
    assert not any(h in p["prompt"] for h in held for split in pairs.values() for p in split)
    train_types = {r["prompt"]: r["instruction_id_list"] for r in data["train.jsonl"]}
    assert all(p["instruction_id_list"] == train_types[p["prompt"].split("Human: ", 1)[1].rsplit(" Assistant:", 1)[0]]
               for p in pairs["eval"])
    spec = importlib.util.spec_from_file_location("bench_ppo_advantages", REPO / "bench" / "bench_ppo_advantages.py")
    advantages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(advantages)
    capsys.readouterr()
    assert advantages.main(["--answers", paths["comparisons"], "--critic", paths["reward"], "--prompts", "3",
                            "--head_lrs", "0", "0.001", "--batch_prompts", "1"]) == 0
    table = capsys.readouterr().out
    assert "| value head lr | corr(G − V, centred score), batches 1–1 / 2–2 / 3–3 |" in table, table
    assert "\n| 0 | " in table and "\n| 0.001 | " in table
    assert all(f"| {critic} | {lam} | " in table for critic in ("step-2 weights (DeepSpeed-Chat's start)",
                                                                   "values 0 (an untrained value head)")
               for lam in ("0.95", "1")), table
    assert "answers to 3 prompts" in table
    out = tmp_path / "work" / "ppo"
    ppo = bench.ppo_command(model, {"train": data["train"]}, str(out), paths["reward"], opts)
    proc = run_entry(*ppo, env=OMP, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "value head set to 0" in proc.stdout and "advantages whitened over the batch" in proc.stdout
    assert (out / "actor").is_dir() and (out / "critic").is_dir()
    assert sorted(bench.checkpoint_weights(str(out))) == [1, 2]
    assert sorted(bench.metrics_curve(str(out / "metrics.jsonl"), "train", "reward"), key=int) == ["1", "2"]
    assert bench.metrics_curve(os.path.join(paths["reward"], "metrics.jsonl"), "eval", "acc")
