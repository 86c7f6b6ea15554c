"""Step 3 computes nothing it throws away, and gets the same numbers as the plain way.

* :func:`utils.rl_math.gather_log_probs` (temperature, chunks) equals ``log_softmax(logits / T)`` gathered;
* the LM head at the kept positions equals the full logits' slice;
* :func:`utils.model.lean_forward.answer_log_probs`: the shared-prompt pass equals the plain pass (values and
  gradients), both equal the full-logits log-probs, and how much left padding a batch carries changes nothing;
* the trainer on a real tiny model (PPO with a critic, GRPO): a round padded to its longest prompt gives the
  log-probs, values, advantages and loss of the same round padded to the cap; the on-policy shortcut gives the
  update of the extra pass;
* the collator pads to the longest prompt (a multiple of 8), not the cap.
"""
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from step3_rlhf_finetuning.config import GenerationConfig, PPOConfig, RewardConfig
from step3_rlhf_finetuning.ppo_trainer import DeepSpeedPPOTrainer, Rollout, old_logprobs_from_training_pass
from utils.data.data_utils import DataCollatorRLHF
from utils.model.lean_forward import answer_log_probs, can_share_prompt, position_ids, shared_group_size
from tests.test_ppo_trainer import FakeEngine as Engine  # what the trainer uses of a DeepSpeed engine
from utils.rl_math import gather_log_probs


# --------------------------------------------------------------------------- the log-softmax


def test_gather_log_probs_temperature_and_chunks_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (5, 3))
    labels[0, 0] = -100  # read as id 0 (masked by callers)
    for temperature in (1.0, 0.7):
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels.clamp(min=0)[..., None])
        for chunk_rows in (1, 2, 8):
            got = gather_log_probs(logits, labels, temperature, chunk_rows=chunk_rows)
            assert got.dtype == torch.float32 and got.shape == (5, 3)
            assert_close(got, expected.squeeze(-1))


def test_gather_log_probs_gradient_is_the_log_softmax_gradient():
    torch.manual_seed(1)
    logits = torch.randn(4, 2, 7, requires_grad=True)
    labels = torch.randint(0, 7, (4, 2))
    gather_log_probs(logits, labels, 0.5).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits / 0.5, -1).gather(-1, labels[..., None]).sum().backward()
    assert_close(ours, logits.grad)


# --------------------------------------------------------------------------- a real tiny model


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-opt"])
def lm(request):
    from transformers import AutoModelForCausalLM

    from utils.model.tiny import resolve_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(request.param), dtype=torch.float32)
    model.eval()
    return model


def batch(lm, G=3, left_pad=(0, 2, 5), P=8, A=6, seed=0):
    """Prompts ``[b·G, P]`` (each repeated G times, left padded by ``left_pad``), answers ``[b·G, A]`` right padded
    (row 1 ends after 3 tokens)."""
    g = torch.Generator().manual_seed(seed)
    V, pad = lm.config.vocab_size, 1
    b = len(left_pad)
    prompts = torch.randint(3, V, (b, P), generator=g)
    mask = torch.ones(b, P, dtype=torch.long)
    for i, n in enumerate(left_pad):
        prompts[i, :n], mask[i, :n] = pad, 0
    prompts, mask = prompts.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    answers = torch.randint(3, V, (b * G, A), generator=g)
    answer_mask = torch.ones_like(answers)
    answers[1, 3:], answer_mask[1, 4:] = pad, 0
    return prompts, mask, answers, answer_mask


def full_log_probs(lm, prompts, mask, answers, answer_mask, temperature=1.0):
    """The plain way: all logits, log-softmax over everything, the answer columns sliced out."""
    ids = torch.cat([prompts, answers], 1)
    full_mask = torch.cat([mask, answer_mask], 1)
    logits = lm(ids, attention_mask=full_mask, position_ids=position_ids(full_mask)).logits / temperature
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logps[:, prompts.shape[1] - 1:]


def test_logits_at_kept_positions_are_the_full_logits_slice(lm):
    prompts, mask, answers, answer_mask = batch(lm)
    ids, full_mask = torch.cat([prompts, answers], 1), torch.cat([mask, answer_mask], 1)
    with torch.no_grad():
        full = lm(ids, attention_mask=full_mask).logits
        kept = lm(ids, attention_mask=full_mask, logits_to_keep=5).logits
    assert kept.shape[1] == 5
    assert_close(kept, full[:, -5:], atol=1e-5, rtol=1e-5)


def test_shared_prompt_pass_equals_the_plain_pass_and_the_full_logits(lm):
    prompts, mask, answers, answer_mask = batch(lm)
    assert can_share_prompt(lm) and shared_group_size(prompts, mask, 3) == 3
    real = answer_mask.bool()
    with torch.no_grad():
        full = full_log_probs(lm, prompts, mask, answers, answer_mask, 0.8)
        plain = answer_log_probs(lm, prompts, mask, answers, answer_mask, 3, 0.8, share_prompt=False)
        shared = answer_log_probs(lm, prompts, mask, answers, answer_mask, 3, 0.8)
    assert plain.shape == shared.shape == answers.shape
    assert_close(plain[real], full[real], atol=1e-5, rtol=1e-5)
    assert_close(shared[real], full[real], atol=1e-5, rtol=1e-5)


def test_shared_prompt_pass_gives_the_plain_pass_gradients(lm):
    prompts, mask, answers, answer_mask = batch(lm)
    weights = torch.randn(answers.shape, generator=torch.Generator().manual_seed(3)) * answer_mask
    grads = []
    for share in (False, True):
        lm.zero_grad()
        (answer_log_probs(lm, prompts, mask, answers, answer_mask, 3, share_prompt=share) * weights).sum().backward()
        grads.append([p.grad.clone() for p in lm.parameters() if p.grad is not None])
    lm.zero_grad()
    assert len(grads[0]) == len(grads[1]) > 0
    for plain, shared in zip(*grads):
        assert_close(shared, plain, atol=1e-5, rtol=1e-4)


def test_left_padding_changes_nothing(lm):
    prompts, mask, answers, answer_mask = batch(lm)
    extra = 8  # the same prompts padded to a longer cap
    padded = torch.cat([torch.full((len(prompts), extra), 1), prompts], 1)
    padded_mask = torch.cat([torch.zeros(len(prompts), extra, dtype=torch.long), mask], 1)
    real = answer_mask.bool()
    with torch.no_grad():
        for share in (False, True):
            short = answer_log_probs(lm, prompts, mask, answers, answer_mask, 3, share_prompt=share)
            long = answer_log_probs(lm, padded, padded_mask, answers, answer_mask, 3, share_prompt=share)
            assert_close(long[real], short[real], atol=1e-5, rtol=1e-5)


def test_rows_that_do_not_repeat_a_prompt_are_not_shared():
    prompts = torch.tensor([[1, 2], [1, 2], [1, 3], [1, 3]])
    mask = torch.ones_like(prompts)
    assert shared_group_size(prompts, mask, 2) == 2
    assert shared_group_size(prompts, mask, 4) == 1  # not one prompt four times
    assert shared_group_size(prompts[:3], mask[:3], 2) == 1  # a group cut in two
    other_mask = mask.clone()
    other_mask[1, 0] = 0
    assert shared_group_size(prompts, other_mask, 2) == 1


# --------------------------------------------------------------------------- the collator


def test_prompts_are_padded_to_the_longest_rounded_to_8_and_capped():
    collate = DataCollatorRLHF(32, pad_token_id=0)
    out = collate([torch.arange(1, 12), torch.arange(1, 4)])  # longest 11 -> 16
    assert out["prompt"].shape == (2, 16)
    assert out["prompt"][1].tolist() == [0] * 13 + [1, 2, 3] and out["prompt_att_mask"][1].sum() == 3
    assert collate([torch.arange(1, 40)])["prompt"].shape == (1, 32)  # cut to the cap, from the left
    assert collate([torch.arange(1, 40)])["prompt"][0, -1] == 39
    assert DataCollatorRLHF(30, pad_token_id=0)([torch.arange(1, 28)])["prompt"].shape == (1, 30)  # ≤ the cap


# --------------------------------------------------------------------------- the trainer on a real tiny model


def make_trainer(estimator, on_policy=False, lr=1e-2, G=2):
    from transformers import AutoModelForCausalLM

    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    path = resolve_model_path("tiny-llama")
    tokenizer = load_hf_tokenizer(path)

    def lm():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def critic():
        torch.manual_seed(1)
        return create_critic_model(path, tokenizer, None, num_padding_at_beginning=0)

    ppo = PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=G if estimator != "gae" else 1, kl_ctl=0.1)
    engine = SimpleNamespace(actor=Engine(lm(), lr), ref=Engine(lm()), actor_ema=None, tokenizer=tokenizer,
                             critic=Engine(critic(), lr) if estimator == "gae" else None, reward=Engine(critic()))
    generation = GenerationConfig(max_prompt_seq_len=48, max_answer_seq_len=6, do_sample=estimator != "gae",
                                  backend="hf")
    return DeepSpeedPPOTrainer(engine, ppo, generation, log=lambda *_: None, reward=RewardConfig(),
                               on_policy=on_policy), engine


def prompt_batch(tokenizer, cap):
    texts = [" Human: Describe the lamp. Assistant:", " Human: Tell me about the small red kite please. Assistant:"]
    samples = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    return DataCollatorRLHF(cap, tokenizer.pad_token_id)(samples)


def round_of(trainer, engine, cap, seed=5):
    torch.manual_seed(seed)
    b = prompt_batch(trainer.tokenizer, cap)
    rollout = trainer.generate(b["prompt"], b["prompt_att_mask"])
    rollout.scores = trainer.score(rollout)
    trainer.compute_advantages(rollout)
    return rollout


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_round_padded_to_its_longest_equals_the_round_padded_to_the_cap(estimator):
    cap, results = 48, []
    for to_the_cap in (False, True):
        trainer, engine = make_trainer(estimator, lr=0.0)
        b = prompt_batch(trainer.tokenizer, cap)
        prompts, mask = b["prompt"], b["prompt_att_mask"]
        if to_the_cap:  # DeepSpeed-Chat's way: every prompt left padded to --max_prompt_seq_len
            extra = cap - prompts.shape[1]
            prompts = torch.cat([torch.full((len(prompts), extra), trainer.pad_token_id), prompts], 1)
            mask = torch.cat([torch.zeros(len(mask), extra, dtype=torch.long), mask], 1)
        torch.manual_seed(5)
        rollout = trainer.generate(prompts, mask)
        rollout.scores = trainer.score(rollout)
        trainer.compute_advantages(rollout)
        results.append((rollout, trainer.train_step(rollout)))
    (short, short_losses), (long, long_losses) = results
    assert long.prompt_length == cap and short.prompt_length % 8 == 0 and short.prompt_length <= cap - 16
    assert torch.equal(short.answer_ids, long.answer_ids)  # the same answers
    real = short.action_mask.bool()
    assert real.sum() > 0
    for name in ("logprobs", "ref_logprobs", "advantages") + (("values", "returns") if estimator == "gae" else ()):
        assert_close(getattr(short, name)[real], getattr(long, name)[real], atol=1e-5, rtol=1e-5)
    assert_close(short.scores, long.scores, atol=1e-5, rtol=1e-5)
    assert short_losses.keys() == long_losses.keys()
    for name in short_losses:
        assert_close(short_losses[name], long_losses[name], atol=1e-5, rtol=1e-5)


def test_the_on_policy_shortcut_gives_the_update_of_the_extra_pass():
    weights = []
    for on_policy in (False, True):
        trainer, engine = make_trainer("grpo", on_policy=on_policy, lr=0.5)
        rollout = round_of(trainer, engine, 24)
        if on_policy:
            assert (rollout.logprobs == 0).all()  # no pass of its own ...
        trainer.train_step(rollout)
        if on_policy:  # ... the training pass's log-probs, for the KL metric
            assert (rollout.logprobs[rollout.action_mask.bool()] != 0).all()
        weights.append([p.detach().clone() for p in engine.actor.module.parameters()])
        before = [p.detach() for p in make_trainer("grpo")[1].actor.module.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(weights[-1], before))  # the update did something
    for extra_pass, shortcut in zip(*weights):
        assert_close(shortcut, extra_pass, atol=1e-6, rtol=1e-5)


def test_on_policy_only_when_provably_so():
    grpo = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=4)  # KL in the loss
    assert old_logprobs_from_training_pass(grpo, micro_batches_per_round=1, grad_accum=1, dropout=False)
    # a step of two rounds: the first round's micro-batches wait for the second's (WholeSteps), so the first round's
    # KL metric would read log π_old before its training pass wrote them: on-policy only without a reference model
    assert not old_logprobs_from_training_pass(grpo, micro_batches_per_round=2, grad_accum=4, dropout=False)
    no_kl = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=4, kl_ctl=0.0)
    assert old_logprobs_from_training_pass(no_kl, micro_batches_per_round=2, grad_accum=4, dropout=False)
    assert old_logprobs_from_training_pass(grpo, micro_batches_per_round=2, grad_accum=2, dropout=False)
    assert not old_logprobs_from_training_pass(grpo, 2, 1, False)  # a second optimizer step inside the round
    assert not old_logprobs_from_training_pass(grpo, 1, 1, True)  # dropout: train mode ≠ eval mode
    two_epochs = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=4, ppo_epochs=2)
    assert not old_logprobs_from_training_pass(two_epochs, 1, 1, False)
    assert not old_logprobs_from_training_pass(PPOConfig(), 1, 1, False)  # PPO: KL in the reward reads log π_old
    assert old_logprobs_from_training_pass(PPOConfig(kl_ctl=0.0), 1, 1, False)
    rloo = PPOConfig(advantage_estimator="rloo", n_samples_per_prompt=2)
    assert not old_logprobs_from_training_pass(rloo, 1, 1, False)


def test_rollouts_of_different_lengths_concatenate_and_trim():
    trainer, engine = make_trainer("grpo", lr=0.0)
    a = round_of(trainer, engine, 24)
    b = a.micro_batches(2)[0].padded(a.prompt_length + 8, a.action_mask.shape[1] + 3)
    both = Rollout.cat([a, b])
    assert both.prompt_length == a.prompt_length + 8 and both.action_mask.shape[1] == a.action_mask.shape[1] + 3
    assert (both.attention_mask[:len(a), :8] == 0).all() and (both.action_mask[:, -3:] == 0).all()
    assert len(both) == len(a) + 2 and both.info["sequences"] == a.info["sequences"]  # a micro-batch has no info
    # a micro-batch drops the columns that are padding in all its rows: the numbers of the unpadded round
    again, trimmed = both.micro_batches(len(a))[0], a.micro_batches(len(a))[0]
    assert again.prompt_length == trimmed.prompt_length <= a.prompt_length
    for name in ("input_ids", "attention_mask", "action_mask", "advantages", "logprobs"):
        assert torch.equal(getattr(again, name), getattr(trimmed, name))


# --------------------------------------------------------------------------- step 1's loss and DPO's pairs


def test_label_loss_is_the_full_logits_cross_entropy(lm):
    from utils.model.lean_forward import label_loss
    from utils.rl_math import causal_lm_loss

    prompts, mask, answers, answer_mask = batch(lm, G=1)
    ids, full_mask = torch.cat([prompts, answers], 1), torch.cat([mask, answer_mask], 1)
    labels = ids.masked_fill(full_mask == 0, -100)
    labels[:, :prompts.shape[1]] = -100  # the prompt is not trained (chat-template SFT)
    expected = causal_lm_loss(lm(ids, attention_mask=full_mask, position_ids=position_ids(full_mask)).logits, labels)
    loss = label_loss(lm, ids, full_mask, labels)
    assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    lm.zero_grad()
    loss.backward()
    assert all(p.grad is not None for p in lm.lm_head.parameters())
    lm.zero_grad()


def dpo_rows(lm, seed=0):
    """``[chosen; rejected]`` right padded, DPO's loss mask: 3 pairs with a shared prompt of 4, 6 and 9 tokens."""
    from step2_dpo_finetuning.main import dpo_loss_mask

    g = torch.Generator().manual_seed(seed)
    V = lm.config.vocab_size
    rows, T = [], 16
    for shared, (lc, lr) in ((4, (9, 12)), (6, (16, 8)), (9, (11, 11))):
        prompt = torch.randint(3, V, (shared,), generator=g)
        chosen = torch.cat([prompt, torch.randint(3, V, (lc - shared,), generator=g)])
        rejected = torch.cat([prompt, torch.randint(3, V, (lr - shared,), generator=g)])
        rows.append((chosen, rejected))
    ids = torch.full((6, T), 1)
    att = torch.zeros(6, T, dtype=torch.long)
    for i, (c, r) in enumerate(rows):
        ids[i, :len(c)], att[i, :len(c)] = c, 1
        ids[3 + i, :len(r)], att[3 + i, :len(r)] = r, 1
    return ids, att, dpo_loss_mask(ids, att)


def test_pair_log_probs_are_the_sequence_log_probs_of_the_full_logits(lm):
    from utils.model.lean_forward import pair_log_probs
    from utils.rl_math import sequence_log_probs

    ids, att, mask = dpo_rows(lm)
    with torch.no_grad():
        expected = sequence_log_probs(lm(ids, attention_mask=att, position_ids=position_ids(att)).logits, ids, mask)
        for share in (True, False):
            assert_close(pair_log_probs(lm, ids, att, mask, share_prompt=share), expected, atol=1e-5, rtol=1e-5)
    # and the gradients of the shared pass are the plain pass's
    grads = []
    for share in (False, True):
        lm.zero_grad()
        (pair_log_probs(lm, ids, att, mask, share_prompt=share) * torch.tensor([1., -2., 3., 0.5, 1., -1.])).sum() \
            .backward()
        grads.append([p.grad.clone() for p in lm.parameters() if p.grad is not None])
    lm.zero_grad()
    for plain, shared in zip(*grads):
        assert_close(shared, plain, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name, npab", [("tiny-llama", 0), ("tiny-opt", 1)])
def test_reward_model_pairs_share_their_start_and_give_the_plain_loss(name, npab):
    from utils.data.data_utils import DataCollatorReward
    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    path = resolve_model_path(name)
    tokenizer = load_hf_tokenizer(path)
    torch.manual_seed(0)
    model = create_critic_model(path, tokenizer, None, num_padding_at_beginning=npab)
    bos = [tokenizer.bos_token_id] if npab else []
    prompts = [" Human: Describe the lamp. Assistant:", " Human: Describe the small kite. Assistant:"]
    answers = [(" The lamp is bright and calm.", " The lamp is dark."), (" It is red.", " The kite is small and kind.")]
    samples = []
    for prompt, (chosen, rejected) in zip(prompts, answers):
        encode = lambda text: torch.tensor(bos + tokenizer(prompt + text, add_special_tokens=False)["input_ids"]  # noqa
                                           + [tokenizer.eos_token_id])
        samples.append((encode(chosen), encode(rejected)))
    batch = DataCollatorReward(tokenizer.pad_token_id, 64)(samples)
    results, grads = [], []
    for share in (False, True):
        model.share_prefix = share
        model.zero_grad()
        out = model(**batch)
        out["loss"].backward()
        results.append(out)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    (plain, shared) = results
    for key in ("loss", "chosen_mean_scores", "rejected_mean_scores"):
        assert_close(shared[key], plain[key], atol=1e-5, rtol=1e-5)
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_a_packed_sft_batch_gives_the_padded_batch_loss_and_gradients(lm):
    """Step 1 on a CPU packs its batch without padding (block-diagonal mask, positions restarting): the loss and
    the gradients are the padded batch's."""
    from utils.data.data_utils import DataCollatorSFT, packs_sequences
    from utils.model.lean_forward import label_loss

    assert packs_sequences(torch.device("cpu"), lm) and not packs_sequences(torch.device("cuda"), lm)
    g = torch.Generator().manual_seed(4)
    samples = [{"input_ids": torch.randint(3, lm.config.vocab_size, (n,), generator=g), "prompt_length": p}
               for n, p in ((9, 4), (14, 0), (5, 2))]
    results = []
    for pack in (False, True):
        b = DataCollatorSFT(1, 64, pack=pack)(samples)
        assert int(b["tokens"]) == 28
        lm.zero_grad()
        loss = label_loss(lm, b["input_ids"], b["attention_mask"], b["labels"], b.get("position_ids"))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in lm.parameters() if p.grad is not None]))
    lm.zero_grad()
    (padded, padded_grads), (packed, packed_grads) = results
    assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for a, b in zip(padded_grads, packed_grads):
        assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_generation_with_the_prompt_prefilled_once_per_group_gives_the_same_answers():
    trainer, engine = make_trainer("gae", lr=0.0)  # greedy
    b = prompt_batch(trainer.tokenizer, 48)
    prompts, mask = b["prompt"].repeat_interleave(3, 0), b["prompt_att_mask"].repeat_interleave(3, 0)
    assert trainer._prefilled_cache(prompts, mask, 3) is not None  # the shared path is taken
    trainer.eval()
    shared, _ = trainer._generate_sequence(prompts, mask, group=3)
    plain, _ = trainer._generate_sequence(prompts, mask, group=1)
    assert torch.equal(shared, plain)


# --------------------------------------------------------------------------- GPU shapes and passes, counted on a CPU


def test_the_device_rules_round_and_concatenate_on_a_gpu_only():
    """One place says what a GPU does differently: lengths rounded up to 64 (few shapes), pairs as one concatenated
    pass (half the passes); a CPU keeps exact lengths and the shared prefix (fewer FLOPs)."""
    from utils.model.lean_forward import shape_multiple, shares_prefix

    assert shape_multiple(torch.device("cuda")) == 64 and shape_multiple(torch.device("cuda", 3)) == 64
    assert shape_multiple(torch.device("cpu")) == 1
    assert not shares_prefix(torch.device("cuda")) and shares_prefix(torch.device("cpu"))


def _lm_head_inputs(lm, fn):
    """The shapes of the hidden states ``lm``'s LM head ran on during ``fn()``."""
    shapes = []
    handle = lm.get_output_embeddings().register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    try:
        fn()
    finally:
        handle.remove()
    return shapes


def _sft_rows(lm):
    """3 right-padded rows, labels on answers of 2, 5 and 4 tokens that start at different columns (the last label
    at column 17)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, lm.config.vocab_size, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (start, n, length) in enumerate(((3, 2, 20), (9, 5, 16), (14, 4, 18))):
        labels[row, start:start + n] = ids[row, start:start + n]
        mask[row, length:] = 0
    return ids, mask, labels


@pytest.mark.parametrize("multiple", [1, 8])  # 8: the GPU's rounding, at the scale of a 20-column batch
def test_label_loss_runs_the_lm_head_at_the_label_positions_alone(lm, monkeypatch, multiple):
    """Step 1's LM head (and its float32 copy) covers each row's label positions, K = the most any row has (5 here),
    not the window from the first label to the last (15 columns) nor the whole row (20); rounded up on a GPU, the
    fed columns and K are multiples (the extra positions weigh 0) and the loss is unchanged."""
    from utils.model import lean_forward
    from utils.rl_math import causal_lm_loss

    monkeypatch.setattr(lean_forward, "shape_multiple", lambda device: multiple)
    monkeypatch.setattr(lean_forward, "keeps_label_positions", lambda device: True)  # a GPU's rule, on this CPU
    ids, mask, labels = _sft_rows(lm)
    with torch.no_grad():
        expected = causal_lm_loss(lm(ids, attention_mask=mask, position_ids=position_ids(mask)).logits, labels)
        shapes = _lm_head_inputs(lm, lambda: assert_close(lean_forward.label_loss(lm, ids, mask, labels), expected,
                                                          atol=1e-5, rtol=1e-5))
    assert [shape[:2] for shape in shapes] == [(3, 5 if multiple == 1 else 8)]
    fed = []
    handle = lm.register_forward_pre_hook(lambda m, args, kwargs: fed.append(args[0].shape[1]), with_kwargs=True)
    try:
        with torch.no_grad():
            lean_forward.label_loss(lm, ids, mask, labels)
    finally:
        handle.remove()
    assert fed == [17 if multiple == 1 else 20]  # the last label (column 17) is predicted from 16; 24 → the width 20


def test_label_loss_window_fallback_gives_the_same_loss_and_gradients(lm, monkeypatch):
    """A model whose forward does not take per-row positions gets the column window: same loss, same gradients."""
    from utils.model import lean_forward

    ids, mask, labels = _sft_rows(lm)
    results = []
    for positions in (True, False):
        monkeypatch.setattr(lean_forward, "keeps_positions", lambda model, keep=positions: keep)
        monkeypatch.setattr(lean_forward, "keeps_label_positions", lambda device: True)
        lm.zero_grad()
        loss = lean_forward.label_loss(lm, ids, mask, labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in lm.parameters() if p.grad is not None]))
    lm.zero_grad()
    assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_label_loss_on_a_cpu_is_the_window_bit_for_bit(lm):
    """On a CPU the LM head runs on the window from the first label column to the last, the loss summed over it as
    5f86c4f computed it: the same float32 value bit for bit (the demo's table was measured with it; the head at
    the label positions alone rounds differently, and 40 steps of training carried that into its held-out points)."""
    from utils.model.lean_forward import keeps_label_positions, label_loss, position_ids
    from utils.rl_math import gather_log_probs

    ids, mask, labels = _sft_rows(lm)
    assert not keeps_label_positions(ids.device) and keeps_label_positions(torch.device("cuda"))
    with torch.no_grad():
        first, n = 2, 17  # labels from column 3 (predicted from column 2) to 17 (from 16): columns 0–16 are fed
        logits = lm(ids[:, :n], attention_mask=mask[:, :n], position_ids=position_ids(mask[:, :n]),
                    logits_to_keep=n - first, use_cache=False).logits
        targets = labels[:, first + 1:n + 1]
        counted = (targets != -100).float()
        expected = -(gather_log_probs(logits, targets) * counted).sum() / counted.sum()
        losses = []
        shapes = _lm_head_inputs(lm, lambda: losses.append(label_loss(lm, ids, mask, labels)))
    assert torch.equal(losses[0], expected)
    assert [shape[:2] for shape in shapes] == [(3, 15)]


def test_keeps_positions_is_transformers_causal_lms():
    from utils.model.lean_forward import keeps_positions

    class Plain(torch.nn.Module):
        def forward(self, input_ids, logits_to_keep=0):
            return input_ids

    assert not keeps_positions(Plain())


@pytest.mark.parametrize("multiple", [1, 8])
def test_pair_log_probs_on_a_gpu_run_one_pass_rounded_and_equal(lm, monkeypatch, multiple):
    """DPO on a GPU: one concatenated pass (no shared prefix), rounded shapes, the full logits' sums."""
    from utils.model import lean_forward
    from utils.rl_math import sequence_log_probs

    monkeypatch.setattr(lean_forward, "shape_multiple", lambda device: multiple)
    monkeypatch.setattr(lean_forward, "shares_prefix", lambda device: False)
    ids, att, mask = dpo_rows(lm)
    with torch.no_grad():
        expected = sequence_log_probs(lm(ids, attention_mask=att, position_ids=position_ids(att)).logits, ids, mask)
        shapes = _lm_head_inputs(lm, lambda: assert_close(lean_forward.pair_log_probs(lm, ids, att, mask), expected,
                                                          atol=1e-5, rtol=1e-5))
    assert len(shapes) == 1 and shapes[0][0] == 6 and shapes[0][1] % multiple == 0


def test_dpo_step_on_a_gpu_runs_half_the_passes_and_fewer_ops():
    """A DPO step (policy with gradients, reference without) as a GPU runs it: 2 forward passes instead of the shared
    prefix's 4, and fewer ops (a GPU launches a kernel per op); printed: ops and host syncs of each path."""
    from transformers import AutoModelForCausalLM

    from step2_dpo_finetuning.main import dpo_batch
    from utils.model.lean_forward import shares_prefix
    from utils.model.tiny import resolve_model_path
    from utils.op_count import OpCounter

    path = resolve_model_path("tiny-llama")
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, att, _ = dpo_rows(policy)
    counts = {}
    for share in (True, False):
        calls = []
        hooks = [m.register_forward_pre_hook(lambda *a: calls.append(1)) for m in (policy, reference)]
        with OpCounter() as ops:
            out = dpo_batch(policy, reference, {"input_ids": ids, "attention_mask": att}, 0.1, 0.0,
                            share_prompt=share)
            out["loss"].backward()
        for h in hooks:
            h.remove()
        policy.zero_grad()
        counts[share] = (len(calls), ops.kernel_count, ops.sync_count, float(out["loss"].detach()))
    print({"shared prefix" if k else "one pass": v for k, v in counts.items()})
    assert counts[True][0] == 4 and counts[False][0] == 2
    assert counts[False][1] < counts[True][1] and counts[False][2] < counts[True][2]
    assert counts[False][3] == pytest.approx(counts[True][3], abs=1e-5)
    assert dpo_batch.__defaults__ == (None,) and shares_prefix(ids.device)  # by device unless forced


def test_reward_model_pairs_run_as_one_pass_on_a_gpu(monkeypatch):
    """Step 2's reward model follows the same rule (lean_forward.shares_prefix): the shared start once on a CPU, one
    plain pass on a GPU."""
    from utils.model import lean_forward
    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    path = resolve_model_path("tiny-llama")
    model = create_critic_model(path, load_hf_tokenizer(path), None, num_padding_at_beginning=0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 10, 11, 12]])
    att = (ids != 0).long()
    assert model._pair_values(ids, att) is not None
    monkeypatch.setattr(lean_forward, "shares_prefix", lambda device: False)
    assert model._pair_values(ids, att) is None
