"""DPO (step 2 alternative): answer-token mask, and a short run whose implicit reward margin grows."""
import json

import pytest
import torch

from tests.conftest import run_entry

DPO = "step2_dpo_finetuning/main.py"


def test_dpo_loss_mask_drops_shared_prefix_keeps_eos():
    from step2_dpo_finetuning.main import dpo_loss_mask

    # B = 1: chosen "P P a b E", rejected "P P c E"; pad = eos = 9 (OPT style), EOS kept by attention_mask
    ids = torch.tensor([[1, 2, 3, 4, 9, 9],
                        [1, 2, 5, 9, 9, 9]])
    att = torch.tensor([[1, 1, 1, 1, 1, 0],
                        [1, 1, 1, 1, 0, 0]])
    assert dpo_loss_mask(ids, att).tolist() == [[0, 0, 1, 1, 1, 0],
                                                [0, 0, 1, 1, 0, 0]]


class CountingLM(torch.nn.Module):
    """Uniform next-token logits over 4 tokens; counts its forward calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        self.calls += 1
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 4)})()


def test_dpo_evaluates_the_whole_eval_split_by_default_as_the_reference():
    """DeepSpeed-Chat's DPO evaluates every eval batch (its reward-model step stops at --eval_iters 100)."""
    from step2_dpo_finetuning.main import evaluate_dpo, parse_args
    from step2_reward_model_finetuning.main import parse_args as step2_args

    assert (parse_args([]).eval_iters, step2_args([]).eval_iters) == (0, 100)
    pair = {"input_ids": torch.tensor([[1, 2, 3], [1, 2, 0]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    model, ref = CountingLM(), CountingLM()
    metrics = evaluate_dpo(model, ref, [pair] * 150, torch.device("cpu"), parse_args([]).eval_iters, 0.1, 0.0)
    assert model.calls == ref.calls == 150
    assert metrics["loss"] == pytest.approx(0.6931, abs=1e-4)  # equal policies: -log σ(0)


@pytest.mark.smoke
@pytest.mark.slow
def test_dpo_margin_grows_and_saves_a_causal_lm(tmp_path):
    out = tmp_path / "dpo"
    proc = run_entry(DPO, "--model_name_or_path", "tiny-opt", "--data_path", "builtin/preference-small",
                     "--data_output_path", tmp_path / "data", "--output_dir", out,
                     "--per_device_train_batch_size", 8, "--max_seq_len", 64, "--max_steps", 8,
                     "--eval_iters", 2, "--dropout", 0.0, "--learning_rate", 1e-3, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] == "eval"]
    train = [r for r in rows if r["phase"] == "train"]
    # policy == reference before training: every implicit reward is exactly 0
    assert evals[0]["margin"] == 0.0 and evals[0]["chosen_reward"] == 0.0 and evals[0]["loss"] == pytest.approx(
        0.6931, abs=1e-4)
    # built-in pairs (v4) differ by a word or two, so 8 steps move the margin by ~0.03 (0.029 measured)
    assert evals[-1]["margin"] > 0.02 and evals[-1]["acc"] > 0.5 and evals[-1]["loss"] < evals[0]["loss"]
    assert len(train) == 8  # (a single training batch's margin is too noisy to compare; the eval rows above are not)
    for key in ("loss", "chosen_reward", "rejected_reward", "margin", "acc"):
        assert key in train[-1]

    # the result is a plain causal LM that from_pretrained loads
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "opt"
