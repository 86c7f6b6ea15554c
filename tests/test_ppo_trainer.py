"""Trainer-level checks of step 3 (PPO) on hand-made models: no DeepSpeed engine, fast.

The math itself is tested in test_rl_math.py; here: that the trainer wires it
correctly (masks, EOS with pad == eos, dropped answers, the PPO update's direction,
the reference left alone, EMA, groups of answers, reward functions, the critic-free
estimators), the rollout record, the throughput numbers, the unsupervised text packing
and step 3's up-front argument checks.
"""
import math
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from step3_rlhf_finetuning.config import GenerationConfig, PPOConfig, RewardConfig
from step3_rlhf_finetuning.main import parse_args, validate_step3
from step3_rlhf_finetuning.ppo_trainer import (DeepSpeedPPOTrainer, Rollout, RoundCollector, WholeSteps,
                                               cut_batches, end_of_answer_token_ids)
from utils.data.unsupervised import get_unsupervised_data, pack_tokens
from utils.errors import UserInputError
from utils.rl_math import loss_count
from utils.perf import step3_throughput, throughput_lines, transformer_flops

EOS = PAD = 2  # OPT-style tokenizer: pad == eos
V = 8


# --------------------------------------------------------------------------- fakes


class TinyLM(nn.Module):
    """Embedding + linear LM; ``generate`` returns scripted answers (or asks the real logits nothing)."""

    def __init__(self, answers=None, seed=0, dropout=0.0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, 4)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(4, V)
        self.answers = answers
        self.config = SimpleNamespace(num_hidden_layers=1, hidden_size=4, vocab_size=V)
        self.generate_kwargs = None

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.head(self.dropout(self.emb(input_ids))))

    def generate(self, prompts, **kwargs):
        self.generate_kwargs = kwargs
        return torch.cat([prompts, self.answers], dim=1)


class FakeRewardModel(nn.Module):
    """Values = a learnable per-token table; end score = a fixed score per row."""

    def __init__(self, scores):
        super().__init__()
        self.table = nn.Embedding(V, 1)
        nn.init.zeros_(self.table.weight)
        self.scores = torch.tensor(scores, dtype=torch.float32)
        self.seen_prompt_length = None

    def forward_value(self, input_ids, attention_mask=None, return_value_only=False, prompt_length=0, group_size=1):
        self.seen_group_size = group_size
        values = self.table(input_ids).squeeze(-1)
        if return_value_only:
            return values
        self.seen_prompt_length = prompt_length
        return {"values": values, "chosen_end_scores": self.scores[: input_ids.shape[0]]}


class FakeEngine(nn.Module):
    """What the trainer uses of a DeepSpeed engine: ``module``, call, backward, step (+ forward_value)."""

    def __init__(self, module, lr=None, autocast=None):
        super().__init__()
        self.module = module
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr) if lr is not None else None
        self.autocast = autocast  # the dtype of DeepSpeed's torch_autocast section, or None

    def torch_autocast_enabled(self):
        return self.autocast is not None

    def torch_autocast_dtype(self):
        return self.autocast

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def forward_value(self, *args, **kwargs):
        return self.module.forward_value(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()

    def zero_optimization_stage(self):
        return 0


def decode(ids, skip_special_tokens=True):
    """The fake tokenizer's text of token ids: one letter per id (the EOS/pad id 2 is special)."""
    return "".join("abcdefgh"[i] for i in ids if not (skip_special_tokens and i == EOS))


def make_trainer(answers, scores, lr=0.5, ema=False, dropout=0.0, ema_beta=0.992, unsup_coef=27.8, critic=True,
                 reward_model=True, reward=None, reward_fn=None, ppo=None, autocast=None, **generation):
    """A trainer on fake engines; ``generation`` overrides :class:`GenerationConfig` fields (answers ≤ 4 tokens);
    ``autocast``: the engines' torch_autocast dtype (``--torch_autocast``)."""
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, unk_token_id=None, decode=decode,
                                batch_decode=lambda rows, **kw: [decode(r, **kw) for r in rows])
    engine = SimpleNamespace(actor=FakeEngine(TinyLM(torch.tensor(answers), dropout=dropout), lr=lr, autocast=autocast),
                             ref=FakeEngine(TinyLM(), autocast=autocast),
                             critic=FakeEngine(FakeRewardModel(scores), lr=lr, autocast=autocast) if critic else None,
                             reward=FakeEngine(FakeRewardModel(scores), autocast=autocast) if reward_model else None,
                             actor_ema=FakeEngine(TinyLM(seed=1)) if ema else None, tokenizer=tokenizer)
    ppo = ppo or PPOConfig(ema_beta=ema_beta, unsup_coef=unsup_coef)
    trainer = DeepSpeedPPOTrainer(engine, ppo, GenerationConfig(**{"max_answer_seq_len": 4, **generation}),
                                  reward=reward, reward_fn=reward_fn)
    return trainer, engine


def make_rollout(trainer, prompts=None, mask=None, **kwargs):
    """generate -> score -> advantages, as step 3's loop does for a round of one batch."""
    rollout = trainer.generate(PROMPTS if prompts is None else prompts, PROMPT_MASK if mask is None else mask,
                               step=1, **kwargs)
    rollout.scores = trainer.score(rollout)
    trainer.compute_advantages(rollout)
    return rollout


# prompts: P = 3, left padded (row 1 has one pad; its BOS-like first token 2 = pad is visible per the mask)
PROMPTS = torch.tensor([[5, 6, 7], [PAD, 6, 7], [2, 5, 6]])
PROMPT_MASK = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1]])


# --------------------------------------------------------------------------- experience


def test_experience_masks_keep_the_generated_eos_and_drop_empty_answers():
    # row 0: 2 real tokens + EOS (kept); row 1: 1 real token + EOS (dropped: ≤ 1 token);
    # row 2: EOS right away (dropped). Generation stopped after 3 new tokens: the answers are 3 columns wide (not
    # padded to --max_answer_seq_len 4: nothing would read the 4th).
    answers = [[3, 4, EOS], [3, EOS, PAD], [EOS, PAD, PAD]]
    trainer, engine = make_trainer(answers, scores=[1.0, 2.0, 3.0], dropout=0.5)
    exp = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    assert engine.actor.module.training  # back in train mode for PPO ...

    assert exp.input_ids.shape == (3, 6)
    assert exp.input_ids[0].tolist() == [5, 6, 7, 3, 4, EOS]
    assert exp.valid.tolist() == [1, 0, 0]
    assert exp.answer_len.tolist() == [2, 1, 0]
    assert exp.answers == ["de", "d", ""]  # decoded up to the end token
    assert exp.info["dropped"] == 2 and exp.info["kept"] == 1 and exp.info["sequences"] == 3
    # attention: the prompt mask as given + answer up to and including its first EOS (pad == eos!)
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    # one action per answer token: row 0 counts 3, 4 and EOS; dropped rows count nothing
    assert exp.action_mask.tolist() == [[1, 1, 1], [0] * 3, [0] * 3]
    assert trainer.score(exp).tolist() == [1.0, 2.0, 3.0]
    assert engine.reward.module.seen_prompt_length == 3
    assert engine.reward.module.seen_group_size == 1  # each row its own prompt (G answers to one: G, shared)
    kw = engine.actor.module.generate_kwargs
    assert kw["max_new_tokens"] == 4 and kw["pad_token_id"] == PAD and kw["eos_token_id"] == [EOS]
    assert kw["use_cache"] is True and kw["do_sample"] is False and kw["synced_gpus"] is False
    # ... but log π_old was computed without dropout (the model's deterministic eval-mode output)
    engine.actor.module.eval()
    logits = engine.actor.module(exp.input_ids).logits
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, exp.input_ids[:, 1:, None]).squeeze(-1)
    assert_close(exp.logprobs, expected[:, 2:])  # the answer actions: from position P − 1 = 2 on


def test_a_batch_of_empty_answers_is_skipped_not_a_crash():
    trainer, _ = make_trainer([[EOS, PAD, PAD]] * 3, scores=[0.0] * 3)
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    assert rollout.info["kept"] == 0 and rollout.info["dropped"] == 3  # main skips the round


def test_sampling_flags_reach_generate():
    trainer, engine = make_trainer([[3, 4, EOS]] * 3, scores=[0.0] * 3, do_sample=True, temperature=0.7, top_k=5,
                                   top_p=0.9)
    exp = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    kw = engine.actor.module.generate_kwargs
    # generate decodes greedily over what the sampling processor drew (no torch.multinomial: utils.generation)
    (sampler,) = kw["logits_processor"]
    assert kw["do_sample"] is False and (sampler.temperature, sampler.top_k, sampler.top_p) == (0.7, 5, 0.9)
    # log-probs of the distribution the answers were sampled from: logits / temperature
    logits = engine.ref.module(exp.input_ids).logits / 0.7
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, exp.input_ids[:, 1:, None]).squeeze(-1)
    assert_close(exp.ref_logprobs, expected[:, 2:])


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_torch_autocast_covers_the_forwards_that_bypass_the_engine_and_no_backward(autocast):
    """--torch_autocast: DeepSpeed autocasts the engine's own forward; generation and forward_value call the module
    directly, so the trainer runs them under the same autocast. Backward runs outside it."""
    trainer, engine = make_trainer([[3, 4, EOS]] * 3, scores=[1.0, -1.0, 1.0], autocast=autocast)
    seen = {}

    def record(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, []).append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                                             else None)
            return fn(*args, **kwargs)
        return wrapped

    engine.actor.module.generate = record("generate", engine.actor.module.generate)
    engine.reward.module.forward_value = record("reward", engine.reward.module.forward_value)
    engine.critic.module.forward_value = record("critic", engine.critic.module.forward_value)
    engine.actor.backward = record("backward", engine.actor.backward)
    trainer.train_step(make_rollout(trainer))
    assert seen == {"generate": [autocast], "reward": [autocast], "critic": [autocast, autocast],
                    "backward": [None]}


def test_generation_dtype_generates_from_a_bf16_copy_refreshed_after_each_step():
    """--generation_dtype bf16 under --torch_autocast: answers come from the copy, in bf16 and outside autocast, with
    the actor's weights as they are after its last step; the actor's own module generates nothing."""
    trainer, engine = make_trainer([[3, 4, EOS]] * 3, scores=[1.0, -1.0, 1.0], autocast=torch.bfloat16,
                                   dtype="bf16")
    copy = trainer.generation_copy.module
    seen = []

    def record(module):
        def generate(prompts, **kwargs):
            seen.append((module.head.weight.dtype, torch.is_autocast_enabled("cpu"), module.head.weight.clone()))
            return torch.cat([prompts, module.answers], dim=1)
        return generate

    copy.generate = record(copy)
    engine.actor.module.generate = lambda *a, **k: pytest.fail("the actor's own module generated")
    trainer.train_step(make_rollout(trainer))
    updated = engine.actor.module.head.weight.detach().clone()
    make_rollout(trainer)
    assert [(dtype, autocast) for dtype, autocast, _ in seen] == [(torch.bfloat16, False)] * 2
    assert not torch.equal(seen[0][2], seen[1][2])  # the step moved the weights the second generation used
    assert torch.equal(seen[1][2], updated.to(torch.bfloat16))


# --------------------------------------------------------------------------- training


def answer_logprob(model, seq, row, t):
    """log π(seq[row, t+1] | seq[row, :t+1])."""
    logits = model(seq).logits
    return torch.log_softmax(logits[row, t], -1)[seq[row, t + 1]].item()


def test_ppo_update_moves_towards_rewarded_answers_and_leaves_the_reference_alone():
    # same answer "3 4 EOS" in all rows; rows scored +4 / -4 / +4 with a zero critic:
    # the advantage of every action is ±(score − KL terms) → the update must raise the
    # probability of the positively scored row's actions more than... here, all rows share
    # the answer, so the net push is positive: log π(EOS action) must go up.
    answers = [[3, 4, EOS]] * 3
    trainer, engine = make_trainer(answers, scores=[4.0, -1.0, 4.0], lr=0.5)
    ref_before = [p.detach().clone() for p in engine.ref.module.parameters()]
    exp = make_rollout(trainer)
    seq = exp.input_ids
    before = answer_logprob(engine.actor.module, seq, 0, 4)  # action t = 4 emits EOS (index 5)
    losses = trainer.train_step(exp)
    after = answer_logprob(engine.actor.module, seq, 0, 4)
    assert after > before
    assert math.isfinite(losses["actor_loss"].item()) and losses["critic_loss"].item() > 0
    assert "kl_loss" not in losses  # PPO: the KL penalty is in the reward
    for p, q in zip(engine.ref.module.parameters(), ref_before):
        assert torch.equal(p, q)
    # the critic learned towards the positive return at the EOS action's state (token 4's value)
    assert engine.critic.module.table.weight[4].item() > 0


def test_whiten_advantages_whitens_gae_advantages_and_leaves_the_returns():
    # --whiten_advantages on PPO (off by default, as DeepSpeed-Chat): the same GAE advantages, centred and scaled
    # over the counted actions of the batch (population variance), the critic's returns untouched
    answers = [[3, 4, EOS], [3, EOS, PAD], [4, 4, EOS]]
    plain = make_rollout(make_trainer(answers, scores=[4.0, -1.0, 2.0])[0])
    whitened = make_rollout(make_trainer(answers, scores=[4.0, -1.0, 2.0],
                                         ppo=PPOConfig(whiten_advantages=True))[0])
    assert not PPOConfig().whiten_advantages and PPOConfig(advantage_estimator="reinforce").whiten_advantages
    counted = plain.action_mask.bool()
    a = plain.advantages[counted].double()
    mean, var = a.mean(), ((a - a.mean()) ** 2).mean()
    expected = torch.zeros_like(plain.advantages)
    expected[counted] = ((a - mean) / torch.sqrt(var + 1e-8)).float()
    assert_close(whitened.advantages, expected)
    assert torch.equal(whitened.returns, plain.returns)
    assert not torch.allclose(plain.advantages[counted], whitened.advantages[counted])


def test_negative_scores_push_the_answer_down():
    trainer, engine = make_trainer([[3, 4, EOS]] * 3, scores=[-4.0] * 3, lr=0.5)
    exp = make_rollout(trainer)
    before = answer_logprob(engine.actor.module, exp.input_ids, 0, 4)
    trainer.train_step(exp)
    assert answer_logprob(engine.actor.module, exp.input_ids, 0, 4) < before


def test_dropped_rows_give_no_gradient():
    # only row 0 is kept; its tokens never include 6 as an action target, and row 1/2 answers use token 1.
    answers = [[3, 4, EOS], [1, EOS, PAD], [EOS, PAD, PAD]]
    trainer, engine = make_trainer(answers, scores=[1.0, 100.0, 100.0], lr=0.0)
    exp = make_rollout(trainer)
    engine.actor.optimizer = None
    engine.actor.step = lambda: None  # keep the gradient for inspection
    engine.critic.step = lambda: None
    trainer.train_step(exp)
    grad = engine.actor.module.head.weight.grad
    # the LM head row of token 1 (only a dropped row's answer) gets gradient only through the
    # softmax normaliser of row 0's actions — compare with a run where rows 1/2 are absent
    trainer2, engine2 = make_trainer([[3, 4, EOS]], scores=[1.0], lr=0.0)
    exp2 = make_rollout(trainer2, PROMPTS[:1], PROMPT_MASK[:1])
    engine2.actor.step = lambda: None
    engine2.critic.step = lambda: None
    trainer2.train_step(exp2)
    assert_close(grad, engine2.actor.module.head.weight.grad)


def test_unsupervised_step_is_the_lm_loss_times_the_coefficient():
    trainer, engine = make_trainer([[3, 4, EOS]] * 3, scores=[0.0] * 3, lr=0.1, unsup_coef=2.0)
    ids = torch.tensor([[5, 6, 7, 3]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    logits = engine.actor.module(ids).logits
    expected = nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    loss = trainer.train_unsupervised(batch)
    assert loss.item() == pytest.approx(expected)


def test_ema_update_is_beta_weighted():
    trainer, engine = make_trainer([[3, 4, EOS]] * 3, scores=[0.0] * 3, ema=True, ema_beta=0.9)
    actor = [p.detach().clone() for p in engine.actor.module.parameters()]
    ema = [p.detach().clone() for p in engine.actor_ema.module.parameters()]
    trainer.update_ema()
    for new, a, e in zip(engine.actor_ema.module.parameters(), actor, ema):
        assert_close(new.detach(), 0.9 * e + 0.1 * a)


# --------------------------------------------------------------------------- groups, reward functions, critic-free


def answer_is_de(prompts, answers, rows):
    """A reward function: 1 for the answer "de" (tokens 3 4), else 0."""
    return [float(a == "de") for a in answers]


def test_a_prompts_answers_stay_together_as_one_group():
    # 3 prompts x G = 2: the actor sees each prompt twice, next to each other
    answers = [[3, 4, EOS], [3, 3, EOS], [4, 4, EOS], [3, 4, EOS], [3, 4, EOS], [4, 3, EOS]]
    ppo = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2)
    trainer, engine = make_trainer(answers, scores=[0.0] * 6, critic=False, reward_model=False,
                                   reward=RewardConfig(fn="answer_is_de"), reward_fn=answer_is_de, ppo=ppo,
                                   do_sample=True)
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, ["p0", "p1", "p2"], [{"i": 0}, {"i": 1}, {"i": 2}], step=1)
    assert rollout.prompts.tolist() == PROMPTS.repeat_interleave(2, 0).tolist() and rollout.group_size == 2
    assert rollout.prompt_text == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert [r["i"] for r in rollout.rows] == [0, 0, 1, 1, 2, 2]
    assert rollout.values is None  # no critic
    rollout.scores = trainer.score(rollout)
    assert rollout.scores.tolist() == [1, 0, 0, 1, 1, 0]
    trainer.compute_advantages(rollout)
    # each group has one right and one wrong answer: ±(0.5 / sqrt(0.5)) = ±0.7071 on every answer action
    per_row = rollout.advantages.sum(1) / rollout.action_mask.sum(1)
    assert_close(per_row, torch.tensor([1, -1, -1, 1, 1, -1]) * math.sqrt(0.5))
    assert (rollout.advantages[rollout.action_mask == 0] == 0).all()

    before = answer_logprob(engine.actor.module, rollout.input_ids, 0, 3)  # P(4 | prompt, 3): "de" over "dd"
    losses = trainer.train_step(rollout)
    assert set(losses) == {"actor_loss", "kl_loss"}  # GRPO: KL in the loss (k3), no critic
    assert losses["kl_loss"].item() == pytest.approx(0.0, abs=1e-6)  # actor and reference start equal: k3 = 0
    assert answer_logprob(engine.actor.module, rollout.input_ids, 0, 3) > before


def test_reward_model_plus_weighted_reward_function():
    trainer, _ = make_trainer([[3, 4, EOS], [4, 4, EOS], [3, 4, EOS]], scores=[1.0, 2.0, 3.0],
                              reward=RewardConfig(fn="answer_is_de", fn_weight=0.5), reward_fn=answer_is_de)
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    assert trainer.score(rollout).tolist() == [1.5, 2.0, 3.5]


def test_reward_function_errors_name_the_function_and_the_row():
    def broken(prompts, answers, rows):
        return [1.0 / (a != "ee") for a in answers]  # ZeroDivisionError on "ee"

    trainer, _ = make_trainer([[3, 4, EOS], [4, 4, EOS], [3, 4, EOS]], scores=[0.0] * 3, reward_model=False,
                              reward=RewardConfig(fn="my.py:broken"), reward_fn=broken)
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, ["q0", "q1", "q2"], step=1)
    with pytest.raises(UserInputError, match=r"--reward_fn my.py:broken raised ZeroDivisionError: .* on row 1 "
                                             r"\(prompt 'q1'\)"):
        trainer.score(rollout)


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo", "reinforce_baseline", "reinforce"])
def test_each_critic_free_estimator_pushes_towards_the_rewarded_answer(estimator):
    answers = [[3, 4, EOS], [3, 3, EOS]] * 3
    ppo = PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=2)
    trainer, engine = make_trainer(answers, scores=[0.0] * 6, critic=False, reward_model=False,
                                   reward=RewardConfig(fn="answer_is_de"), reward_fn=answer_is_de, ppo=ppo,
                                   do_sample=True, lr=0.2)
    rollout = make_rollout(trainer)
    right, wrong = rollout.advantages[0].sum(), rollout.advantages[1].sum()
    assert right > 0 > wrong, (estimator, rollout.advantages)
    if estimator.startswith("reinforce"):  # whitened over the batch: mean 0, variance 1 over the counted tokens
        counted = rollout.advantages[rollout.action_mask == 1]
        assert counted.mean().abs() < 1e-5 and (counted.pow(2).mean() - 1).abs() < 1e-3
    before = answer_logprob(engine.actor.module, rollout.input_ids, 0, 3)
    losses = trainer.train_step(rollout)
    assert "critic_loss" not in losses and ("kl_loss" in losses) == (estimator == "dr_grpo")
    assert answer_logprob(engine.actor.module, rollout.input_ids, 0, 3) > before


# --------------------------------------------------------------------------- DAPO's pieces in the trainer


def test_truncated_answers_count_in_no_loss_but_in_their_groups_statistics():
    # one prompt, G = 2: answer 0 has no end token within --max_answer_seq_len 4 (cut), answer 1 ends
    answers = [[3, 4, 5, 6], [3, 4, EOS, PAD]]
    for masked in (False, True):
        ppo = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, mask_truncated_answers=masked)
        trainer, _ = make_trainer(answers, scores=[0.0] * 2, critic=False, reward_model=False,
                                  reward=RewardConfig(fn="answer_is_de"), reward_fn=lambda p, a, r: [1.0, 0.0],
                                  ppo=ppo, do_sample=True)
        rollout = make_rollout(trainer, PROMPTS[:1], PROMPT_MASK[:1])
        assert rollout.truncated.tolist() == [1, 0] and rollout.valid.tolist() == [1, 1]
        assert rollout.action_mask.tolist() == [[0, 0, 0, 0] if masked else [1, 1, 1, 1], [1, 1, 1, 0]]
        # the cut answer's score 1 still makes the group's mean: the other answer's advantage is −0.5 / std(1, 0)
        assert_close(rollout.advantages[1, :3], torch.full((3,), -math.sqrt(0.5)))
        assert (rollout.advantages[0] == 0).all() == masked
        losses = trainer.train_step(rollout)
        assert math.isfinite(losses["actor_loss"].item())


def test_overlong_penalty_is_added_to_the_score():
    # --max_answer_seq_len 4, --overlong_penalty 2: free up to 2 tokens (the end token counted), then −0.5 a token
    answers = [[3, EOS, PAD, PAD], [3, 4, EOS, PAD], [3, 4, 5, 6]]
    trainer, _ = make_trainer(answers, scores=[1.0, 1.0, 1.0], ppo=PPOConfig(overlong_penalty=2))
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    assert_close(trainer.score(rollout), torch.tensor([1.0, 0.5, 0.0]))
    # --overlong_penalty_weight 0.25: the same penalty a quarter as large (−0.25 at the cap)
    trainer, _ = make_trainer(answers, scores=[1.0, 1.0, 1.0],
                              ppo=PPOConfig(overlong_penalty=2, overlong_penalty_weight=0.25))
    assert_close(trainer.score(trainer.generate(PROMPTS, PROMPT_MASK, step=1)), torch.tensor([1.0, 0.875, 0.75]))


def test_each_policy_loss_trains_through_the_trainer_and_the_normaliser_is_the_callers():
    answers = [[3, 4, EOS], [3, 3, EOS]] * 3
    for policy_loss in ("ppo", "gspo", "cispo"):
        ppo = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, policy_loss=policy_loss)
        trainer, engine = make_trainer(answers, scores=[0.0] * 6, critic=False, reward_model=False,
                                       reward=RewardConfig(fn="answer_is_de"), reward_fn=answer_is_de, ppo=ppo,
                                       do_sample=True, lr=0.2)
        rollout = make_rollout(trainer)
        step, engine.actor.step = engine.actor.step, engine.actor.optimizer.zero_grad  # no update yet
        # its own count: 6 answers of 3 tokens: 18 tokens (token_mean), 6 answers (gspo's seq_mean_token_mean)
        assert loss_count(rollout.action_mask, trainer.ppo.loss_agg).item() == (6 if policy_loss == "gspo" else 18)
        advantages = rollout.advantages
        rollout.advantages = rollout.action_mask.float()  # 1 everywhere: ppo and gspo lose −1 at ratio 1
        own = trainer.train_step(rollout)["actor_loss"]
        count = loss_count(rollout.action_mask, trainer.ppo.loss_agg).item()
        halved = trainer.train_step(rollout, normalizer=2 * count)["actor_loss"]
        assert own.item() == pytest.approx(-1.0 if policy_loss != "cispo" else -answer_logprob_mean(engine, rollout))
        assert_close(halved, own / 2)
        engine.actor.step, rollout.advantages = step, advantages
        before = answer_logprob(engine.actor.module, rollout.input_ids, 0, 3)
        trainer.train_step(rollout)
        assert answer_logprob(engine.actor.module, rollout.input_ids, 0, 3) > before, policy_loss


def answer_logprob_mean(engine, rollout):
    """The mean log-prob of the rollout's answer tokens under the actor (CISPO's loss at weight 1 and Â = 1 is its
    negative)."""
    logits = engine.actor.module(rollout.input_ids).logits[:, rollout.prompt_length - 1:-1]
    logp = torch.log_softmax(logits, -1).gather(-1, rollout.answer_ids[..., None]).squeeze(-1)
    return (logp * rollout.action_mask).sum().item() / rollout.action_mask.sum().item()


def scored_batch(trainer, name, scores):
    """A generation batch of 3 prompts × 2 answers whose groups are named ``name``g0 … g2, scored ``scores``."""
    rollout = trainer.generate(PROMPTS, PROMPT_MASK, [f"{name}g{i}" for i in range(3)], step=1)
    rollout.scores = torch.tensor(scores, dtype=torch.float32)
    return rollout


def dynamic_trainer(**ppo):
    config = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, dynamic_sampling=True, **ppo)
    return make_trainer([[3, 4, EOS]] * 6, scores=[0.0] * 6, critic=False, reward_model=False,
                        reward=RewardConfig(fn="answer_is_de"), reward_fn=answer_is_de, ppo=config, do_sample=True)[0]


class FakeRanks:
    """Threads standing for ranks: ``reduce(tensor, op)`` sums or takes the minimum over them, in place."""

    def __init__(self, n):
        self.barrier, self.slots = threading.Barrier(n), [None] * n

    def reduce_of(self, rank):
        def reduce(tensor, op):
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            result = stacked.sum(0) if op == "sum" else stacked.min(0).values
            self.barrier.wait()  # every rank has read the slots before any writes the next
            tensor.copy_(result)
        return reduce


def test_dynamic_sampling_refills_until_every_rank_has_its_groups_or_the_limit_then_fills():
    """Two ranks, 3 groups a round (1 batch of 3 prompts), at most 3 batches. Rank 0 keeps 2, then 3 (of 3 informative
    groups it takes 1: the surplus is dropped); rank 1 keeps 0, 1, 2: the limit ends the round with 2, and one dropped
    group, masked out, fills its place. Both ranks draw 3 batches and train 6 rows."""
    batches = {0: [[1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]],
               1: [[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]}
    ranks, out, calls = FakeRanks(2), {}, {0: 0, 1: 0}

    def run(rank):
        trainer = dynamic_trainer(dynamic_sampling_max_batches=3)
        collector = RoundCollector(trainer.ppo, groups_per_batch=3, reduce=ranks.reduce_of(rank))
        for i, scores in enumerate(batches[rank]):
            calls[rank] += 1
            ready = collector.add(scored_batch(trainer, f"b{i + 1}", scores), {"text": i})
            if ready is not None:
                out[rank] = ready
                return

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert calls == {0: 3, 1: 3}
    (round0, texts0), (round1, texts1) = out[0], out[1]
    assert len(round0) == len(round1) == 6 and texts0 == texts1 == [{"text": 0}]  # one text batch: one round's
    assert round0.prompt_text[::2] == ["b1g0", "b1g2", "b2g0"] and round0.valid.tolist() == [1] * 6
    assert round1.prompt_text[::2] == ["b2g0", "b3g0", "b1g0"]  # b1g0: a dropped group filling the place
    assert round1.valid.tolist() == [1, 1, 1, 1, 0, 0] and (round1.action_mask[4:] == 0).all()
    # every rank's counts: kept 3 + 2; dropped 1 + 0 + 3 and 3 + 2 + 2; surplus: rank 0's b2g1, b2g2; filled 0 + 1
    for ready in (round0, round1):
        info = ready.info
        counts = (info["sampled_batches"], info["groups_kept"], info["groups_filtered"], info["groups_surplus"],
                  info["groups_filled"])
        assert counts == (3, 5, 11, 2, 1)
        assert info["batches"] == 3 and info["sequences"] == 18  # every batch drawn counts in the throughput
    trainer = dynamic_trainer()
    trainer.compute_advantages(round1)  # the filler group has advantage 0 and counts in no statistic
    assert (round1.advantages[4:] == 0).all() and (round1.advantages[:4] != 0).any()
    trainer.train_step(round1)


def test_dynamic_sampling_stops_once_the_round_is_full_and_skips_nothing_scored():
    trainer = dynamic_trainer()  # limit: 4 batches
    collector = RoundCollector(trainer.ppo, groups_per_batch=3)
    assert collector.add(scored_batch(trainer, "b1", [1, 0, 1, 1, 0, 1])) is None  # 2 of 3
    empty = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    empty.info["kept"] = 0  # a batch whose answers were all dropped (nothing scored) still counts as drawn
    assert collector.add(empty) is None
    ready, texts = collector.add(scored_batch(trainer, "b3", [0, 1, 1, 0, 1, 1]))
    assert ready.prompt_text[::2] == ["b1g0", "b1g2", "b3g0"] and ready.info["sampled_batches"] == 3
    counts = ready.info["groups_kept"], ready.info["groups_filtered"], ready.info["groups_surplus"]
    assert counts + (ready.info["groups_filled"],) == (3, 5, 1, 0)  # b3g1 is informative but not needed
    # a round with no informative group at all: every place filled, groups_kept 0 (step 3 skips it)
    collector = RoundCollector(dynamic_trainer(dynamic_sampling_max_batches=1).ppo, groups_per_batch=3)
    ready, _ = collector.add(scored_batch(trainer, "b4", [1, 1, 0, 0, 2, 2]))
    assert ready.info["groups_kept"] == 0 and ready.valid.sum() == 0 and len(ready) == 6


def test_dynamic_sampling_with_a_critic_fills_from_a_batch_that_scored_nothing():
    """PPO's critic values exist on every batch (zeros where nothing was computed), so a round filled from a batch
    whose answers were all dropped concatenates, trains the critic on its kept groups only and never NaNs."""
    ppo = PPOConfig(n_samples_per_prompt=2, dynamic_sampling=True, dynamic_sampling_max_batches=2)
    trainer, engine = make_trainer([[3, 4, EOS]] * 6, scores=[0.0] * 6, ppo=ppo, do_sample=True)
    collector = RoundCollector(trainer.ppo, groups_per_batch=3)
    empty = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    assert engine.critic.module.seen_group_size == 2  # the critic may run each group's prompt once
    empty.info["kept"] = 0
    assert empty.values is not None and empty.scores is None
    assert collector.add(empty) is None
    ready, _ = collector.add(scored_batch(trainer, "b2", [1, 0, 1, 1, 1, 1]))
    assert ready.prompt_text[::2] == ["b2g0", "", ""] and ready.valid.tolist() == [1, 1, 0, 0, 0, 0]
    trainer.compute_advantages(ready)
    losses = trainer.train_step(ready)
    assert math.isfinite(losses["actor_loss"].item()) and math.isfinite(losses["critic_loss"].item())
    assert (ready.advantages[2:] == 0).all() and (ready.returns[2:] == ready.values[2:]).all()


def test_without_dynamic_sampling_a_round_is_the_next_batches_that_kept_an_answer():
    trainer, _ = make_trainer([[3, 4, EOS]] * 3, scores=[1.0] * 3, ppo=PPOConfig(generation_batches=2))
    collector = RoundCollector(trainer.ppo, groups_per_batch=3)
    first = make_rollout(trainer)
    empty = trainer.generate(PROMPTS, PROMPT_MASK, step=1)
    empty.info["kept"] = 0
    assert collector.add(first, {"t": 1}) is None and collector.add(empty, {"t": 2}) is None
    ready, texts = collector.add(make_rollout(trainer), {"t": 3})
    assert len(ready) == 6 and texts == [{"t": 1}, {"t": 3}] and ready.info["batches"] == 2


# --------------------------------------------------------------------------- pieces


def test_unsupervised_batches_are_cut_like_the_rollout():
    first = {"a": torch.arange(5), "b": torch.arange(5) * 10}
    micro = cut_batches([first, {"a": torch.arange(2), "b": torch.arange(2)}], 3)
    assert [m["a"].tolist() for m in micro] == [[0, 1, 2], [3, 4, 0], [1]]  # one round, cut across batches
    assert micro[1]["b"].tolist() == [30, 40, 0]


def test_unsupervised_rows_per_generation_batch_follow_the_lm_micro_batch():
    from step3_rlhf_finetuning.main import unsup_batch_size, unsup_rows_per_batch

    def args(gen, n, train, unsup=None):
        return SimpleNamespace(per_device_generation_batch_size=gen, n_samples_per_prompt=n,
                               per_device_training_batch_size=train, per_device_unsup_batch_size=unsup)

    assert unsup_batch_size(args(4, 8, 16)) == 16 and unsup_rows_per_batch(args(4, 8, 16)) == 32  # one per answer
    assert unsup_batch_size(args(4, 8, 16, 4)) == 4 and unsup_rows_per_batch(args(4, 8, 16, 4)) == 8  # 2 micro × 4
    assert unsup_rows_per_batch(args(17, 1, 16, 4)) == 5  # micro-batches of 16 and 1 answer: texts of 4 and 1
    assert unsup_rows_per_batch(args(3, 2, 4)) == 6  # the default: one row per answer even when 4 ∤ 6


def test_each_rl_micro_batch_gets_one_lm_step_of_the_unsupervised_micro_batch():
    answers = [[3, 4, EOS], [4, 3, EOS], [3, 3, EOS]]
    trainer, _ = make_trainer(answers, scores=[1.0, -1.0, 0.5], lr=0.1, unsup_coef=1.0)
    seen = []
    trainer.train_unsupervised = lambda text: seen.append(text["input_ids"][:, 0].tolist()) or torch.tensor(2.0)
    text = {"input_ids": torch.arange(10).view(5, 2), "attention_mask": torch.ones(5, 2, dtype=torch.long)}
    text["labels"] = text["input_ids"]
    stats = trainer.optimise(make_rollout(trainer), [text], WholeSteps(1), 2, 1)  # RL micro-batches of 2 and 1
    assert seen == [[0], [2]] and stats.actor_rows == 3 + 2 and stats.losses["unsup_loss"] == 2.0
    seen.clear()
    stats = trainer.optimise(make_rollout(trainer), [text], WholeSteps(1), 2)  # default: as many rows as the RL's
    assert seen == [[0, 2], [4, 6]] and stats.actor_rows == 3 + 4


def test_rollout_cat_slices_and_checkpoint_state():
    trainer, _ = make_trainer([[3, 4, EOS], [4, 3, EOS], [3, 3, EOS]], scores=[1.0, 2.0, 3.0])
    a = make_rollout(trainer, prompt_text=["x", "y", "z"], rows=[{"i": 0}, {"i": 1}, {"i": 2}])
    b = make_rollout(trainer)
    both = Rollout.cat([a, b])
    assert len(both) == 6 and both.prompt_text == ["x", "y", "z", "", "", ""] and both.rows[2] == {"i": 2}
    assert both.info["sequences"] == 6 and both.info["generate"] == a.info["generate"] + b.info["generate"]
    micro = both.micro_batches(4)
    assert [len(m) for m in micro] == [4, 2] and torch.equal(micro[1].advantages, b.advantages[1:])
    assert micro[0].values is not None and micro[0].answers == a.answers + b.answers[:1]
    state = both.state()
    assert all(v is None or torch.is_tensor(v) or isinstance(v, (list, dict, int)) for v in state.values())
    assert state["task_scores"] is None  # no --overlong_penalty: nothing but the score to keep
    again = Rollout.from_state(state)
    assert torch.equal(again.input_ids, both.input_ids) and again.rows == both.rows


def test_end_token():
    tok = SimpleNamespace(eos_token_id=2, unk_token_id=9, convert_tokens_to_ids=lambda t: [7])
    assert end_of_answer_token_ids(tok) == (2,)
    assert end_of_answer_token_ids(tok, "<eot>") == (7, 2)  # the EOT ends an answer, and so does the EOS
    unknown = SimpleNamespace(eos_token_id=2, unk_token_id=9, convert_tokens_to_ids=lambda t: [9])
    assert end_of_answer_token_ids(unknown, "<eot>") == (2,)


def test_throughput_counts_unsupervised_rows_instead_of_a_batch_of_two():
    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=16, vocab_size=32)
    t = step3_throughput(cfg, cfg, experience_time=1.0, generate_time=0.5, train_time=2.0, sequences=8,
                         seq_length=12, answer_length=6, generated_tokens=5, actor_train_samples=16,
                         critic_train_samples=8, actor_params=1000, critic_params=500)
    train = transformer_flops(cfg, 16, 12, 3) + transformer_flops(cfg, 8, 12, 3)
    gen = transformer_flops(cfg, 8, 12, 1)
    assert t["train_tflops"] == pytest.approx(train / 2.0 / 1e12)
    assert t["gen_tflops"] == pytest.approx(gen / 0.5 / 1e12)
    assert t["e2e_tflops"] == pytest.approx((train + gen) / 3.0 / 1e12)
    assert t["samples_per_sec"] == pytest.approx(8 / 3.0)
    assert t["gen_tokens_per_sec"] == pytest.approx(8 * 5 / 0.5)
    lines = throughput_lines(t)
    assert lines[0].startswith("End-to-End => Latency: 3.00s") and "Batch Size: 8" in lines[0]
    assert lines[1].startswith("Generation => ") and lines[2].startswith("Training   => Latency: 2.00s")


# --------------------------------------------------------------------------- unsupervised data


class CharTokenizer:
    """One id per character, BOS = 0 before each row (like OPT's tokenizer adds its BOS)."""

    def __call__(self, texts):
        return {"input_ids": [[0] + [ord(c) for c in text] for text in texts]}


def test_text_file_is_packed_into_blocks(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("abc\n\nde\nfghij\n")  # blank lines skipped: [0 a b c] [0 d e] [0 f g h i j] = 13 tokens
    data = get_unsupervised_data(str(path), None, CharTokenizer(), block_size=4, log=lambda m: None)
    assert len(data) == 3  # 13 // 4, the tail of 1 dropped
    assert data[0]["input_ids"].tolist() == [0, 97, 98, 99]
    assert data[1]["input_ids"].tolist() == [0, 100, 101, 0]
    assert torch.equal(data[2]["labels"], data[2]["input_ids"]) and data[2]["attention_mask"].sum() == 4


def test_folder_of_text_files_and_errors(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("xy\n")
    (tmp_path / "d" / "a.txt").write_text("uv\n")
    data = get_unsupervised_data(str(tmp_path / "d"), None, CharTokenizer(), block_size=3, log=lambda m: None)
    assert data[0]["input_ids"].tolist() == [0, ord("u"), ord("v")]  # sorted: a.txt first
    with pytest.raises(UserInputError, match="not enough text for one block of 100"):
        get_unsupervised_data(str(tmp_path / "d"), None, CharTokenizer(), block_size=100, log=lambda m: None)
    with pytest.raises(UserInputError, match="no such file"):
        get_unsupervised_data(str(tmp_path / "missing.txt"), None, CharTokenizer(), 4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="no .txt files"):
        get_unsupervised_data(str(tmp_path / "empty"), None, CharTokenizer(), 4)
    assert pack_tokens(["abcdef"], CharTokenizer(), 2, max_blocks=2).tolist() == [[0, 97], [98, 99]]


# --------------------------------------------------------------------------- argument checks

BASE = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o"]


@pytest.mark.parametrize("flags,message", [
    (["--inference_tp_size", "2", "--enable_hybrid_engine"], "needs --actor_zero_stage 3"),
    (["--inference_tp_size", "2", "--actor_zero_stage", "3"], "needs --enable_hybrid_engine"),
    (["--enable_mixed_precision_lora", "--actor_zero_stage", "3"], "--enable_mixed_precision_lora needs"),
    (["--only_optimize_lora"], "--only_optimize_lora needs"),
    (["--unsupervised_dataset_config_name", "x"], "needs --unsupervised_dataset_name"),
    (["--actor_zero_stage", "2", "--critic_zero_stage", "2", "--enable_hybrid_engine", "--offload"], "unsupported"),
    (["--do_sample", "--temperature", "0"], "sampling needs"),
    (["--generation_batches", "0"], "--generation_batches must be ≥ 1"),
    (["--advantage_estimator", "grpo", "--n_samples_per_prompt", "2", "--do_sample", "--critic_value_head", "zero"],
     "--critic_value_head would not be used"),
])
def test_bad_flag_combinations_are_refused_up_front(flags, message):
    with pytest.raises(UserInputError, match=message):
        validate_step3(parse_args(BASE + flags))


def test_reference_defaults():
    args = parse_args(BASE)
    assert (args.actor_learning_rate, args.critic_learning_rate, args.unsup_coef, args.num_warmup_steps) == \
        (9.65e-6, 5e-6, 27.8, 100)
    assert (args.per_device_generation_batch_size, args.max_prompt_seq_len, args.num_padding_at_beginning,
            args.actor_lora_module_name, args.seed, args.kl_ctl, args.lam) == (16, 256, 1, "decoder.layers.", 1234,
                                                                               0.1, 0.95)
    assert not args.do_sample and args.tensorboard_path == "step3_tensorboard"
    # the critic starts from the step-2 model whole, advantages unwhitened (DeepSpeed-Chat's)
    assert args.critic_value_head == "reward_model" and args.whiten_advantages is None


def test_critic_value_head_reaches_the_critics_config():
    from step3_rlhf_finetuning.config import Step3Config

    args = parse_args(BASE + ["--critic_value_head", "zero", "--whiten_advantages"])
    args.dtype = "fp32"
    config = Step3Config.from_args(args)
    assert config.engine.critic.value_head == "zero" and config.engine.actor.value_head == "reward_model"
    assert config.ppo.whiten_advantages is True
    from step3_rlhf_finetuning.metrics import algorithm_line

    assert algorithm_line(config.ppo).endswith("; advantages whitened over the batch")
    assert "whiten" not in algorithm_line(PPOConfig()) and "whiten" not in algorithm_line(
        PPOConfig(advantage_estimator="reinforce"))
    assert algorithm_line(PPOConfig(advantage_estimator="reinforce", whiten_advantages=False)).endswith(
        "; advantages not whitened")


def test_throughput_is_logged_about_five_times_a_run():
    """Without a terminal, timing lines must not dominate the log (the demo's step 1 has 400 steps)."""
    from utils.perf import throughput_due

    assert [s for s in range(1, 401) if throughput_due(s, 400)] == [80, 160, 240, 320, 400]
    assert [s for s in range(1, 81) if throughput_due(s, 80)] == [16, 32, 48, 64, 80]
    assert [s for s in range(1, 4) if throughput_due(s, 3)] == [3]  # short runs: the last step only
    assert [s for s in range(1, 26) if throughput_due(s, 25)] == [10, 20, 25]  # never more often than every 10


def test_each_default_lives_in_the_config_dataclasses():
    """Every step-3 flag that has a config field takes its default from there, and from_args maps it back."""
    from dataclasses import fields

    from step3_rlhf_finetuning.config import GenerationConfig, PPOConfig, RewardConfig, field_defaults

    args = parse_args(BASE)
    flag_of = {"backend": "generation_backend", "dtype": "generation_dtype", "fn": "reward_fn",
               "fn_weight": "reward_fn_weight"}
    skipped = {"eot_token", "ema_beta", "align_overflow", "do_sample", "print_answers"}  # derived or switch flags
    checked = 0
    for cls in (PPOConfig, GenerationConfig, RewardConfig):
        for name, default in field_defaults(cls).items():
            if name in skipped:
                continue
            assert getattr(args, flag_of.get(name, name)) == default, (cls.__name__, name)
            checked += 1
    assert checked >= 20
    assert {f.name for f in fields(PPOConfig)} - {"ema_beta"} <= set(vars(args))  # every PPO field is a flag


def test_the_actor_is_saved_last_so_a_folder_with_an_actor_is_a_finished_run(monkeypatch, tmp_path):
    """actor/ marks a finished step 3 (utils.run_folder.RunFolder.finished): a kill between two saves must not leave
    one without the critic or the EMA actor, which a rerun would refuse as finished instead of resuming."""
    import step3_rlhf_finetuning.main as step3
    from utils.run_folder import RunFolder

    order = []
    monkeypatch.setattr(step3, "save_hf_format", lambda model, tok, path, *a, **k: order.append(os.path.basename(path)))
    monkeypatch.setattr(step3, "save_reward_model", lambda model, tok, path, *a: order.append(os.path.basename(path)))
    engine = SimpleNamespace(actor=nn.Linear(2, 2), critic=nn.Linear(2, 1), actor_ema=nn.Linear(2, 2))
    args = SimpleNamespace(output_dir=str(tmp_path), apply_chat_template=False, actor_zero_stage=0,
                           critic_zero_stage=0)
    folder = RunFolder(str(tmp_path))
    step3.save_models(args, engine, None, SimpleNamespace(info=lambda *a: None), folder)
    assert order == ["critic", "actor_ema", "actor"]
    with torch.no_grad():
        engine.critic.weight[0, 0] = float("nan")
    order.clear()
    with pytest.raises(Exception, match="non-finite weights in the step-3 models"):
        step3.save_models(args, engine, None, SimpleNamespace(info=lambda *a: None), folder)
    assert order == []  # nothing saved, not even the actor
