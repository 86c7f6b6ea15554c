"""Step 2 end to end: real hh-rlhf pairs, reload/score consistency, LoRA + ZeRO-2, bad input."""
import json

import pytest
import torch

from tests.conftest import run_entry, shared_data
from utils.data.builtin import generate

STEP2 = "step2_reward_model_finetuning/main.py"
RW_EVAL = "step2_reward_model_finetuning/rw_eval.py"
OMP = {"OMP_NUM_THREADS": "1"}


def _metrics(out_dir, phase):
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == phase]


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_hh_rlhf_trains_and_reloads_with_identical_scores(tmp_path):
    from step2_reward_model_finetuning.main import evaluate_reward
    from torch.utils.data import DataLoader, SequentialSampler

    from utils.data.data_utils import DataCollatorReward, create_prompt_dataset
    from utils.model.critic import load_reward_model

    data = shared_data("hh-rlhf", "harmless-base-test.jsonl.gz")
    out, cache = tmp_path / "rm", tmp_path / "data"
    _ok(run_entry(STEP2, "--model_name_or_path", "tiny-opt", "--data_path", data, "--data_output_path", cache,
                  "--output_dir", out, "--per_device_train_batch_size", 8, "--per_device_eval_batch_size", 8,
                  "--max_seq_len", 128, "--max_steps", 12, "--learning_rate", 1e-3, "--dropout", 0.0,
                  "--eval_iters", 4, "--num_padding_at_beginning", 1, env=OMP))

    evals, train = _metrics(out, "eval"), _metrics(out, "train")
    assert len(train) == 12 and all(r["loss"] > 0 for r in train)
    # 12 steps of a random 1 M-parameter model do not learn hh-rlhf (the held-out loss moves by noise,
    # either way, with the tiny model's seed): the model changed, and it neither diverged nor collapsed
    assert evals[-1]["chosen"] != evals[0]["chosen"] and evals[-1]["rejected"] != evals[0]["rejected"], evals
    assert 0.5 < evals[-1]["loss"] < 0.9 and evals[-1]["chosen"] != evals[-1]["rejected"], evals

    # the saved folder scores the eval set exactly like the model at the end of training
    model, tokenizer = load_reward_model(str(out))
    _, eval_set = create_prompt_dataset(-1, [str(data)], "2,4,4", str(cache), 2, 1234, tokenizer, 128,
                                        log=lambda *_: None)
    loader = DataLoader(eval_set, batch_size=8, sampler=SequentialSampler(eval_set),
                        collate_fn=DataCollatorReward(tokenizer.pad_token_id, 128))
    again = evaluate_reward(model, loader, torch.device("cpu"), eval_iters=4)
    for key in ("acc", "chosen", "rejected", "loss"):
        assert again[key] == pytest.approx(evals[-1][key], abs=1e-5), key

    # rw_eval prints/writes the same end scores as forward_value on the reloaded model (twice: deterministic)
    prompt = "\n\nHuman: How do I make a cake?\n\nAssistant:"
    answers = [" Mix flour, eggs and sugar, then bake it.", " I won't help with that."]
    rows = [{"prompt": prompt, "answer": a} for a in answers]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _ok(run_entry(RW_EVAL, "--model_name_or_path", out, "--input_file", tmp_path / "rows.jsonl",
                         "--output_file", tmp_path / "scores.jsonl", env=OMP))
    assert proc.stdout.count("score") == 2
    cli = [json.loads(line)["score"] for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    prompt_len = len(tokenizer(prompt)["input_ids"])
    for _ in range(2):
        batch = tokenizer([prompt + a + "<|endoftext|>" for a in answers], padding=True, return_tensors="pt")
        with torch.no_grad():
            direct = model.forward_value(**batch, prompt_length=prompt_len)["chosen_end_scores"].tolist()
        assert direct == pytest.approx(cli, abs=1e-5)


@pytest.mark.smoke
@pytest.mark.slow
def test_lora_zero2_only_optimize_lora_trains_v_head(tmp_path):
    from safetensors.torch import load_file

    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.runtime import set_random_seed

    out = tmp_path / "rm"
    proc = _ok(run_entry(STEP2, "--model_name_or_path", "tiny-opt", "--data_path", "builtin/preference-small",
                         "--data_output_path", tmp_path / "data", "--output_dir", out,
                         "--per_device_train_batch_size", 8, "--max_seq_len", 64, "--max_steps", 4,
                         "--eval_iters", 1, "--zero_stage", 2, "--lora_dim", 8, "--only_optimize_lora",
                         "--learning_rate", 1e-3, env=OMP))
    assert "eval after epoch 1" in proc.stdout

    # the model main() started from: same seed, same construction
    set_random_seed(1234)
    initial = create_critic_model("tiny-opt", load_hf_tokenizer("tiny-opt"), None, 1).state_dict()
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(initial)
    assert not torch.equal(saved["v_head.weight"], initial["v_head.weight"])  # v_head trained
    lora_layer = "rwtransformer.decoder.layers.0.fc1.weight"
    assert not torch.equal(saved[lora_layer], initial[lora_layer])  # LoRA update fused in
    for frozen in ("rwtransformer.decoder.embed_tokens.weight", "rwtransformer.decoder.layers.0.fc1.bias"):
        assert torch.equal(saved[frozen], initial[frozen]), frozen


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _bad_rows(n):
    rows = []
    for i in range(n):
        prompt = f" Human: Say {i}. Assistant:"
        rows.append({"prompt": prompt, "chosen": f" {i}", "rejected": f" {i}"} if i % 2 else
                    {"prompt": prompt, "chosen": f" {i}", "rejected": ""})
    return rows


@pytest.mark.slow
def test_no_usable_pairs_is_a_clear_error(tmp_path):
    data = _write_jsonl(tmp_path / "bad.jsonl", _bad_rows(40))
    proc = run_entry(STEP2, "--model_name_or_path", "tiny-opt", "--data_path", data, "--data_split", "0,1,0",
                     "--data_output_path", tmp_path / "data", "--output_dir", tmp_path / "rm", env=OMP)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error:") and "no usable rows for phase 2" in err and "tokenise identically" in err
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_some_bad_pairs_are_skipped_and_counted(tmp_path):
    rows = generate(60, seed=7) + _bad_rows(20)
    data = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    proc = _ok(run_entry(STEP2, "--model_name_or_path", "tiny-opt", "--data_path", data, "--data_split", "0,1,0",
                         "--data_output_path", tmp_path / "data", "--output_dir", tmp_path / "rm",
                         "--per_device_train_batch_size", 8, "--max_seq_len", 64, "--max_steps", 1,
                         "--eval_iters", 1, env=OMP))
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("data: phase 2")]
    assert skipped, proc.stdout[-2000:]
    counts = {}
    for line in skipped:  # "data: phase 2 train: kept K rows, skipped N × reason, M × reason"
        for part in line.split("skipped ", 1)[1].split(", "):
            n, reason = part.split(" × ")
            counts[reason] = counts.get(reason, 0) + int(n)
    assert counts == {"chosen and rejected tokenise identically": 10, "empty chosen or rejected answer": 10}


class ScriptedRewardModel(torch.nn.Module):
    """Stands in for a RewardModel: batch k scores chosen k and rejected 0 for its 2 pairs, loss k."""

    def forward(self, k, use_cache=False):
        k = k.double()
        return {"chosen_mean_scores": k, "rejected_mean_scores": torch.zeros_like(k), "loss": k[0]}


def test_eval_iters_0_evaluates_the_whole_split_as_the_reference():
    from step2_reward_model_finetuning.main import evaluate_reward

    loader = [{"k": torch.tensor([float(k), float(k)])} for k in range(3)]  # 3 batches of 2 pairs
    whole = evaluate_reward(ScriptedRewardModel(), loader, torch.device("cpu"), eval_iters=0)
    assert whole["chosen"] == pytest.approx(1.0) and whole["loss"] == pytest.approx(1.0)  # (0+1+2)/3
    assert whole["acc"] == pytest.approx(4 / 6)  # batch 0's pairs tie (0 vs 0): not counted as right
    first_two = evaluate_reward(ScriptedRewardModel(), loader, torch.device("cpu"), eval_iters=2)
    assert first_two["chosen"] == pytest.approx(0.5) and first_two["loss"] == pytest.approx(0.5)


def test_negative_eval_iters_is_refused():
    from step2_reward_model_finetuning.main import parse_args
    from utils.arguments import validate_common
    from utils.errors import UserInputError

    with pytest.raises(UserInputError, match="--eval_iters must be ≥ 0"):
        validate_common(parse_args(["--eval_iters", "-1"]))


@pytest.mark.slow
def test_an_epoch_ending_on_an_interval_evaluation_is_not_evaluated_twice(tmp_path):
    """``--eval_interval 1`` over two epochs: every step is evaluated once (the first epoch's last step by the
    interval, its end reusing that), the log still says "eval after epoch 1"; the last step once, after the
    epoch."""
    out = tmp_path / "rm"
    proc = _ok(run_entry(STEP2, "--model_name_or_path", "tiny-opt", "--data_path", "builtin/preference-small",
                         "--data_output_path", tmp_path / "data", "--output_dir", out, "--num_train_epochs", 2,
                         "--per_device_train_batch_size", 64, "--max_seq_len", 64, "--eval_interval", 1,
                         "--eval_iters", 1, env=OMP))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("phase") == "eval"]
    assert steps == list(range(len(steps))) and len(steps) >= 4, steps
    assert "eval after epoch 1: as at step" in proc.stdout and "eval after epoch 2: chosen" in proc.stdout
