"""Step 3 end to end on the tiny models: PPO + EMA + unsupervised mixing, and bad input."""
import json
import math

import pytest
import torch

from tests.conftest import run_entry

STEP1 = "step1_supervised_finetuning/main.py"
STEP2 = "step2_reward_model_finetuning/main.py"
STEP3 = "step3_rlhf_finetuning/main.py"
OMP = {"OMP_NUM_THREADS": "1"}
DATA = ["--data_path", "builtin/preference-small"]


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="session")
def step12(tmp_path_factory):
    """(actor folder, reward folder, data cache): 5 steps each of steps 1 and 2 on builtin/preference-small."""
    root = tmp_path_factory.mktemp("step12")
    cache, actor, reward = root / "data", root / "actor", root / "reward"
    lm = ["--model_name_or_path", "tiny-opt", "--data_output_path", cache, "--per_device_train_batch_size", 8,
          "--max_seq_len", 32, "--max_steps", 5]
    _ok(run_entry(STEP1, *DATA, *lm, "--output_dir", actor, "--learning_rate", 1e-3, env=OMP))
    _ok(run_entry(STEP2, *DATA, *lm, "--output_dir", reward, "--num_padding_at_beginning", 1, env=OMP))
    return actor, reward, cache


def _weights(folder):
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def _differs(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.smoke
@pytest.mark.slow
def test_ppo_with_ema_and_unsupervised_mixing(step12, tmp_path):
    actor, reward, cache = step12
    text = tmp_path / "text.txt"
    text.write_text("".join(f"The {n} is bright and calm, said the {n} keeper.\n" for n in range(300)))
    out = tmp_path / "step3"
    proc = _ok(run_entry(
        STEP3, *DATA, "--data_output_path", cache, "--actor_model_name_or_path", actor,
        "--critic_model_name_or_path", reward, "--output_dir", out, "--max_prompt_seq_len", 12,
        "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 4, "--per_device_training_batch_size", 2,
        "--max_steps", 3, "--do_sample", "--actor_learning_rate", 1e-3, "--critic_learning_rate", 1e-3,
        "--num_warmup_steps", 0, "--enable_ema", "--unsupervised_dataset_name", text, "--unsup_coef", 1.0,
        "--enable_hybrid_engine", "--print_answers", env=OMP))
    log = proc.stdout + proc.stderr
    # built-in prompts have 9, 11, 12 or 13 tokens: the 13-token quarter is dropped, with a count
    assert "skipped" in log and "prompt longer than 12 tokens" in log
    # the hybrid engine has no policy for transformers-5 OPT layers: said once, then the project's own path
    assert "--enable_hybrid_engine: DeepSpeed" in log and "legacy tuple KV cache" in log
    assert "generating with the project's own path" in log and "generation: hf backend" in log
    assert "unsupervised data:" in log and "--- ans    --> step=1" in log
    assert "unsupervised mixing on (2 text rows a micro-batch)" in log  # --per_device_training_batch_size
    assert "average reward: mean of the first 1 steps" in log

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        for key in ("actor_loss", "critic_loss", "unsup_loss", "reward", "ema_reward", "kl", "answer_len",
                    "e2e_latency", "gen_tokens_per_sec", "train_tflops", "samples_per_sec"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert r["unsup_loss"] > 0
    final = [r for r in rows if r["phase"] == "final"][-1]
    assert final["ref_unchanged"] == 1.0  # the reference model's parameters never moved

    step1, trained, ema = _weights(actor), _weights(out / "actor"), _weights(out / "actor_ema")
    assert _differs(trained, step1)  # PPO changed the actor
    assert _differs(ema, step1) and _differs(ema, trained)  # the EMA sits in between
    from utils.model.critic import load_reward_model

    load_reward_model(str(out / "critic"))  # the critic is a loadable step-2 folder


@pytest.mark.slow
def test_a_critic_folder_that_is_not_a_step2_output_is_refused(step12, tmp_path):
    actor, _, cache = step12
    proc = run_entry(STEP3, *DATA, "--data_output_path", cache, "--actor_model_name_or_path", actor,
                     "--critic_model_name_or_path", actor, "--output_dir", tmp_path / "out", env=OMP)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is not a step-2 reward model folder" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_baseline", "reinforce"])
def test_each_critic_free_estimator_end_to_end(step12, tmp_path, estimator):
    """Two RL steps of each estimator on the tiny models: no critic built or saved; rloo adds the reward model's
    score to the rule's (--reward_fn_weight), the others score with the rule alone (no reward model loaded)."""
    actor, reward, cache = step12
    out = tmp_path / estimator
    extra = ["--critic_model_name_or_path", reward, "--reward_fn_weight", 2.0] if estimator == "rloo" else []
    proc = _ok(run_entry(
        STEP3, *DATA, "--data_output_path", cache, "--actor_model_name_or_path", actor, "--output_dir", out,
        "--advantage_estimator", estimator, "--n_samples_per_prompt", 2, "--reward_fn", "builtin_rule", *extra,
        "--max_prompt_seq_len", 12, "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 4,
        "--per_device_training_batch_size", 4, "--max_steps", 2, "--do_sample", "--actor_learning_rate", 1e-3,
        "--num_warmup_steps", 0, env=OMP))
    log = proc.stdout + proc.stderr
    assert f"Running RL ({estimator}, critic-free, 2 answer(s) per prompt)" in log
    assert "initializing critic" not in log
    assert ("initializing reward" in log) == (estimator == "rloo")
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # not the run's manifest
    assert visible == ["actor", "metrics.jsonl"]  # no critic/ saved
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert "critic_loss" not in r and ("kl_loss" in r) == estimator.endswith("grpo")
        assert r["kl"] >= 0 and math.isfinite(r["actor_loss"]) and math.isfinite(r["reward"])
        if estimator != "rloo":  # the built-in rule alone: a score in [0, 1]
            assert 0 <= r["reward"] <= 1


@pytest.mark.slow
def test_no_kl_term_builds_no_reference_model(tmp_path):
    """GRPO with --reward_fn ifeval on IFEval-format rows and --kl_ctl 0 (TRL's default β): no reference model is
    built (said once), no KL is logged, the old log-probs come from the training pass (one optimizer step a round),
    and the rows' instructions reach the reward (a compliance share in [0, 1])."""
    # two instructions, so that some group's answers score differently (with no_comma alone every random answer
    # complied: every advantage 0, a run that changed nothing, which step 3 now refuses)
    rows = [{"prompt": f"Describe the colour of thing number {i}.",
             "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"], "kwargs": [{}, {}]}
            for i in range(12)]
    data = tmp_path / "ifeval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = _ok(run_entry(
        STEP3, "--data_path", data, "--data_split", "0,0,1", "--data_output_path", tmp_path / "data",
        "--actor_model_name_or_path", "tiny-llama", "--apply_chat_template", "--output_dir", out,
        "--advantage_estimator", "grpo", "--n_samples_per_prompt", 2, "--do_sample", "--reward_fn", "ifeval",
        "--kl_ctl", 0, "--max_prompt_seq_len", 48, "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 2,
        "--per_device_training_batch_size", 4, "--max_steps", 2, env=OMP))
    log = proc.stdout + proc.stderr
    assert "no reference model: --kl_ctl 0" in log and "initializing ref" not in log
    assert "old log-probs: the training pass's own" in log
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert "kl" not in r and "kl_loss" not in r and 0 <= r["reward"] <= 1 and math.isfinite(r["actor_loss"])
        assert r["tokens"] > 0 and r["samples"] == 4


@pytest.mark.slow
def test_gsm8k_reward_reads_the_reference_answers_of_real_data(tmp_path):
    """GRPO scored by --reward_fn gsm8k on the real GSM8K test file: the rows' "#### N" answers reach the function
    (a random actor scores 0, and a reward outside [0, 1] or a missing reference would stop the run with another
    error). Its one step, at the warm-up's learning rate 0 and with every advantage 0, changes nothing, so nothing
    is saved (issue 57: exit 2 naming the cause; before, exit 0 and the input model saved)."""
    from tests.conftest import shared_data

    data = shared_data("gsm8k", "test.jsonl")
    proc = (run_entry(
        STEP3, "--data_path", data, "--data_split", "0,0,1", "--data_output_path", tmp_path / "data",
        "--actor_model_name_or_path", "tiny-opt", "--output_dir", tmp_path / "out", "--advantage_estimator", "grpo",
        "--n_samples_per_prompt", 2, "--do_sample", "--reward_fn", "gsm8k", "--max_prompt_seq_len", 128,
        "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 2, "--per_device_training_batch_size", 4,
        "--max_steps", 1, env=OMP))
    assert proc.returncode == 2 and "1 RL step(s) ran but the actor is the input model" in proc.stderr, proc.stderr
    assert "learning rate 0, the start of the --num_warmup_steps 100 warm-up" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows if r["phase"] == "train"] == [0.0]
    assert "Running RL (grpo, critic-free, 2 answer(s) per prompt)" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_torch_autocast_trains_fp32_weights_with_bf16_forwards(untrained_reward_model, tmp_path):
    """PPO with --dtype bf16 --torch_autocast: every model of step 3 (actor, reference, critic, reward) runs, and the
    actor's weights stay fp32: updates far below bf16's resolution move them (bf16 weights would round such an update
    away in the weights the model runs with, and save only bf16 values). Answers come from a --generation_dtype bf16
    copy of the actor, which changes none of that."""
    from utils.model.model_utils import resolve_model_name_or_path

    out = tmp_path / "out"
    proc = _ok(run_entry(
        STEP3, *DATA, "--data_output_path", tmp_path / "data", "--actor_model_name_or_path", "tiny-opt",
        "--critic_model_name_or_path", untrained_reward_model, "--output_dir", out, "--dtype", "bf16",
        "--torch_autocast", "--generation_dtype", "bf16", "--max_prompt_seq_len", 16, "--max_answer_seq_len", 8,
        "--per_device_generation_batch_size", 4, "--per_device_training_batch_size", 4, "--max_steps", 2,
        "--do_sample", "--actor_learning_rate", 1e-6, "--critic_learning_rate", 1e-6, "--num_warmup_steps", 0,
        env=OMP))
    before, after = _weights(resolve_model_name_or_path("tiny-opt")), _weights(out / "actor")
    moved = 0
    for name, w in after.items():
        assert w.dtype == torch.float32, name
        step = (w - before[name]).abs()
        assert float(step.max()) < 1e-4, name  # two steps of lr 1e-6
        resolution = before[name].abs() * 2.0 ** -9  # half a bf16 ulp of the weight
        moved += int(((step > 0) & (step < resolution)).sum())
    assert moved > 1000  # kept fp32 updates smaller than a bf16 weight can hold
    assert "generation: from a bf16 copy of the actor, refreshed before each generation" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r[k]) for r in train for k in ("actor_loss", "critic_loss", "reward", "kl"))


PARITY_REWARD = "def score(prompts, answers, rows):\n    return [float(len(a.split()) % 2) for a in answers]\n"


@pytest.fixture(scope="module")
def untrained_reward_model(tmp_path_factory):
    """An untrained step-2 folder of tiny-opt (the critic of a PPO run; its values need no training to run)."""
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer

    folder = tmp_path_factory.mktemp("untrained") / "reward"
    tokenizer = load_hf_tokenizer("tiny-opt")
    save_reward_model(create_critic_model("tiny-opt", tokenizer, None, 1), tokenizer, str(folder))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_each_policy_loss_end_to_end(policy_loss, untrained_reward_model, step12, tmp_path):
    """Two RL steps per policy loss on tiny-opt, each with another estimator: ppo as DAPO (GRPO, clip-higher,
    token mean, dynamic sampling, truncated answers masked, the overlong penalty), gspo with RLOO (its ε and
    per-answer aggregation by default), cispo with PPO's critic. DAPO's actor is step 1's (some of its answers end
    before the cap: a random one's are all cut, and masked, and a run that changes nothing is refused)."""
    (tmp_path / "parity.py").write_text(PARITY_REWARD)
    actor = step12[0] if policy_loss == "ppo" else "tiny-opt"
    common = [*DATA, "--data_output_path", tmp_path / "data", "--actor_model_name_or_path", actor,
              "--output_dir", tmp_path / "out", "--policy_loss", policy_loss, "--max_prompt_seq_len", 16,
              "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 4, "--max_steps", 2, "--do_sample",
              "--actor_learning_rate", 1e-3, "--num_warmup_steps", 0]
    flags = {
        "ppo": ["--advantage_estimator", "grpo", "--n_samples_per_prompt", 2, "--reward_fn",
                f"{tmp_path / 'parity.py'}:score", "--cliprange_high", 0.28, "--loss_agg", "token_mean",
                "--dynamic_sampling", "--dynamic_sampling_max_batches", 3, "--mask_truncated_answers",
                "--overlong_penalty", 4, "--overlong_penalty_weight", 0.5, "--per_device_training_batch_size", 3],
        "gspo": ["--advantage_estimator", "rloo", "--n_samples_per_prompt", 2, "--reward_fn",
                 f"{tmp_path / 'parity.py'}:score",
                 "--per_device_training_batch_size", 8],
        "cispo": ["--critic_model_name_or_path", untrained_reward_model, "--critic_learning_rate", 1e-3,
                  "--per_device_training_batch_size", 2, "--gradient_accumulation_steps", 2],
    }[policy_loss]
    proc = _ok(run_entry(STEP3, *common, *flags, env=OMP))
    log = proc.stdout + proc.stderr
    expected = {"ppo": "policy loss: ppo (clip 1 − 0.2 … 1 + 0.28); loss aggregation: token_mean; answers cut at the "
                       "length cap masked out of the losses; overlong penalty over the last 4 tokens, weight 0.5; "
                       "dynamic sampling (at most 3 generation batches a round)",
                "gspo": "policy loss: gspo (clip 1 − 0.0003 … 1 + 0.0004); loss aggregation: seq_mean_token_mean",
                "cispo": "policy loss: cispo (clip 1 − 1 … 1 + 4); loss aggregation: token_mean"}[policy_loss]
    assert expected in log
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert math.isfinite(r["actor_loss"]) and math.isfinite(r["reward"]) and 0 <= r["truncated"] <= 1
        assert ("critic_loss" in r) == (policy_loss == "cispo")
        assert ("task_reward" in r) == (policy_loss == "ppo")  # the reward before the overlong penalty, its only run
        if policy_loss == "ppo":  # 4 groups a round on the one rank; the rest dropped or filled, all counted
            assert r["reward"] <= r["task_reward"] + 1e-6 and "before the overlong penalty: " in log
            assert r["groups_kept"] + r["groups_filled"] == 4 and 1 <= r["sampled_batches"] <= 3
            assert r["groups_kept"] + r["groups_filtered"] + r["groups_surplus"] == 4 * r["sampled_batches"]
            assert f"groups kept: {r['groups_kept']:.0f} of" in log
    assert (tmp_path / "out" / "critic").is_dir() == (policy_loss == "cispo")


CONSTANT_REWARD = "def score(prompts, answers, rows):\n    return [1.0 for a in answers]\n"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["every_answer_masked", "every_advantage_zero"])
def test_rl_steps_that_leave_the_actor_as_it_was_save_nothing(case, tmp_path):
    """Issue 57, rule 2: a run whose RL steps changed nothing does not end as a success. With
    ``--max_answer_seq_len 2`` every kept answer (≥ 2 tokens) is cut at the cap, and ``--mask_truncated_answers``
    leaves all of them out of every loss; with a constant reward every GRPO advantage is 0 (and with ``--kl_ctl 0``
    there is no KL term). Before: exit 0 and an actor bit-identical to its input."""
    (tmp_path / "constant.py").write_text(CONSTANT_REWARD)
    flags = {"every_answer_masked": ["--reward_fn", "builtin_rule", "--mask_truncated_answers",
                                     "--max_answer_seq_len", 2],
             # no reference model: with dropout on, the KL loss's gradient would move the actor
             "every_advantage_zero": ["--reward_fn", f"{tmp_path / 'constant.py'}:score", "--max_answer_seq_len", 8,
                                      "--kl_ctl", 0]}
    out = tmp_path / "out"
    proc = run_entry(STEP3, *DATA, "--data_output_path", tmp_path / "data", "--actor_model_name_or_path", "tiny-opt",
                     "--output_dir", out, "--advantage_estimator", "grpo", "--n_samples_per_prompt", 2,
                     "--max_prompt_seq_len", 16, "--per_device_generation_batch_size", 4,
                     "--per_device_training_batch_size", 8, "--max_steps", 2, "--do_sample",
                     "--actor_learning_rate", 1e-3, "--num_warmup_steps", 0, *flags[case], env=OMP)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    why = {"every_answer_masked": "every answer was cut at --max_answer_seq_len 2 and --mask_truncated_answers",
           "every_advantage_zero": "every advantage was 0"}[case]
    assert "2 RL step(s) ran but the actor is the input model, weight for weight" in proc.stderr and why in proc.stderr
    assert not (out / "actor").exists()


def test_unchanged_actor_reason_names_the_cause():
    from step3_rlhf_finetuning.config import PPOConfig
    from step3_rlhf_finetuning.main import unchanged_actor_reason

    masked = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, mask_truncated_answers=True)
    assert "every answer was cut at --max_answer_seq_len 4" in unchanged_actor_reason(
        [{"truncated": 1.0}, {"truncated": 1.0}], masked, 4, False, 2, 0)
    # one step with an answer that ended: not the masking's doing
    assert "every advantage was 0" in unchanged_actor_reason([{"truncated": 1.0}, {"truncated": 0.5}], masked, 4,
                                                             False, 2, 0)
    assert "no update moved a weight" in unchanged_actor_reason([{"truncated": 0.5}], PPOConfig(), 4, True, 2, 0)
    # one optimizer step with a warm-up: the schedule's first learning rate is 0, whatever else happened
    assert "its one optimizer step ran at learning rate 0, the start of the --num_warmup_steps 100 warm-up" in \
        unchanged_actor_reason([{"truncated": 1.0}], masked, 4, False, 1, 100)
    assert "learning rate 0" not in unchanged_actor_reason([{"truncated": 1.0}], masked, 4, False, 2, 100)
