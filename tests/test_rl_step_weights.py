"""How much each token weighs in step 3's optimizer steps, by hand (issue 57's four points):

1. an optimizer step that spans two rounds weighs every one of its tokens the same (``WholeSteps``);
2. ``--dynamic_sampling``'s filler rows (and dropped answers) are in no denominator, Dr. GRPO's included;
3. the dynamic-sampling filter reads the task's reward, before ``--overlong_penalty`` (DAPO filters on accuracy);
4. GSPO's gradient at ratio 1 is GRPO's with each answer's tokens averaged, not the step's tokens (docs/benchmarks.md).
"""
import pytest
import torch
from torch.testing import assert_close

from step3_rlhf_finetuning.config import PPOConfig
from step3_rlhf_finetuning.ppo_trainer import Rollout, RoundCollector, WholeSteps
from tests.test_ppo_trainer import EOS, PAD, PROMPT_MASK, PROMPTS, make_rollout, make_trainer
from utils.rl_math import aggregate_loss, gspo_policy_loss, loss_count, ppo_policy_loss, step_normalizers


def t(data):
    return torch.tensor(data, dtype=torch.float32)


# =========================================================================== 1. a step across rounds


def masks(counts, width=6):
    """One micro-batch of one answer per count, whose first ``count`` tokens count."""
    return [t([[1.0] * c + [0.0] * (width - c)]) for c in counts]


def token_weights(rounds, per_step, whole_steps):
    """Train ``rounds`` (lists of micro-batch masks) as step 3 does, with DeepSpeed's accumulation: each micro-batch's
    loss ``Σ ℓ·m / normalizer`` with ``ℓ`` = the log-probs themselves, divided by ``per_step`` (the engine's scaling),
    a step every ``per_step`` micro-batches counted across rounds. Returns each micro-batch's gradient per token
    (its weight) and the step it landed in. ``whole_steps`` False: the old way, normalizers per round."""
    steps = WholeSteps(per_step)
    weights, micro_steps = {}, 0
    for r, round_masks in enumerate(rounds):
        schedule = [((r, i), m) for i, m in enumerate(round_masks)]
        if whole_steps:
            schedule = steps.take(schedule)
        norms = step_normalizers([float(loss_count(m, "token_mean")) for _, m in schedule], per_step)
        for (name, m), norm in zip(schedule, norms):
            log_probs = torch.zeros_like(m).requires_grad_()
            loss = aggregate_loss(log_probs, m, "token_mean", norm, 6) / per_step
            grad, = torch.autograd.grad(loss, log_probs)
            weights[name] = (micro_steps // per_step, grad[m > 0].unique().tolist())
            micro_steps += 1
    return weights


def test_a_step_that_spans_two_rounds_weighs_every_token_the_same():
    # rounds of 3 micro-batches with 3, 5, 2 and 4, 6, 1 tokens; 2 micro-batches a step: the steps are (3, 5),
    # (2 | 4) across the rounds, (6, 1): every token of a step weighs 1 / its step's tokens: 1/8, 1/6, 1/7
    rounds = [masks([3, 5, 2]), masks([4, 6, 1])]
    now = token_weights(rounds, 2, whole_steps=True)
    assert now == {(0, 0): (0, [pytest.approx(1 / 8)]), (0, 1): (0, [pytest.approx(1 / 8)]),
                   (0, 2): (1, [pytest.approx(1 / 6)]), (1, 0): (1, [pytest.approx(1 / 6)]),
                   (1, 1): (2, [pytest.approx(1 / 7)]), (1, 2): (2, [pytest.approx(1 / 7)])}
    # the old way, each round's normalizers on their own: round 1's last micro-batch was its own "step" of 2 tokens
    # (normalizer 2, then the engine's / 2: 1/4 a token), round 2's first was averaged with 6 (normalizer 5: 1/10):
    # in the step they share, 1.5× and 0.6× the step's token mean 1/6
    old = token_weights(rounds, 2, whole_steps=False)
    assert old[(0, 2)] == (1, [pytest.approx(1 / 4)]) and old[(1, 0)] == (1, [pytest.approx(1 / 10)])


def test_a_step_longer_than_a_round_waits_for_its_rounds():
    # 3 micro-batches a step, rounds of 2: the first round waits whole; then (2, 4 | 1) and (3 | 5, 5)
    rounds = [masks([2, 4]), masks([1, 3]), masks([5, 5])]
    now = token_weights(rounds, 3, whole_steps=True)
    assert {name: step for name, (step, _) in now.items()} == {(0, 0): 0, (0, 1): 0, (1, 0): 0, (1, 1): 1,
                                                               (2, 0): 1, (2, 1): 1}
    assert now[(0, 0)][1] == now[(1, 0)][1] == [pytest.approx(1 / 7)]
    assert now[(1, 1)][1] == now[(2, 1)][1] == [pytest.approx(1 / 13)]


def test_whole_steps_keeps_the_rest_and_carries_it_through_a_checkpoint():
    steps = WholeSteps(3)
    assert steps.take(["a", "b"]) == [] and steps.waiting == ["a", "b"]
    assert steps.take(["c", "d", "e", "f", "g"]) == ["a", "b", "c", "d", "e", "f"] and steps.waiting == ["g"]
    assert steps.take([]) == [] and steps.waiting == ["g"]
    with pytest.raises(ValueError):
        WholeSteps(0)
    # a waiting micro-batch (a view of its round) and its text survive torch.save / load(weights_only=True)
    trainer, _ = make_trainer([[3, 4, EOS], [4, 3, EOS], [3, 3, EOS]], scores=[1.0, 2.0, 3.0])
    micro = make_rollout(trainer, prompt_text=["x", "y", "z"], rows=[{"i": 0}, {"i": 1}, {"i": 2}]).micro_batches(2)
    steps = WholeSteps(2, [(micro[1], {"input_ids": torch.arange(3)})])
    import io
    buffer = io.BytesIO()
    torch.save(steps.state(), buffer)
    buffer.seek(0)
    again = WholeSteps.from_state(2, torch.load(buffer, weights_only=True))
    (back, text), = again.waiting
    assert isinstance(back, Rollout) and back.prompt_text == ["z"] and back.rows == [{"i": 2}]
    for name in ("input_ids", "action_mask", "advantages", "values", "scores"):
        assert torch.equal(getattr(back, name), getattr(micro[1], name)), name
    assert torch.equal(text["input_ids"], torch.arange(3)) and again.per_step == 2


# =========================================================================== 2. filler rows in no denominator


def test_dr_grpos_count_leaves_out_rows_that_are_no_answer():
    # rows: an answer of 2 tokens, an answer cut at the cap and masked out (--mask_truncated_answers: still an answer,
    # as TRL counts it), a filler row (valid 0): 2 answers of 3 rows
    mask, valid = t([[1, 1, 0], [0, 0, 0], [0, 0, 0]]), torch.tensor([1, 1, 0])
    assert loss_count(mask, "seq_mean_token_sum_norm", valid).item() == 2.0
    assert loss_count(mask, "seq_mean_token_sum_norm").item() == 3.0  # without valid: every row, as before
    assert loss_count(mask, "token_mean", valid).item() == 2.0  # the others count tokens: valid changes nothing
    assert loss_count(mask, "seq_mean_token_mean", valid).item() == 1.0


def test_a_round_with_filler_rows_trains_as_its_kept_rows_alone():
    """Dr. GRPO (``seq_mean_token_sum_norm``) on a dynamic-sampling round of 2 kept rows and 4 filler rows: its loss is
    that of the 2 kept rows on their own (before: scaled by kept / (kept + filled) = 1/3)."""
    ppo = PPOConfig(advantage_estimator="dr_grpo", n_samples_per_prompt=2, dynamic_sampling=True,
                    dynamic_sampling_max_batches=1)
    # answers of 3 and 4 actions: the advantages ±0.5 do not cancel in the loss's value
    trainer, _ = make_trainer([[3, 4, EOS, PAD], [3, 4, 5, EOS]] * 3, scores=[0.0] * 6, critic=False, reward_model=False,
                              ppo=ppo, do_sample=True)
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, ["a", "b", "c"], step=1)
    rollout.scores = t([1, 0, 1, 1, 0, 0])  # one informative group of 3: the round is filled with 2 dropped ones
    ready, _ = RoundCollector(trainer.ppo, groups_per_batch=3).add(rollout)
    assert ready.valid.tolist() == [1, 1, 0, 0, 0, 0]
    trainer.compute_advantages(ready)
    kept = ready.select(torch.tensor([0, 1]))
    assert trainer.loss_normalizers([ready], 1) == [2.0]
    step = trainer.actor_model.step
    trainer.actor_model.step = lambda: None  # the loss only: no update between the two
    whole, alone = trainer.train_step(ready)["actor_loss"], trainer.train_step(kept)["actor_loss"]
    trainer.actor_model.step = step
    assert whole.item() != 0 and whole.item() == pytest.approx(alone.item())


# =========================================================================== 3. the filter reads the task's reward


def test_dynamic_sampling_filters_on_the_task_reward_before_the_length_penalty():
    """Every answer right (reward 1) but of different lengths: with --overlong_penalty their scores differ (0.5 and
    0), yet the group tells the policy nothing about the task; DAPO filters it out. The score used for training keeps
    the penalty."""
    short, long = [3, 4, EOS, PAD], [3, 4, 5, EOS]  # cap 4, penalty over the last 2: −0.5 and −1
    ppo = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, overlong_penalty=2, dynamic_sampling=True,
                    dynamic_sampling_max_batches=1)
    trainer, _ = make_trainer([short, long, short, short, short, long], scores=[1.0] * 6, critic=False, ppo=ppo,
                              do_sample=True)
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, ["a", "b", "c"], step=1)
    rollout.scores = trainer.score(rollout)
    assert_close(rollout.scores, t([0.5, 0.0, 0.5, 0.5, 0.5, 0.0]))  # the penalty is in the training score
    assert_close(rollout.task_scores, t([1.0] * 6))
    ready, _ = RoundCollector(trainer.ppo, groups_per_batch=3).add(rollout)
    assert ready.info["groups_kept"] == 0 and ready.info["groups_filtered"] == 3  # before: groups a and c kept
    assert_close(ready.task_scores, t([1.0] * 6))  # carried through the round: step 3 logs it as task_reward
    # a group that differs on the task is kept, and trains on its scores with the penalty
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, ["a", "b", "c"], step=1)
    rollout.scores, rollout.task_scores = t([0.5, 0.0, 0.5, 0.5, 0.5, -1.0]), t([1, 1, 1, 1, 1, 0])
    ready, _ = RoundCollector(trainer.ppo, groups_per_batch=3).add(rollout)
    assert ready.info["groups_kept"] == 1 and ready.prompt_text[:2] == ["c", "c"]
    assert_close(ready.scores[:2], t([0.5, -1.0]))
    assert_close(ready.task_scores[:2], t([1.0, 0.0]))


# =========================================================================== 4. GSPO against GRPO at ratio 1


def test_gspo_at_ratio_one_is_grpo_with_each_answers_tokens_averaged():
    """Two answers of 1 and 3 tokens, advantage 1 each, every ratio 1. GSPO (its default ``seq_mean_token_mean``)
    weighs a token by 1 / (answers · its answer's length): −1/2 and −1/6; GRPO's ``token_mean`` by 1 / all tokens:
    −1/4 each. The two are equal only when every answer has the same length; with ``seq_mean_token_mean`` GRPO's
    PPO loss gives GSPO's gradient exactly."""
    mask = t([[1, 0, 0], [1, 1, 1]])
    advantages = t([[1, 1, 1], [1, 1, 1]]) * mask

    def grad(loss_fn, loss_agg):
        log_probs = torch.zeros(2, 3, requires_grad=True)
        per_token = loss_fn(log_probs, log_probs.detach(), advantages, mask, 0.2, 0.2)
        loss = aggregate_loss(per_token, mask, loss_agg, float(loss_count(mask, loss_agg)), 3)
        return torch.autograd.grad(loss, log_probs)[0]

    gspo = grad(gspo_policy_loss, "seq_mean_token_mean")
    assert_close(gspo, t([[-1 / 2, 0, 0], [-1 / 6, -1 / 6, -1 / 6]]))
    assert_close(grad(ppo_policy_loss, "token_mean"), t([[-1 / 4, 0, 0], [-1 / 4, -1 / 4, -1 / 4]]))
    assert_close(grad(ppo_policy_loss, "seq_mean_token_mean"), gspo)
