"""Flags and inputs checked, nothing silent (README, reliability rules 2 and 7): every flag value of chat.py, rw_eval
and prompt_eval; numeric flags within their meaning; a flag that cannot apply refused or named; no run without an
optimizer step; inputs that are not what the flag says refused, or reported with the numbers (texts cut at
--max_seq_len). Each entry-point case ends with one ``error:`` line, exit 2, and leaves every file as it was."""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from utils.errors import UserInputError


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


# --------------------------------------------------------------------------- every entry point, case by case

STEP1 = "step1_supervised_finetuning/main.py"
STEP2 = "step2_reward_model_finetuning/main.py"
DPO = "step2_dpo_finetuning/main.py"
STEP3 = "step3_rlhf_finetuning/main.py"
CHAT = "chat.py"
RW_EVAL = "step2_reward_model_finetuning/rw_eval.py"
PROMPT_EVAL = "step1_supervised_finetuning/prompt_eval.py"
TINY = ["--model_name_or_path", "tiny-opt", "--max_seq_len", "64", "--data_path", "builtin/preference-small",
        "--data_output_path", "{dir}/data", "--output_dir", "{dir}/out"]
STEP3_ARGS = ["--actor_model_name_or_path", "tiny-opt", "--critic_model_name_or_path", "{rm}", "--data_path",
              "builtin/preference-small", "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8",
              "--data_output_path", "{dir}/data", "--output_dir", "{dir}/out"]
GRPO = ["--actor_model_name_or_path", "tiny-opt", "--data_path", "builtin/preference-small", "--max_prompt_seq_len",
        "16", "--max_answer_seq_len", "8", "--advantage_estimator", "grpo", "--n_samples_per_prompt", "2",
        "--do_sample", "--reward_fn", "builtin_rule", "--per_device_generation_batch_size", "4",
        "--per_device_training_batch_size", "8", "--data_output_path", "{dir}/data", "--output_dir", "{dir}/out"]
PAIR = ["--prompt", " Human: Describe the lamp. Assistant:", "--answer", " The lamp is bright."]
LONG_PROMPT = " Human: Describe the lamp" + " and the lamp" * 40 + ". Assistant:"

# name: (entry point, arguments, files {name: bytes}, fragments of the one error line)
CASES = {
    # rule 3: every flag value of chat.py, rw_eval and prompt_eval
    "chat_negative_seed": (CHAT, ["--path", "tiny-opt", "--seed", "-1"], {},
                           ["argument --seed: must be between 0 and 2**32 - 1, got -1"]),
    "chat_meta_device": (CHAT, ["--path", "tiny-opt", "--device", "meta"], {}, ["--device meta", "cpu or cuda"]),
    "chat_empty_path": (CHAT, ["--path", ""], {}, ["--path is empty"]),
    "chat_answers_longer_than_the_model": (CHAT, ["--path", "tiny-opt", "--max_new_tokens", "600"], {},
                                           ["--max_new_tokens 600", "512 positions", "at most 511"]),
    "chat_negative_top_k_greedy": (CHAT, ["--path", "tiny-opt", "--top_k", "-1"], {}, ["sampling needs", "got"]),
    "rw_eval_one_token": (RW_EVAL, ["--model_name_or_path", "{rm}", "--max_seq_len", "1", *PAIR], {},
                          ["--max_seq_len must be ≥ 2", "got 1"]),
    "rw_eval_beyond_positions": (RW_EVAL, ["--model_name_or_path", "{rm}", "--max_seq_len", "600", *PAIR], {},
                                 ["--max_seq_len = 600", "512 positions"]),
    "rw_eval_negative_pads": (RW_EVAL, ["--model_name_or_path", "{rm}", "--num_padding_at_beginning", "-1", *PAIR],
                              {}, ["--num_padding_at_beginning", "must be ≥ 0, got -1"]),
    "rw_eval_pads_the_tokenizer_contradicts": (RW_EVAL, ["--model_name_or_path", "{rm}", "--num_padding_at_beginning",
                                                         "0", *PAIR], {},
                                               ["--num_padding_at_beginning 0", "starts every text with 1 pad"]),
    "rw_eval_not_a_reward_model": (RW_EVAL, ["--model_name_or_path", "tiny-opt", *PAIR], {}, ["--model_name_or_path"]),
    "rw_eval_input_not_text": (RW_EVAL, ["--model_name_or_path", "{rm}", "--input_file", "{dir}/in.jsonl"],
                               {"in.jsonl": b"\xff\xfe\x00garbage\n"}, ["--input_file", "not UTF-8 text"]),
    "rw_eval_row_not_an_object": (RW_EVAL, ["--model_name_or_path", "{rm}", "--input_file", "{dir}/in.jsonl"],
                                  {"in.jsonl": b"[1, 2]\n"}, ["line 1: a JSON list, not an object"]),
    "rw_eval_input_is_a_folder": (RW_EVAL, ["--model_name_or_path", "{rm}", "--input_file", "{dir}"], {},
                                  ["--input_file", "is a folder"]),
    "rw_eval_output_in_no_folder": (RW_EVAL, ["--model_name_or_path", "{rm}", "--output_file", "{dir}/no/s.jsonl",
                                              *PAIR], {}, ["--output_file", "no folder"]),
    "rw_eval_answer_cut_away": (RW_EVAL, ["--model_name_or_path", "{rm}", "--max_seq_len", "16", "--prompt",
                                          LONG_PROMPT, "--answer", " The lamp is bright."], {},
                                ["--max_seq_len 16", "1 of 1 answers lie wholly beyond it", "row 0's answer"]),
    "prompt_eval_language_and_prompts": (PROMPT_EVAL, ["--model_name_or_path_baseline", "tiny-opt",
                                                       "--model_name_or_path_finetune", "tiny-opt", "--language",
                                                       "Chinese", "--prompts", "Human: hi Assistant:"], {},
                                         ["--language Chinese would not be used"]),
    "prompt_eval_beyond_positions": (PROMPT_EVAL, ["--model_name_or_path_baseline", "tiny-opt",
                                                   "--model_name_or_path_finetune", "tiny-opt", "--max_new_tokens",
                                                   "510", "--prompts", "Human: Describe the lamp. Assistant:"], {},
                                     ["--max_new_tokens 510", "512 positions", "new tokens fit"]),
    "collect_beyond_positions": ("step2_reward_model_finetuning/collect_comparisons.py",
                                 ["--actor_model_name_or_path", "tiny-opt", "--data_path", "builtin/preference-small",
                                  "--label_fn", "builtin_preference", "--max_new_tokens", "510", "--output_dir",
                                  "{dir}/comparisons", "--data_output_path", "{dir}/data"], {},
                                 ["--max_new_tokens 510", "512 positions", "at most 499 new tokens fit"]),
    # rule 4: numeric flags in their range, flags that cannot apply, runs without an optimizer step
    "negative_eval_interval": (STEP2, [*TINY, "--eval_interval", "-1"], {}, ["--eval_interval must be ≥ 0", "got -1"]),
    "negative_warmup": (STEP1, [*TINY, "--num_warmup_steps", "-5"], {}, ["--num_warmup_steps must be ≥ 0, got -5"]),
    "infinite_dpo_beta": (DPO, [*TINY, "--beta", "inf"], {}, ["--beta must be a finite number > 0, got inf"]),
    "tensorboard_path_without_tensorboard": (STEP1, [*TINY, "--tensorboard_path", "{dir}/tb"], {},
                                             ["--tensorboard_path", "would not be used without --enable_tensorboard"]),
    "step3_tensorboard_path_without_tensorboard": (STEP3, [*STEP3_ARGS, "--tensorboard_path", "{dir}/tb"], {},
                                                   ["would not be used without --enable_tensorboard"]),
    "lora_rate_without_lora": (STEP1, [*TINY, "--lora_learning_rate", "1e-3"], {},
                               ["--lora_learning_rate would not be used", "--lora_dim is 0"]),
    "step3_zero_reward_clip": (STEP3, [*STEP3_ARGS, "--clip_reward_value", "0"], {},
                               ["--clip_reward_value must be a finite number > 0"]),
    "step3_negative_unsup_coef": (STEP3, [*STEP3_ARGS, "--unsup_coef", "-1"], {}, ["--unsup_coef must be"]),
    "step3_max_seq_len": (STEP3, [*STEP3_ARGS, "--max_seq_len", "64"], {}, ["--max_seq_len 64 would not be used"]),
    "step3_temperature_without_sampling": (STEP3, [*STEP3_ARGS, "--temperature", "0.7"], {},
                                           ["--temperature 0.7 would not be used", "without --do_sample"]),
    "step3_hybrid_flag_without_hybrid_engine": (STEP3, [*STEP3_ARGS, "--tp_gather_partition_size", "4"], {},
                                                ["--tp_gather_partition_size would not be used without "
                                                 "--enable_hybrid_engine"]),
    "step3_unsup_coef_without_text": (STEP3, [*STEP3_ARGS, "--unsup_coef", "1"], {},
                                      ["--unsup_coef would not be used without --unsupervised_dataset_name"]),
    "step3_actor_lora_name_without_lora": (STEP3, [*STEP3_ARGS, "--actor_lora_module_name", "layers."], {},
                                           ["--actor_lora_module_name would not be used", "--actor_lora_dim is 0"]),
    "chat_temperature_without_sampling": (CHAT, ["--path", "tiny-opt", "--temperature", "0.5"], {},
                                          ["--temperature 0.5 would not be used"]),
    "train_py_cpu_ranks_on_one_gpu": ("train.py", ["--demo", "--dry-run", "--cpu-ranks", "2"], {},
                                      ["--cpu-ranks 2 would not be used", "single_node"]),
    "train_py_zero_gpus": ("train.py", ["--demo", "--dry-run", "--num-gpus", "0"], {},
                           ["argument --num-gpus: must be ≥ 1, got 0"]),
    "train_py_hostfile_on_one_node": ("train.py", ["--demo", "--dry-run", "--hostfile", "{dir}/hosts",
                                                   "--deployment-type", "single_node"], {"hosts": b"w1 slots=2\n"},
                                      ["--hostfile", "would not be used", "multi_node's (got single_node)"]),
    "train_py_gpus_for_several_nodes": ("train.py", ["--demo", "--dry-run", "--num-gpus", "2", "--deployment-type",
                                                     "multi_node"], {}, ["--num-gpus 2 would not be used"]),
    "step3_no_optimizer_step": (STEP3, [*GRPO, "--max_steps", "1", "--gradient_accumulation_steps", "64"], {},
                                ["--gradient_accumulation_steps 64", "the run has 1 (1 RL step(s) × 1 micro-batch(es) "
                                 "a round × --ppo_epochs 1, per rank)", "no optimizer step would run"]),
}


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory, reward_folder):
    """Every case, two at a time: (exit code, stdout, stderr, the case folder before, after)."""
    base = tmp_path_factory.mktemp("flag_cases")
    pending, running, results = list(CASES.items()), {}, {}
    while pending or running:
        while pending and len(running) < 2:
            case, (script, args, files, _) = pending.pop(0)
            folder = base / case
            folder.mkdir()
            for name, data in files.items():
                (folder / name).write_bytes(data)
            before = _tree(folder)
            cmd = [sys.executable, str(REPO / script), *[a.format(dir=folder, rm=reward_folder) for a in args]]
            running[case] = (subprocess.Popen(cmd, cwd=folder, env=_env(), stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True),
                             folder, before)
        case = next(iter(running))
        proc, folder, before = running.pop(case)
        out, err = proc.communicate(timeout=600)
        results[case] = (proc.returncode, out, err, before, _tree(folder))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_each_case_is_one_clear_line_and_leaves_every_file_as_it_was(case, case_runs):
    rc, out, err, before, after = case_runs[case]
    assert rc == 2, (out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    message = [line for line in err.splitlines() if "error: " in line]
    assert len(message) == 1, err[-3000:]
    for fragment in CASES[case][3]:
        assert fragment in message[0], message[0]
    written = set(after) - set(before)
    # at most the tokenised-data cache and the output folder's lock (a run refused after set-up)
    assert all(name.startswith("data/") or name == ".out.lock" for name in written), written
    assert {name: after[name] for name in before} == before


# --------------------------------------------------------------------------- function level

def _common(**changes):
    from types import SimpleNamespace

    args = SimpleNamespace(data_split="2,4,4", per_device_train_batch_size=8, per_device_eval_batch_size=8,
                           gradient_accumulation_steps=1, max_seq_len=64, num_train_epochs=1, max_steps=0,
                           only_optimize_lora=False, lora_dim=0, output_dir="out", save_interval=0,
                           max_checkpoints=2, resume=False, learning_rate=1e-3, lora_learning_rate=5e-4,
                           lora_module_name="decoder.layers.", weight_decay=0.0, dropout=None, eval_interval=0,
                           num_warmup_steps=0, add_eot_token=False, eot_token="<|endoftext|>")
    for field, value in changes.items():
        setattr(args, field, value)
    return args


@pytest.mark.parametrize("field, value, message", [
    ("eval_interval", -1, r"--eval_interval must be ≥ 0 \(0 = only before training and after each epoch\), got -1"),
    ("num_warmup_steps", -1, "--num_warmup_steps must be ≥ 0, got -1"),
    ("unsup_coef", float("nan"), r"--unsup_coef must be a finite number ≥ 0 \(0 = no LM loss\), got nan"),
    ("clip_reward_value", 0.0, r"--clip_reward_value must be a finite number > 0"),
    ("tp_gather_partition_size", 0, "--tp_gather_partition_size must be ≥ 1, got 0"),
    ("beta", float("inf"), "--beta must be a finite number > 0, got inf"),
    ("critic_lora_learning_rate", float("nan"), "--critic_lora_learning_rate must be a finite number > 0"),
    ("lora_module_name", "layers.", "--lora_module_name would not be used: --lora_dim is 0"),
    ("add_eot_token", True, None),  # with the default --eot_token: accepted
])
def test_the_shared_range_table_and_flags_that_cannot_apply(field, value, message):
    from utils.arguments import validate_common

    validate_common(_common())
    if message is None:
        validate_common(_common(**{field: value}))
        with pytest.raises(UserInputError, match="--add_eot_token needs a non-empty --eot_token"):
            validate_common(_common(add_eot_token=True, eot_token=" "))
        return
    with pytest.raises(UserInputError, match=message):
        validate_common(_common(**{field: value}))


def test_no_optimizer_step_is_refused_up_front_and_before_saving():
    from types import SimpleNamespace

    from utils.errors import TrainingDiverged
    from utils.training import check_steps_ran, count_optimizer_steps, refuse_no_optimizer_step

    assert count_optimizer_steps(10, 4, 2) == 6 and count_optimizer_steps(10, 4, 2, max_steps=2) == 2
    with pytest.raises(UserInputError, match=r"--gradient_accumulation_steps 8 needs 8 micro-batches per optimizer "
                                             r"step, but the run has 3 \(how\): no optimizer step would run"):
        refuse_no_optimizer_step(3, 8, "how")
    check_steps_ran("optimizer step", 5, 5)
    check_steps_ran("optimizer step", 3, 5)  # resumed: its checkpoint's steps trained the model
    with pytest.raises(UserInputError, match=r"no RL step ran \(12 answers had ≤ 1 token and were dropped\): the "
                                             "model is unchanged, so nothing is saved"):
        check_steps_ran("RL step", 0, 4, why="12 answers had ≤ 1 token and were dropped")
    skipped_all = SimpleNamespace(global_steps=3, skipped_steps=3)
    with pytest.raises(TrainingDiverged, match="overflowed at every one of the 3 optimizer steps"):
        check_steps_ran("optimizer step", 3, 3, [skipped_all, None])
    check_steps_ran("optimizer step", 3, 3, [SimpleNamespace(global_steps=3, skipped_steps=2)])


@pytest.mark.parametrize("flags, message", [
    (["--print_answers_interval", "5"], "--print_answers_interval would not be used without --print_answers"),
    (["--release_inference_cache"], "--release_inference_cache would not be used without --enable_hybrid_engine"),
    (["--top_p", "0.9"], "--top_p 0.9 would not be used: without --do_sample"),
    (["--do_sample", "--top_p", "0.9", "--temperature", "0.7"], None),
    (["--critic_lora_learning_rate", "1e-3"], "--critic_lora_learning_rate would not be used: --critic_lora_dim is 0"),
    (["--critic_lora_dim", "4", "--critic_lora_learning_rate", "1e-3"], None),
    (["--per_device_unsup_batch_size", "4"],
     "--per_device_unsup_batch_size would not be used without --unsupervised_dataset_name"),
    (["--unsupervised_dataset_name", "t.txt", "--per_device_unsup_batch_size", "0"],
     "--per_device_unsup_batch_size must be ≥ 1, got 0"),
    (["--unsupervised_dataset_name", "t.txt", "--per_device_unsup_batch_size", "4"], None),
])
def test_step3_flags_that_cannot_apply_are_refused(flags, message):
    from step3_rlhf_finetuning.main import parse_args, validate_step3

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o"]
    if message is None:
        validate_step3(parse_args(base + flags))
        return
    with pytest.raises(UserInputError, match=message):
        validate_step3(parse_args(base + flags))


@pytest.mark.slow
def test_prompt_eval_names_the_flags_it_accepts_but_does_not_use(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / PROMPT_EVAL), "--model_name_or_path_baseline", "tiny-opt",
                           "--model_name_or_path_finetune", "tiny-opt", "--top_k", "5", "--penalty_alpha", "0.6",
                           "--max_new_tokens", "2", "--prompts", "Human: Describe the lamp. Assistant:"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: --top_k 5, --penalty_alpha 0.6 not used: this prompt_eval runs greedy and beam search only" \
        in proc.stderr


@pytest.mark.slow
def test_rw_eval_reports_texts_cut_at_max_seq_len_with_the_numbers(tmp_path, reward_folder):
    answer = " The lamp is bright" + " and bright" * 30 + "."
    proc = subprocess.run([sys.executable, str(REPO / RW_EVAL), "--model_name_or_path", str(reward_folder),
                           "--max_seq_len", "32", "--prompt", " Human: Describe the lamp. Assistant:", "--answer",
                           answer, "--answer", " The lamp is bright.", "--output_file", str(tmp_path / "s.jsonl")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: 1 of 2 texts are longer than --max_seq_len 32 (up to " in proc.stderr
    assert "they are scored at the cut, not at the answer's end" in proc.stderr
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 2


def test_training_texts_cut_at_max_seq_len_are_counted_in_the_log(tmp_path):
    """Step 1 and 2 cut texts at --max_seq_len (as DeepSpeed-Chat): the answers of those are shortened, and the
    reward model's score is read at the cut. How many is said, not hidden."""
    from utils.data.data_utils import create_prompt_dataset
    from utils.model.model_utils import load_hf_tokenizer

    lines = []
    train, _ = create_prompt_dataset(-1, ["builtin/preference-small"], "2,4,4", str(tmp_path / "data"), 2, 1234,
                                     load_hf_tokenizer("tiny-opt"), 20, log=lines.append)
    said = [line for line in lines if "were cut there" in line and line.startswith("data: phase 2 train: ")]
    assert len(said) == 1 and train.stats["cut"] > 0, lines
    assert f"{train.stats['cut']} of {2 * len(train)} texts are longer than --max_seq_len 20" in said[0]
    assert "the reward is read at the cut" in said[0]
    lines.clear()
    create_prompt_dataset(-1, ["builtin/preference-small"], "2,4,4", str(tmp_path / "data2"), 2, 1234,
                          load_hf_tokenizer("tiny-opt"), 512, log=lines.append)
    assert not [line for line in lines if "were cut there" in line]


def test_unsupervised_text_that_is_not_text_is_refused(tmp_path):
    from utils.data.unsupervised import get_unsupervised_data
    from utils.model.model_utils import load_hf_tokenizer

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a line of text\n" * 50)
    (tmp_path / "corpus" / "weights.txt").write_bytes(b"\x80\x81\xfe\xff" * 100)
    with pytest.raises(UserInputError, match=r"weights\.txt is not UTF-8 text \(line 1: invalid start byte\)"):
        get_unsupervised_data(str(tmp_path / "corpus"), None, load_hf_tokenizer("tiny-opt"), 16, log=lambda *_: None)


def test_a_warm_up_the_schedule_ignores_or_the_run_never_finishes_is_said_with_the_numbers():
    from utils.training import schedule_note

    assert schedule_note("cosine", 0, 10) is None and schedule_note("cosine", 5, 10) is None
    assert schedule_note("constant", 0, 3) is None
    assert schedule_note("cosine", 100, 5) == ("--num_warmup_steps 100 is more than the run's 5 optimizer steps: the "
                                               "learning rate rises the whole run and ends at 5% of its peak")
    assert schedule_note("constant", 10, 50).startswith("--num_warmup_steps 10 is not used: --lr_scheduler_type "
                                                        "constant has no warm-up")
