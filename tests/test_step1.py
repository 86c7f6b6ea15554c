"""Step 1 end to end: bad input fails fast with exit code 2 and a message naming the
culprit; real runs (ZeRO 0 through the CPU training script, ZeRO 2 + LoRA) lower the
perplexity and leave a folder plain transformers loads; prompt_eval compares two models."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_entry

MAIN = "step1_supervised_finetuning/main.py"
TINY_SCRIPT = REPO / "step1_supervised_finetuning" / "training_scripts" / "opt" / "cpu" / "run_tiny.sh"
QUICK = ["--model_name_or_path", "tiny-opt", "--max_seq_len", "64"]

BAD_INPUTS = {
    # case: (extra args, file to write (name, text) or None, fragments expected in stderr)
    "malformed_json_line": (["--data_path", "{dir}/bad.jsonl"],
                            ("bad.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": oops}\n'),
                            ["bad.jsonl", "malformed JSON on line 2"]),
    "missing_column": (["--data_path", "{dir}/nochosen.jsonl"],
                       ("nochosen.jsonl", '{"prompt": "a", "rejected": "c"}\n'),
                       ["nochosen.jsonl", "missing field 'chosen'"]),
    "unknown_dataset": (["--data_path", "nobody/no-such-dataset"], None,
                        ["nobody/no-such-dataset", "not a supported dataset name"]),
    "split_two_parts": (["--data_split", "2,4"], None, ["--data_split '2,4'", "expected 3"]),
    "split_not_numbers": (["--data_split", "a,b,c"], None, ["--data_split 'a,b,c'", "numbers"]),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every bad-input case, started at once (each pays Python + torch + DeepSpeed imports)."""
    base = tmp_path_factory.mktemp("bad_inputs")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    procs = {}
    for case, (args, file, _) in BAD_INPUTS.items():
        folder = base / case
        folder.mkdir()
        if file:
            (folder / file[0]).write_text(file[1])
        cmd = [sys.executable, str(REPO / MAIN), *QUICK, "--data_output_path", str(folder / "data"),
               "--output_dir", str(folder / "out"), *[a.format(dir=folder) for a in args]]
        procs[case] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True), folder)
    results = {}
    for case, (proc, folder) in procs.items():
        out, err = proc.communicate(timeout=300)
        results[case] = (proc.returncode, out, err, folder)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_fast_with_exit_code_2(case, bad_input_runs):
    rc, out, err, folder = bad_input_runs[case]
    assert rc == 2, (out, err)
    assert "Traceback" not in err
    message = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(message) == 1, err
    for fragment in BAD_INPUTS[case][2]:
        assert fragment in message[0]
    assert not (folder / "out").exists()  # failed before any set-up: no logger, model or DeepSpeed


def metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_loads_and_generates(folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not any("lora" in n for n, _ in model.named_parameters())
    inputs = tok(" Human: Describe the lamp. Assistant:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    return model, tok


@pytest.mark.slow
def test_zero0_run_via_cpu_script_lowers_perplexity(tmp_path):
    out = tmp_path / "zero0"
    proc = subprocess.run(
        ["bash", str(TINY_SCRIPT), str(out), "0", "--data_path", "builtin/preference-small",
         "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--max_steps", "5"],
        cwd=tmp_path, env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics(out)
    evals = [r for r in rows if r["phase"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 5
    assert evals[-1]["perplexity"] < 0.6 * evals[0]["perplexity"]
    # 80 samples / micro batch 8 = 10 micro batches = 5 optimizer steps of 2 micro batches each: the
    # step counter follows DeepSpeed's optimizer steps, so the logged lr is the cosine schedule's
    # lr_k = 1e-3 * (1 + cos(pi k / 5)) / 2 after k scheduler steps
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    for r in train:
        assert r["lr"] == pytest.approx(1e-3 * (1 + math.cos(math.pi * r["step"] / 5)) / 2, abs=1e-12)
    log = (out / "training.log").read_text()  # tee'd by the script, kept by the atomic save
    assert "perplexity: before" in log and "Samples/sec:" in log
    check_loads_and_generates(str(out))


@pytest.mark.smoke
@pytest.mark.slow
def test_zero2_lora_run_lowers_perplexity_and_saves_fused_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from utils.model.tiny import resolve_model_path

    out = tmp_path / "lora"
    proc = run_entry(MAIN, *QUICK, "--data_path", "builtin/preference-small", "--data_output_path", tmp_path / "data",
                     "--output_dir", out, "--per_device_train_batch_size", "8", "--max_steps", "8",
                     "--zero_stage", "2", "--lora_dim", "8", "--only_optimize_lora", "--lora_learning_rate", "1e-2",
                     "--eot_token", "<|foo|>", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = [r for r in metrics(out) if r["phase"] == "eval"]
    assert evals[-1]["step"] == 8 and evals[-1]["perplexity"] < 0.8 * evals[0]["perplexity"]
    model, tok = check_loads_and_generates(str(out))
    # phase-1 texts end with the tokenizer's EOS (as the reference), not with --eot_token
    (cached,) = [f for f in os.listdir(tmp_path / "data") if f.startswith("traindata_phase1_")]
    samples = torch.load(tmp_path / "data" / cached, weights_only=True)["samples"]
    assert len(samples) == 80 and all(s[-1] == tok.eos_token_id for s in samples)
    # the LoRA update was fused into the saved weights: the model is not the base model any more,
    # and (only LoRA trained) the embeddings are the base model's
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-opt")).eval()
    x = tok(" Human: Describe the lamp. Assistant: The lamp", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert (model(x).logits - base(x).logits).abs().max() > 1e-2
    torch.testing.assert_close(model.get_input_embeddings().weight, base.get_input_embeddings().weight)


@pytest.mark.slow
def test_prompt_eval_compares_two_local_folders(tmp_path):
    from utils.model.tiny import resolve_model_path

    baseline, finetune = tmp_path / "baseline", tmp_path / "finetune"
    shutil.copytree(resolve_model_path("tiny-opt"), baseline)
    shutil.copytree(resolve_model_path("tiny-llama"), finetune)  # its own tokenizer
    proc = run_entry("step1_supervised_finetuning/prompt_eval.py", "--model_name_or_path_baseline", baseline,
                     "--model_name_or_path_finetune", finetune, "--max_new_tokens", "4",
                     env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from step1_supervised_finetuning.prompt_eval import PROMPTS

    blocks = proc.stdout.split("====================prompt end=============================")
    assert len(blocks) == len(PROMPTS["English"]) + 1
    for prompt, block in zip(PROMPTS["English"], blocks):
        base_part, tuned_part = block.split("==========finetune: Greedy=========")
        assert "==========Baseline: Greedy=========" in base_part
        assert prompt in base_part and prompt in tuned_part  # each continuation starts with its prompt

    bad = run_entry("step1_supervised_finetuning/prompt_eval.py", "--model_name_or_path_baseline", baseline,
                    "--model_name_or_path_finetune", tmp_path / "missing")
    assert bad.returncode == 2 and "missing" in bad.stderr and "Traceback" not in bad.stderr


def test_progress_bars_count_the_micro_batches_that_run():
    """Steps 1, 2 and DPO: with --max_steps the epoch's bar counts the steps left, not the whole epoch (104
    micro-batches under --max_steps 20 in issue 23); tests/test_chat_template.py sees "0/3" on real runs."""
    from utils.training import micro_batches_to_run

    assert micro_batches_to_run(104) == 104 and micro_batches_to_run(104, max_steps=0, step=50) == 104
    assert micro_batches_to_run(104, max_steps=20) == 20
    assert micro_batches_to_run(104, max_steps=20, step=15, grad_accum=4) == 20  # 5 steps of 4 micro-batches
    assert micro_batches_to_run(30, max_steps=20, step=5, grad_accum=4) == 30  # the epoch ends first
    assert micro_batches_to_run(30, max_steps=20, step=20) == 0  # nothing left (a resumed, finished run)
