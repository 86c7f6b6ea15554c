"""Hand-computed checks of step 3's policy diagnostics (utils/rl_math.py: policy_ratio, ratio_clip_sums,
token_entropy), of their sums over micro-batches and ranks (step3_rlhf_finetuning/metrics.py), of the entropy read
from the training pass's logits (utils/model/lean_forward.py) and of the trainer's optimise() reporting them without
changing a loss."""
import math
import random

import pytest
import torch
from torch.testing import assert_close

from step3_rlhf_finetuning.config import PPOConfig
from step3_rlhf_finetuning.metrics import POLICY_METRICS, PolicyStats, TrainStats, all_reduce_metrics, step_line
from step3_rlhf_finetuning.rollout import Rollout, WholeSteps
from tests.test_ppo_trainer import EOS, PAD, make_rollout, make_trainer
from utils.rl_math import policy_ratio, ratio_clip_sums, token_entropy

LN2 = math.log(2.0)


# --------------------------------------------------------------------------- ratio


def test_token_ratio_is_exp_of_the_log_ratio_and_1_where_masked():
    log_probs = torch.tensor([[0.0, LN2, -LN2], [LN2, 0.0, float("nan")]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ratio = policy_ratio(log_probs, old, mask)
    assert_close(ratio, torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 1.0]]))
    assert not ratio.requires_grad  # a diagnostic: no gradient


def test_sequence_ratio_is_the_answer_mean_log_ratio_on_each_token():
    # row 0: log-ratios ln 2 and ln 8 counted, the third masked: s = exp((ln 2 + ln 8) / 2) = 4; row 1 nothing counted
    log_probs = torch.tensor([[LN2, 3 * LN2, 5.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    ratio = policy_ratio(log_probs, torch.zeros(2, 3), mask, sequence_level=True)
    assert_close(ratio, torch.tensor([[4.0, 4.0, 1.0], [1.0, 1.0, 1.0]]))


# --------------------------------------------------------------------------- clip fractions


def test_clip_sums_count_only_the_active_clips_of_counted_tokens():
    # bounds 1 − 0.2 = 0.8 and 1 + 0.28 = 1.28
    ratio = torch.tensor([[0.5, 0.9, 1.5, 1.1], [0.7, 1.3, 2.0, float("inf")]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0], [1.0, -1.0, 1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    sums = {k: v.item() for k, v in ratio_clip_sums(ratio, adv, mask, 0.2, 0.28).items()}
    # low: 0.5 with Â < 0 (0.7 has Â > 0: its clip is not active); high: 1.5 and 2.0 with Â > 0 (1.3 has Â < 0)
    assert sums == {"tokens": 7.0, "clip_low": 1.0, "clip_high": 2.0,
                    "ratio_sum": pytest.approx(0.5 + 0.9 + 1.5 + 1.1 + 0.7 + 1.3 + 2.0), "ratio_max": 2.0}


def test_clip_sums_without_a_counted_token_are_zero():
    sums = ratio_clip_sums(torch.full((2, 3), 9.0), torch.ones(2, 3), torch.zeros(2, 3), 0.2, 0.2)
    assert {k: v.item() for k, v in sums.items()} == {"tokens": 0.0, "clip_low": 0.0, "clip_high": 0.0,
                                                      "ratio_sum": 0.0, "ratio_max": 0.0}


def test_policy_stats_add_micro_batches_as_sums_then_divide():
    stats = PolicyStats()
    stats.add({"tokens": torch.tensor(4.0, dtype=torch.float64), "clip_low": torch.tensor(1.0, dtype=torch.float64),
               "clip_high": torch.tensor(0.0, dtype=torch.float64), "ratio_sum": torch.tensor(4.4, dtype=torch.float64),
               "ratio_max": torch.tensor(1.5, dtype=torch.float64)}, torch.tensor(2.0))
    stats.add({"tokens": torch.tensor(6.0, dtype=torch.float64), "clip_low": torch.tensor(0.0, dtype=torch.float64),
               "clip_high": torch.tensor(3.0, dtype=torch.float64), "ratio_sum": torch.tensor(6.6, dtype=torch.float64),
               "ratio_max": torch.tensor(1.2, dtype=torch.float64)}, torch.tensor(3.0))
    m = stats.metrics()
    assert stats.batches == 2 and list(m) == list(POLICY_METRICS)
    # 10 tokens: 1 clipped low, 3 high, Σρ = 11, max 1.5, ΣH = 5
    assert m == pytest.approx({"clip_frac_low": 0.1, "clip_frac_high": 0.3, "ratio_mean": 1.1, "ratio_max": 1.5,
                               "entropy": 0.5})
    assert PolicyStats().metrics() == {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "ratio_mean": 0.0,
                                       "ratio_max": 0.0, "entropy": 0.0}


# --------------------------------------------------------------------------- entropy


def test_token_entropy_by_hand():
    p = torch.tensor([0.5, 0.25, 0.25])
    logits = torch.stack([p.log(), torch.zeros(3), torch.tensor([30.0, 0.0, 0.0])])[None]  # [1, 3, 3]
    # H(½, ¼, ¼) = ½·ln 2 + 2·¼·ln 4 = 1.5·ln 2; uniform over 3: ln 3; nearly one-hot: ≈ 0
    assert_close(token_entropy(logits), torch.tensor([[1.5 * LN2, math.log(3.0), 0.0]]), atol=1e-6, rtol=1e-6)
    # at temperature 2, logits 2·ln p give the same distribution
    assert_close(token_entropy(2 * p.log()[None, None], temperature=2.0), torch.tensor([[1.5 * LN2]]))


def test_token_entropy_chunks_bf16_and_no_gradient():
    logits = torch.randn(5, 4, 7, requires_grad=True)
    whole = token_entropy(logits, 0.7, chunk_rows=100)
    assert_close(token_entropy(logits, 0.7, chunk_rows=2), whole)
    probs = torch.softmax(logits.detach() / 0.7, -1)
    assert_close(whole, -(probs * probs.log()).sum(-1))
    assert whole.dtype == torch.float32 and not whole.requires_grad
    assert token_entropy(logits.detach().bfloat16()).dtype == torch.float32


def test_answer_log_probs_entropy_is_that_of_the_full_logits():
    """The plain and the shared-prompt pass give the same log-probs with entropy as without, and the entropy of the
    full logits at the answer positions."""
    from tests.test_lean_forward import batch
    from transformers import AutoModelForCausalLM

    from utils.model.lean_forward import answer_log_probs, position_ids
    from utils.model.tiny import resolve_model_path

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.float32).eval()
    prompts, mask, answers, answer_mask = batch(lm)
    ids, full_mask = torch.cat([prompts, answers], 1), torch.cat([mask, answer_mask], 1)
    real = answer_mask.bool()
    with torch.no_grad():
        logits = lm(ids, attention_mask=full_mask, position_ids=position_ids(full_mask)).logits
        full = token_entropy(logits[:, prompts.shape[1] - 1:-1], 0.8)
        for share in (False, True):
            alone = answer_log_probs(lm, prompts, mask, answers, answer_mask, 3, 0.8, share_prompt=share)
            logps, entropy = answer_log_probs(lm, prompts, mask, answers, answer_mask, 3, 0.8, share_prompt=share,
                                              entropy=True)
            assert torch.equal(logps, alone) and entropy.shape == answers.shape
            assert_close(entropy[real], full[real], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the trainer


def test_optimise_reports_the_policy_metrics_and_trains_as_before():
    """Two runs from the same seed, one training micro-batches through train_step without statistics, the other
    through optimise: the same losses and weights; the statistics on the first pass are those of a ratio of 1."""
    answers = [[3, 4, EOS], [4, 3, EOS], [3, 3, EOS]]

    def fresh():
        torch.manual_seed(0)
        trainer, engine = make_trainer(answers, scores=[1.0, -1.0, 0.5], lr=0.1, ppo=PPOConfig(ppo_epochs=2))
        return trainer, engine, make_rollout(trainer)

    trainer, engine, rollout = fresh()
    random.seed(1)
    stats = trainer.optimise(rollout, None, WholeSteps(1), 2)
    assert isinstance(stats, TrainStats) and stats.policy.batches == 4 and stats.actor_rows == 6
    assert stats.policy.tokens == 2 * rollout.action_mask.sum().item()
    m = stats.policy.metrics()
    assert m["ratio_max"] >= 1.0 and 0.0 <= m["clip_frac_low"] <= 1 and m["entropy"] > 0
    after = [p.detach().clone() for p in engine.actor.module.parameters()]

    trainer2, engine2, rollout2 = fresh()
    random.seed(1)
    micro = rollout2.micro_batches(2)
    schedule = []
    for _ in range(2):
        schedule += micro
        random.shuffle(micro)
    normalizers = trainer2.loss_normalizers(schedule, 1)
    sums = {}
    for batch, normalizer in zip(schedule, normalizers):
        for name, value in trainer2.train_step(batch, normalizer).items():
            sums[name] = sums.get(name, 0.0) + value.item()
        trainer2.update_ema()
    assert stats.losses == {name: total / 4 for name, total in sums.items()}
    for a, b in zip(after, engine2.actor.module.parameters()):
        assert torch.equal(a, b)


def test_step_metrics_carry_the_policy_metrics_to_the_line():
    trainer, _ = make_trainer([[3, 4, EOS], [4, 3, EOS], [3, 3, EOS]], scores=[1.0, 2.0, 3.0])
    rollout = make_rollout(trainer)
    stats = TrainStats(losses={"actor_loss": 0.5, "critic_loss": 0.25})
    stats.policy.add(ratio_clip_sums(torch.tensor([[0.5, 2.0]]), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2),
                                     0.2, 0.2), torch.tensor(1.0))
    metrics = all_reduce_metrics(rollout, stats)
    assert metrics["clip_frac_low"] == 0.5 and metrics["clip_frac_high"] == 0.5
    assert metrics["ratio_mean"] == 1.25 and metrics["ratio_max"] == 2.0 and metrics["entropy"] == 0.5
    assert metrics["actor_loss"] == 0.5 and metrics["reward"] == pytest.approx(2.0)
    line = step_line(0, 1, dict(metrics, ema_reward=2.0, dropped=0))
    assert "ratio: mean 1.2500 max 2.0000, clipped: low 0.500 high 0.500, entropy: 0.5000" in line
    assert not any(k in all_reduce_metrics(rollout, TrainStats()) for k in POLICY_METRICS)  # nothing trained


def test_with_the_overlong_penalty_the_reward_before_it_is_logged_as_task_reward():
    """Scores 1, 2, 3; the answers have 3, 3 and 4 tokens (end token included) against a cap of 4 and the penalty
    over the last 2 tokens (free up to 2, −0.5 a token after, weight 2): −1, −1 and −2. The reward is their mean
    after it, (0 + 1 + 1) / 3; task_reward the mean before, 2. Without the penalty there is no task_reward."""
    answers, scores = [[3, 4, EOS, PAD], [4, 3, EOS, PAD], [3, 3, 3, EOS]], [1.0, 2.0, 3.0]
    trainer, _ = make_trainer(answers, scores=scores, ppo=PPOConfig(overlong_penalty=2, overlong_penalty_weight=2.0))
    rollout = make_rollout(trainer)
    assert_close(rollout.scores, torch.tensor([0.0, 1.0, 1.0]))
    metrics = all_reduce_metrics(rollout, TrainStats())
    assert metrics["reward"] == pytest.approx(2 / 3) and metrics["task_reward"] == pytest.approx(2.0)
    assert "before the overlong penalty: 2.0000" in step_line(0, 1, dict(metrics, ema_reward=1.0, dropped=0))
    plain = make_rollout(make_trainer(answers, scores=scores)[0])
    assert plain.task_scores is None and "task_reward" not in all_reduce_metrics(plain, TrainStats())


def test_a_batch_with_nothing_kept_is_said_once_and_not_scored():
    trainer, _ = make_trainer([[EOS, 2, 2]] * 3, scores=[1.0] * 3)
    said = []
    trainer.warn = said.append
    batch = {"prompt": torch.tensor([[5, 6, 7], [2, 6, 7], [2, 5, 6]]),
             "prompt_att_mask": torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1]]), "prompt_text": None, "rows": None}
    rollout = trainer.experience(batch, step=7)
    assert rollout.nothing_kept and rollout.scores is None
    assert said == ["generation batch 7: every answer had ≤ 1 token (3 dropped); nothing to score"]
    assert isinstance(rollout, Rollout)
