"""The GPU recipe benchmark (bench/bench_gpu_recipe.py) runs only on a GPU; its flags are checked here.

Each step's flag list must still be accepted by that step's own parser and checks, so that the
benchmark does not rot unseen between GPU sessions (a renamed or removed flag fails here, on CPU).
"""
import importlib
import importlib.util
import json
import os
from argparse import Namespace
from pathlib import Path

import pytest

from step3_rlhf_finetuning.main import validate_step3
from utils.arguments import validate_common
from utils.compat import check_zero_combination
from utils.errors import UserInputError

REPO = Path(__file__).resolve().parent.parent
MAINS = {"1": "step1_supervised_finetuning.main", "2": "step2_reward_model_finetuning.main",
         "dpo": "step2_dpo_finetuning.main", "3": "step3_rlhf_finetuning.main"}


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_recipe", REPO / "bench" / "bench_gpu_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("step", list(MAINS))
def test_gpu_recipe_flags_are_accepted_by_each_step(step, tmp_path):
    bench = load_bench()
    options = Namespace(step1_out=str(tmp_path / "step1"), step2_out=str(tmp_path / "step2"), step3_steps=8,
                        generation_backend="cuda-graph")
    script, flags = bench.step_flags(step, str(tmp_path), str(tmp_path / "out"), options)
    assert script == MAINS[step].replace(".", "/") + ".py" and (REPO / script).is_file()
    args = importlib.import_module(MAINS[step]).parse_args([str(f) for f in flags])
    args.dtype = args.dtype or "bf16"
    assert (args.dtype, args.seed, args.data_split) == ("bf16", 1234, "2,4,4")  # the reference's settings
    if step == "3":
        validate_step3(args)
        assert args.enable_hybrid_engine and args.actor_lora_dim == 128 and args.max_steps == 8
    else:
        validate_common(args)
        check_zero_combination(args)


def load_real_model_bench():
    spec = importlib.util.spec_from_file_location("bench_real_model", REPO / "bench" / "bench_real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEP_OF = {"step 1": "1", "step 2": "2", "DPO": "dpo", "step 3": "3"}


@pytest.mark.parametrize("fmt", ["dschat", "template"])
def test_real_model_bench_commands_are_accepted_by_each_step(fmt, tmp_path):
    """bench/bench_real_model.py needs a SmolLM2 folder (~100 MB, never in the test run): its commands are
    checked here against the steps' parsers, so it does not rot unseen."""
    bench = load_real_model_bench()
    options = Namespace(max_seq_len=192, max_answer_len=64, sft_steps=20, rm_steps=30, ppo_steps=4, dpo_steps=10)
    plan = bench.step_commands(fmt, "model", "data.jsonl", str(tmp_path), options)
    assert list(plan) == ["step 1", "step 2", "step 3", "DPO"]  # steps 2 and 3 read the folders written before
    for name, cmd in plan.items():
        module = MAINS[STEP_OF[name]]
        assert cmd[1] == module.replace(".", "/") + ".py"
        args = importlib.import_module(module).parse_args(cmd[2:])
        assert args.apply_chat_template == (fmt == "template")
        args.dtype = "fp32"
        if name == "step 3":
            validate_step3(args)
            assert args.max_prompt_seq_len + args.max_answer_seq_len == 192 and args.max_steps == 4
        else:
            validate_common(args)


def test_real_model_bench_skips_in_one_line_without_the_model(tmp_path, capsys):
    assert load_real_model_bench().main(["--model", str(tmp_path / "absent")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"skipped: no model folder at {tmp_path / 'absent'}")


def load_module(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("trainer", ["grpo", "sft", "rm", "dpo"])
def test_peer_bench_commands_are_accepted_by_each_step(trainer, tmp_path):
    """bench/bench_peers.py needs SmolLM2 and a TRL environment (never in the test run): our side's commands are
    checked against the steps' parsers, and both sides get the same batch and length."""
    bench = load_module("bench_peers")
    opts = Namespace(steps=8, group=4, grpo_batch=16, answer_len=48, max_len=512, batch=4)
    data = {"gsm8k": "g.jsonl", "hh": "hh", "hh_trl": "hh.jsonl"}
    ours = bench.our_command(trainer, "model", data, str(tmp_path / "out"), opts)
    module = {"grpo": MAINS["3"], "sft": MAINS["1"], "rm": MAINS["2"], "dpo": MAINS["dpo"]}[trainer]
    assert ours[0] == module.replace(".", "/") + ".py"
    args = importlib.import_module(module).parse_args(ours[1:])
    assert args.apply_chat_template and args.max_steps == 8 and args.dtype == "fp32"
    peer = bench.trl_command(trainer, "model", data, str(tmp_path / "trl"), opts)
    assert peer[:2] == ["bench/peers/trl_run.py", trainer] and "--steps" in peer
    if trainer == "grpo":
        validate_step3(args)
        assert (args.n_samples_per_prompt, args.per_device_training_batch_size, args.max_answer_seq_len,
                args.kl_ctl) == (4, 16, 48, 0.04)
        assert peer[peer.index("--batch") + 1] == "16" and peer[peer.index("--beta") + 1] == "0.04"
    else:
        validate_common(args)
        assert args.per_device_train_batch_size == 4 and args.max_seq_len == 512
        assert peer[peer.index("--batch") + 1] == "4" and peer[peer.index("--max_len") + 1] == "512"


@pytest.mark.parametrize("trainer", ["grpo", "sft", "rm", "dpo"])
def test_peer_bench_on_a_gpu_runs_bf16_on_both_sides(trainer, tmp_path):
    """On a GPU the peer bench runs ours twice (--dtype bf16; --dtype bf16 --torch_autocast) and TRL with bf16=True;
    on the CPU fp32 once each, as before. Every command is accepted by its parser."""
    bench = load_module("bench_peers")
    trl_run = load_module("peers/trl_run")
    assert bench.planned_runs("cuda", "ours,trl") == [("ours", "bf16"), ("ours", "bf16-autocast"), ("trl", "bf16")]
    assert bench.planned_runs("cpu", "ours,trl") == [("ours", "fp32"), ("trl", "fp32")]
    assert bench.planned_runs("cuda", "trl") == [("trl", "bf16")]
    opts = Namespace(steps=8, group=4, grpo_batch=16, answer_len=48, max_len=512, batch=4)
    data = {"gsm8k": "g.jsonl", "hh": "hh", "hh_trl": "hh.jsonl"}
    module = importlib.import_module({"grpo": MAINS["3"], "sft": MAINS["1"], "rm": MAINS["2"],
                                      "dpo": MAINS["dpo"]}[trainer])
    for precision, autocast in (("bf16", False), ("bf16-autocast", True)):
        args = module.parse_args(bench.our_command(trainer, "model", data, str(tmp_path), opts, precision)[1:])
        assert args.dtype == "bf16" and args.torch_autocast is autocast
        if trainer != "grpo":  # evaluated at the training batch (TRL does not evaluate: no peak of its own)
            assert args.per_device_eval_batch_size == args.per_device_train_batch_size == 4
    peer = bench.trl_command(trainer, "model", data, str(tmp_path), opts, "bf16")
    targs = trl_run.parse_args([*peer[1:]])
    assert targs.dtype == "bf16" and trl_run.common_args(targs)["bf16"] is True
    assert trl_run.parse_args(bench.trl_command(trainer, "model", data, str(tmp_path), opts)[1:]).dtype == "fp32"


def test_peer_bench_gpu_memory_is_the_polled_peak_above_the_start():
    bench = load_module("bench_peers")
    readings = iter([500, 700, 2000, 1500] + [900] * 1000)
    with bench.GpuMemoryPeak(interval=0.001, read=lambda: next(readings)) as mem:
        import time
        time.sleep(0.2)
    assert mem.base == 500 and mem.peak == 1500
    with bench.GpuMemoryPeak(read=lambda: None) as none:  # no nvidia-smi: no figure
        pass
    assert none.peak is None
    rows = {("ours", "bf16"): dict(s_per_step=1.0, samples_per_s=8.0, tokens_per_s=4000.0, tokens_per_step=4000,
                                   peak_rss=1, peak_gpu=6 * 2**30),
            ("trl", "bf16"): dict(s_per_step=2.0, samples_per_s=4.0, tokens_per_s=2000.0, tokens_per_step=4000,
                                  peak_rss=1, peak_gpu=8 * 2**30)}
    text = bench.table("sft", rows, Namespace(steps=8, warmup=2), "1.16.0")
    assert "peak GPU memory" in text and "| this project, bf16 | 1.00 | 8.000 | 4000.0 | 4000 | 6.00 GiB |" in text
    assert "| ours (bf16) / TRL | 0.50× | **2.00×** | **2.00×** | 1.00× | **0.75×** |" in text


def test_peer_bench_shapes_have_the_real_models_parameter_counts():
    """By hand (bench/peers/shapes.py): SmolLM2-135M 49152·576 + 30·(884,736 + 2,654,208 + 1,152) + 576; Llama-3.2-1B
    128256·2048 + 16·(10,485,760 + 50,331,648 + 4,096) + 2048 (tied embeddings: the LM head is the embedding)."""
    import torch
    from transformers import LlamaForCausalLM

    shapes = load_module("peers/shapes")
    expected = {"smollm2-135m": 49152 * 576 + 30 * (884_736 + 2_654_208 + 1_152) + 576,
                "llama-1b": 128256 * 2048 + 16 * (10_485_760 + 50_331_648 + 4_096) + 2048}
    assert expected == {"smollm2-135m": 134_515_008, "llama-1b": 1_235_814_400}
    for name, count in expected.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(shapes.shape_config(name))
        assert sum(p.numel() for p in model.parameters()) == count


def test_peer_bench_shape_folder_loads_with_a_chat_template_and_never_ends_an_answer(tmp_path, monkeypatch):
    """A built shape (one layer here) loads as a causal LM with its tokenizer and chat template, and the tokens that
    end an answer (EOS, end of turn) sit tens of logits below the best after any ordinary input."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shapes = load_module("peers/shapes")
    monkeypatch.setattr(shapes, "DEFAULT_MODEL", str(tmp_path / "absent"))  # the offline BPE, as on a bare machine
    out = shapes.build_shape("smollm2-135m", str(tmp_path / "shape"), layers=1, device="cpu", log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and model.config.vocab_size == 49152 and model.config.num_hidden_layers == 1
    assert model.config.tie_word_embeddings and model.config.hidden_size == 576
    ends = shapes.end_token_ids(tokenizer)
    assert tokenizer.eos_token_id in ends and tokenizer.convert_tokens_to_ids("<|im_end|>") in ends
    assert shapes.end_token_margin(model, tokenizer) > 30
    answer = model.generate(torch.tensor([[5, 6, 7]]), do_sample=True, max_new_tokens=20, min_new_tokens=0,
                            eos_token_id=ends, pad_token_id=tokenizer.pad_token_id)
    assert answer.shape[1] == 23  # sampled to the cap: no end token drawn


def test_peer_bench_times_steps_after_the_warm_up():
    bench = load_module("bench_peers")
    steps = [{"time": t, "tokens": 100 * (i + 1), "samples": 4} for i, t in enumerate([10.0, 13.0, 15.0, 18.0, 20.0])]
    r = bench.summarize(steps, warmup=2, samples_per_step=4)  # timed: steps 3, 4, 5 (2, 3, 2 s)
    assert r["timed_steps"] == 3 and r["s_per_step"] == 2.0
    assert r["tokens_per_s"] == pytest.approx((300 + 400 + 500) / 7) and r["samples_per_s"] == pytest.approx(12 / 7)


@pytest.mark.parametrize("name", ["bench_peers", "bench_real_rl"])
def test_real_model_benches_skip_in_one_line_without_the_model(name, tmp_path, capsys):
    assert load_module(name).main(["--model", str(tmp_path / "absent")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "skipped" in out[0]


def test_real_rl_bench_metrics_by_hand(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as `python bench/bench_real_rl.py` has it: its reward beside it
    bench = load_module("bench_real_rl")
    unigram_f1 = load_module("ifeval_reward").unigram_f1

    assert unigram_f1("the cat sat", "the cat ran away") == pytest.approx(2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4))
    assert unigram_f1("", "x") == 0.0
    rows = [{"instruction_id_list": ["punctuation:no_comma", "startend:end_checker"],
             "kwargs": [{}, {"end_phrase": "Bye."}], "reference_output": "Go home now. Bye."},
            {"instruction_id_list": ["length_constraints:number_words"],
             "kwargs": [{"relation": "less than", "num_words": 5}], "reference_output": "Short."}]
    r = bench.score_constrained(rows, ["Go home now and rest well. Bye.", "Bye."])
    assert r["strict"] == 1.0  # both keep all their constraints
    assert r["per_type"] == {"length_constraints:number_words": 1.0, "punctuation:no_comma": 1.0,
                             "startend:end_checker": 1.0}
    assert r["length"] == 7.0  # the word-limited row is left out of the length guard
    assert r["bare"] == 0.5  # the second answer has one word (fewer than 5 besides any required text)


def test_real_rl_bench_summarizes_a_recipes_seeds(tmp_path, capsys):
    """``--summarize`` reads finished runs' results and prints each run's line and each row's mean over runs."""
    bench = load_module("bench_real_rl")

    def evaluation(strict, postscript, commas):
        return {"strict": strict, "per_type": {"detectable_content:postscript": postscript,
                                               "punctuation:no_comma": commas},
                "f1": 0.25, "plain_f1": 0.3, "length": 60.0, "bare": 0.01, "kl": 4.0, "gsm8k": 0.02}

    def reworded(strict):  # the reworded set's numbers beside the template set's
        return {"reworded": {"strict": strict, "per_type": {}}}

    base = evaluation(0.40, 0.43, 0.39)
    runs = {"s1": {"base": dict(base, **reworded(0.30)), "grpo": dict(evaluation(0.52, 0.92, 0.37),  # commas -2: within
                                                                     **reworded(0.36))},  # 3 points
            "s2": {"base": base, "grpo": evaluation(0.40, 0.76, 0.22), "trl": evaluation(0.47, 0.95, 0.39)}}
    for name, results in runs.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    assert bench.main(["--summarize", str(tmp_path / "s1"), str(tmp_path / "s2")]) == 0
    out = capsys.readouterr().out
    assert "| s1 | grpo | 0.520 / 0.360 | 0.250 / 0.300 | 60.0 | 1.0 % | 4.00 | 2.0 % | none |" in out
    assert "| s2 | grpo | 0.400 / — |" in out and out.count("no_comma -17") == 1  # a run from before the set: —
    assert "grpo: mean strict 0.460 (+6.0 points) over 2 run(s), range 0.400 – 0.520\n" in out  # not every run has it
    assert "trl: mean strict 0.470 (+7.0 points) over 1 run(s)" in out
    assert bench.main(["--summarize", str(tmp_path / "s1")]) == 0
    assert "grpo: mean strict 0.520 (+12.0 points) over 1 run(s), range 0.520 – 0.520; reworded 0.360 (+6.0 points)" \
        in capsys.readouterr().out
    os.makedirs(tmp_path / "unfinished")
    with pytest.raises(UserInputError, match="not a finished run"):  # one error line, exit 2 (run_script)
        bench.main(["--summarize", str(tmp_path / "unfinished")])


def test_real_rl_bench_draws_a_recipes_seeds_in_one_plot(tmp_path, monkeypatch):
    """``--summarize ... --plot`` draws each run's curve of each row, rows in the fixed order (GRPO, TRL, PPO),
    a run without a curve left out; ``--plot`` alone is refused."""
    bench = load_module("bench_real_rl")
    point = {"strict": 0.4, "f1": 0.25, "length": 60.0, "bare": 0.01}
    curve = {"0": point, "40": dict(point, strict=0.6)}
    evaluation = {"strict": 0.4, "per_type": {}, "f1": 0.25, "plain_f1": 0.3, "length": 60.0, "bare": 0.01,
                  "kl": 4.0, "gsm8k": 0.02}
    runs = {"s1": {"base": evaluation, "trl": evaluation, "grpo": evaluation, "curve": {"trl": curve,
                                                                                        "grpo": curve}},
            "s2": {"base": evaluation, "grpo": evaluation, "curve": {"grpo": curve}},
            "old": {"base": evaluation, "grpo": evaluation}}
    for name, results in runs.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    drawn, plot = {}, bench.plot
    monkeypatch.setattr(bench, "plot", lambda curves, path: drawn.update(path=path, labels=list(curves)))
    png = str(tmp_path / "seeds.png")
    assert bench.main(["--summarize"] + [str(tmp_path / n) for n in runs] + ["--plot", png]) == 0
    assert drawn == {"path": png, "labels": ["step 3 GRPO, s1", "step 3 GRPO, s2", "TRL GRPOTrainer, s1"]}
    os.makedirs(tmp_path / "trl" / "s1")  # a second folder named s1: named by its parent, both kept
    (tmp_path / "trl" / "s1" / "results.json").write_text(json.dumps(runs["s1"]))
    assert bench.main(["--summarize", str(tmp_path / "s2"), str(tmp_path / "trl" / "s1"), "--plot", png]) == 0
    assert drawn["labels"] == ["step 3 GRPO, s2", "step 3 GRPO, s1", "TRL GRPOTrainer, s1"]
    assert bench.main(["--summarize", str(tmp_path / "s1"), str(tmp_path / "trl" / "s1"), "--plot", png]) == 0
    assert drawn["labels"] == ["step 3 GRPO, s1", "step 3 GRPO, trl/s1", "TRL GRPOTrainer, s1",
                               "TRL GRPOTrainer, trl/s1"]
    with pytest.raises(UserInputError, match="given twice"):
        bench.main(["--summarize", str(tmp_path / "s1"), str(tmp_path / "s1")])
    assert plot({label: curve for label in drawn["labels"]}, png) == drawn["labels"]
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        bench.main(["--plot", png])


def test_real_rl_bench_keeps_weighted_training_data_apart():
    """``--train_weights`` data go to a folder of their own (named by the weights), the default data to
    ``WORK/ifeval``, so a work folder never mixes a weighted training file with another's."""
    bench = load_module("bench_real_rl")
    assert bench.data_folder("w") == os.path.join("w", "ifeval")
    two = bench.data_folder("w", "punctuation:no_comma=2")
    assert two.startswith(os.path.join("w", "ifeval-")) and two == bench.data_folder("w", "punctuation:no_comma=2")
    assert two != bench.data_folder("w", "punctuation:no_comma=3")


def test_real_rl_bench_evaluates_on_the_gpu_only_when_there_is_one(monkeypatch):
    import torch

    bench = load_module("bench_real_rl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.device() == torch.device("cpu")


@pytest.mark.slow
def test_bench_runs_keep_the_callers_pythonpath_behind_the_repository(monkeypatch, tmp_path):
    """Packages installed with ``pip install --target DIR`` and PYTHONPATH=DIR (the GPU machine's deepspeed) reach
    the steps a bench starts: the repository comes first, the caller's path after it."""
    import sys

    bench = load_module("bench_real_rl")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    log = tmp_path / "log"
    bench.run(["-c", "import os; print(os.environ['PYTHONPATH'])"], str(log), python=sys.executable)
    assert log.read_text().split() == [os.pathsep.join([str(REPO), str(tmp_path / "site")])]


@pytest.mark.parametrize("estimator,scale_rewards,dtype,autocast,overlong,gen_dtype", [
    ("grpo", "group", "fp32", False, 0, None), ("dr_grpo", "none", "bf16", False, 0, None),
    ("grpo", "group", "bf16", True, 32, "bf16")])
def test_real_rl_bench_commands_are_accepted_by_each_step(estimator, scale_rewards, dtype, autocast, overlong,
                                                          gen_dtype, tmp_path):
    bench = load_module("bench_real_rl")
    opts = Namespace(group=4, prompts=8, answer_len=128, kl=0.04, lr=1e-5, steps=22, eval_every=11, seed=7,
                     reward_fn=bench.GUARDED, temperature=0.7, schedule="cosine", warmup=2, estimator=estimator,
                     dtype=dtype, autocast=autocast, overlong_penalty=overlong, overlong_penalty_weight=0.25,
                     adam_betas=[0.9, 0.999], generation_dtype=gen_dtype)
    data = {"train": "train.jsonl"}
    grpo = bench.grpo_command("model", data, str(tmp_path / "grpo"), opts)
    args = importlib.import_module(MAINS["3"]).parse_args(grpo[1:])
    assert (args.dtype, args.torch_autocast, args.overlong_penalty) == (dtype, autocast, overlong)
    assert args.generation_dtype == gen_dtype
    assert args.overlong_penalty_weight == (0.25 if overlong else 1.0)  # the weight travels with the penalty only
    assert args.adam_betas == [0.9, 0.999]
    validate_step3(args)
    assert args.reward_fn == bench.GUARDED and args.max_steps == 22 and args.save_interval == 11 and args.seed == 7
    assert (args.temperature, args.lr_scheduler_type, args.num_warmup_steps) == (0.7, "cosine", 2)
    assert (args.advantage_estimator, args.loss_agg) == (estimator, "token_mean")  # TRL's dapo loss: the token mean
    # the rm, ppo_fn and ppo rows' commands: tests/test_real_rl_rows.py
    trl = bench.trl_command("model", data, str(tmp_path / "trl"), opts)  # the peer's row: same settings
    flags = dict(zip(trl[2::2], trl[3::2]))
    assert trl[:2] == ["bench/peers/trl_run.py", "grpo"] and flags["--save_at"] == "11"
    assert (flags["--steps"], flags["--batch"], flags["--group"], flags["--lr"]) == ("22", "32", "4", "1e-05")
    assert (flags["--temperature"], flags["--lr_scheduler"], flags["--warmup"], flags["--seed"]) == ("0.7", "cosine",
                                                                                                    "2", "7")
    assert (flags["--scale_rewards"], flags["--loss_type"]) == (scale_rewards, "dapo")  # the same advantages and loss
    peer = load_module("peers/trl_run")
    peer_args = peer.parse_args(trl[1:])  # TRL's runner takes every flag the bench passes
    assert peer_args.lr_scheduler == "cosine" and peer_args.dtype == dtype
    assert peer_args.overlong_penalty == overlong  # the same length penalty on both rows, with the same weight
    assert peer_args.overlong_penalty_weight == (0.25 if overlong else 1.0)
    assert peer.common_args(peer_args)["bf16"] == (dtype == "bf16")  # TRL trains in the same precision
    assert (peer.common_args(peer_args)["adam_beta1"], peer.common_args(peer_args)["adam_beta2"]) == (0.9, 0.999)
    assert peer.parse_args(["grpo", "--model", "m", "--data", "d", "--out", "o"]).adam_betas == [0.9, 0.95]  # ours
    for step in (11, 5):
        os.makedirs(tmp_path / "trl" / f"actor-step-{step}")
    assert bench.trl_checkpoints(str(tmp_path / "trl")) == {s: (str(tmp_path / "trl" / f"actor-step-{s}"), None)
                                                            for s in (5, 11)}


@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_baseline", "reinforce", "dapo", "gspo",
                                  "cispo"])
def test_algorithms_bench_commands_are_accepted_by_step_3(name, tmp_path):
    """bench/bench_algorithms.py takes ~20 minutes and the demo's models: each row's quality commands (both rewards)
    and speed command are checked here against step 3's parser and flag checks, so the rows do not rot unseen."""
    from step3_rlhf_finetuning.main import parse_args, validate_flags

    bench = load_module("bench_algorithms")
    assert list(bench.RUNS)[-3:] == ["dapo", "gspo", "cispo"]
    base = bench.demo_step3(str(tmp_path / "demo"))
    commands = [bench.quality_command(base, name, reward, str(tmp_path / "q"), 0.1)
                for reward in ("reward model", "builtin_rule")]
    commands.append(bench.speed_command(name, "tiny-opt", str(tmp_path / "reward"), str(tmp_path), 8))
    for cmd in commands:
        assert cmd[1].endswith("step3_rlhf_finetuning/main.py")
        args = parse_args([str(a) for a in cmd[2:]])
        validate_flags(args)
        assert args.per_device_generation_batch_size * args.n_samples_per_prompt == 16  # 16 answers a step
        assert (args.advantage_estimator, args.policy_loss) == {
            "dapo": ("grpo", "ppo"), "gspo": ("grpo", "gspo"), "cispo": ("grpo", "cispo")}.get(name, (name, "ppo"))
        if name == "dapo":
            assert (args.cliprange, args.cliprange_high, args.dynamic_sampling, args.loss_agg) == \
                (0.2, 0.28, True, "token_mean")


def test_trl_parity_bench_takes_step3s_gradient_which_is_the_textbook_grpo_gradient(tmp_path):
    """bench/bench_trl_parity.py compares step 3's gradient on one sampled batch with TRL's (never in the test run).
    Its step-3 half on the tiny model: the batch it writes for TRL, and the gradient it keeps, equal GRPO's loss
    written out plainly on that batch (one full forward, group-normalised scores, the clipped ratio at 1, k3 KL
    to the reference log-probs, the token mean), which is also what :func:`compare` reports as no difference."""
    import torch
    from transformers import AutoModelForCausalLM

    from utils.model.tiny import resolve_model_path

    bench = load_module("bench_trl_parity")
    path = resolve_model_path("tiny-llama")
    ours = bench.step3_side(path, answer_len=8, seed=1234, work=str(tmp_path))
    batch = torch.load(ours["batch"], weights_only=True)
    assert batch["completion_ids"].shape == (16, 8) and batch["completion_mask"].sum() == ours["tokens"]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    P = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    scores = batch["scores"].view(-1, 4)
    advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).flatten()
    ref, m = batch["ref_per_token_logps"], batch["completion_mask"].float()
    per_token = -advantages[:, None] * torch.exp(logp - logp.detach()) + bench.BETA * (torch.exp(ref - logp) -
                                                                                       (ref - logp) - 1)
    loss = (per_token * m).sum() / m.sum()
    loss.backward()
    plain = {"loss": loss.item(), "logprobs": logp.detach() * m, "advantages": advantages,
             "grads": {n: p.grad for n, p in model.named_parameters()}}
    assert set(ours["grads"]) == set(plain["grads"])  # every weight has its gradient
    rows = dict(bench.compare(ours, plain))
    assert float(rows["gradient: relative L2 difference, all weights"]) < 1e-4
    assert abs(float(rows["gradient: cosine, all weights"]) - 1) < 1e-6
    assert float(rows["advantages: max abs difference"]) < 1e-6 and abs(ours["loss"] - plain["loss"]) < 1e-5
    assert any(g.abs().sum() > 0 for g in ours["grads"].values())


def test_trl_parity_bench_reads_step3s_optimizer_and_keeps_the_users_pythonpath(tmp_path, monkeypatch):
    """The optimizer column is the AdamW step 3's actor gets at its default flags (so a changed default shows up in
    the table), and TRL's half runs with the repository before, not instead of, the caller's PYTHONPATH."""
    import subprocess

    import torch

    bench = load_module("bench_trl_parity")
    trl = {"optimizer": {"betas": "(0.9, 0.999)", "eps": "1e-08", "weight decay": "0.0"}}
    table = {k: (ours, theirs) for k, ours, theirs in bench.optimizer_settings(trl)}
    assert table["betas"] == ("(0.9, 0.95)", "(0.9, 0.999)") and table["eps"] == ("1e-08", "1e-08")
    assert table["weight decay"] == ("0.0", "0.0") and table["optimizer"][0] == "torch AdamW"
    assert table["gradient clipping (max norm)"][1] == "?"  # a setting TRL's file does not name

    seen = {}
    out = tmp_path / "trl"
    out.mkdir()
    torch.save({"loss": 0.0}, out / "grads.pt")
    monkeypatch.setenv("PYTHONPATH", "/users/site")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.update(cmd=cmd, env=kw["env"]))
    assert bench.trl_side("peer-python", "model", "batch.pt", str(tmp_path)) == {"loss": 0.0}
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/users/site"]
    assert seen["cmd"][:3] == ["peer-python", str(REPO / "bench" / "peers" / "trl_run.py"), "grpo_loss"]
