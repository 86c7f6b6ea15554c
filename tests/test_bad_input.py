"""Bad input, across the entry points and the data / output layers: each kind ends with ONE
clear ``error:`` line naming the culprit, exit code 2, no traceback and no partial output.

Two tables:

* ``CLI_CASES`` run the real entry points in subprocesses (started together, a few at
  a time). All but two fail in the pre-flight checks (:mod:`utils.preflight`, argument
  validation), before DeepSpeed or any model is set up: the disk-full case trains first,
  and an empty eval split is found when the data are split (after model set-up, before
  training). Either way the output folder must not exist afterwards (or, for a finished
  run's folder, be unchanged).
* ``test_*`` functions below check the layers directly (UserInputError and its message).

Kinds covered elsewhere and not repeated here: malformed JSON / missing column / unknown
dataset / bad ``--data_split`` through step 1's CLI (tests/test_step1.py); wrong types,
empty files, unsupported files, missing paths in the data layer (tests/test_raw_datasets.py);
non-existent / config-only model folders (tests/test_model_utils.py); a step-1 folder
loaded as a reward model (tests/test_reward_model.py); step 3's flag combinations at the
function level (tests/test_ppo_trainer.py); ZeRO/offload/dtype combinations
(tests/test_zero_matrix.py); a checkpoint from another configuration, a failing
checkpoint write (tests/test_checkpoint.py); reruns into finished / unfinished output
folders, resuming with changed flags, ``metrics.jsonl`` across reruns and Ctrl-C
(tests/test_reruns.py).
"""
import errno
import json
import os
import resource
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO, Payload
from utils.errors import UserInputError
from utils.run_folder import MANIFEST

STEP1 = "step1_supervised_finetuning/main.py"
STEP2 = "step2_reward_model_finetuning/main.py"
DPO = "step2_dpo_finetuning/main.py"
STEP3 = "step3_rlhf_finetuning/main.py"
CHAT = "chat.py"
RW_EVAL = "step2_reward_model_finetuning/rw_eval.py"
PROMPT_EVAL = "step1_supervised_finetuning/prompt_eval.py"
TRAIN = "train.py"
TINY = ["--model_name_or_path", "tiny-opt", "--max_seq_len", "64", "--data_path", "builtin/preference-small"]
STEP3_MODELS = ["--actor_model_name_or_path", "tiny-opt", "--critic_model_name_or_path", "{rm}",
                "--data_path", "builtin/preference-small", "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8"]
# critic-free step 3 of a random actor: 16 prompts x 2 answers
GRPO = ["--actor_model_name_or_path", "tiny-opt", "--data_path", "builtin/preference-small", "--max_prompt_seq_len",
        "16", "--max_answer_seq_len", "8", "--advantage_estimator", "grpo", "--n_samples_per_prompt", "2",
        "--do_sample", "--max_steps", "1"]
ONE_AND_A_HALF_MB = 1_500_000

# name: (entry point, arguments, files to write {name: text}, fragments of the error line, options)
# placeholders: {dir} = the case's folder, {rm} = a real step-2 folder (built once), {rm_llama} = one of tiny-llama
# options: out (the --output_dir), keep_out (it exists before the run), trains (it trains before failing),
# bare (no --data_output_path/--output_dir: chat.py), copy (copy a built-in model folder into {dir}/NAME first:
# {NAME: (built-in name, "truncate" or None)}), untouched (the --output_dir's files are the same afterwards)
FORTY_ROWS = "".join(json.dumps({"prompt": f" Human: Describe thing {i}. Assistant:", "chosen": " It is good.",
                                 "rejected": " It is bad."}) + "\n" for i in range(40))
CLI_CASES = {
    "negative_save_interval": (STEP1, [*TINY, "--save_interval", "-1"], {}, ["--save_interval must be ≥ 0"], {}),
    "resume_without_checkpoint": (STEP1, [*TINY, "--resume"], {}, ["--resume: no checkpoint in", "checkpoints"], {}),
    "missing_model_folder": (STEP1, ["--model_name_or_path", "{dir}/no-such-model", "--data_path",
                                     "builtin/preference-small"], {}, ["no-such-model", "no such folder"], {}),
    "reward_folder_as_sft_model": (STEP1, ["--model_name_or_path", "{rm}", "--data_path", "builtin/preference-small"],
                                   {}, ["--model_name_or_path", "step-2 reward model folder"], {}),
    "output_dir_below_a_file": (STEP1, [*TINY], {"afile": "x"}, ["--output_dir", "afile is a file, not a folder"],
                                {"out": "{dir}/afile/out"}),
    "zero_share_for_this_phase": (STEP1, [*TINY, "--data_split", "0,5,5"], {},
                                  ["--data_split 0,5,5", "phase 1", "is 0"], {}),
    "empty_data_file": (STEP2, ["--model_name_or_path", "tiny-opt", "--data_path", "{dir}/empty.jsonl"],
                        {"empty.jsonl": ""}, ["empty.jsonl", "empty"], {}),
    "unknown_dataset_step2": (STEP2, ["--model_name_or_path", "tiny-opt", "--data_path", "someone/nothing"], {},
                              ["someone/nothing", "not a supported dataset name"], {}),
    "zero_max_checkpoints": (STEP2, [*TINY, "--max_checkpoints", "0"], {}, ["--max_checkpoints must be ≥ 1"], {}),
    "fp16_on_cpu_dpo": (DPO, [*TINY, "--dtype", "fp16"], {}, ["--dtype fp16 needs a GPU"], {}),
    "autocast_without_bf16_step3": (STEP3, [*STEP3_MODELS, "--torch_autocast"], {},
                                    ["--torch_autocast", "needs --dtype bf16 (got fp32)"], {}),
    "malformed_json_dpo": (DPO, ["--model_name_or_path", "tiny-opt", "--data_path", "{dir}/bad.jsonl"],
                           {"bad.jsonl": '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a",\n'},
                           ["bad.jsonl", "malformed JSON on line 2"], {}),
    "output_dir_is_a_file_dpo": (DPO, [*TINY], {"out": "not a folder"}, ["--output_dir", "is not a folder"],
                                 {"keep_out": True}),
    "inference_tp_without_zero3": (STEP3, [*STEP3_MODELS, "--inference_tp_size", "2", "--enable_hybrid_engine"], {},
                                   ["--inference_tp_size > 1 needs --actor_zero_stage 3"], {}),
    "step1_folder_as_critic": (STEP3, ["--actor_model_name_or_path", "tiny-opt", "--critic_model_name_or_path",
                                       "tiny-opt"], {}, ["not a step-2 reward model folder"], {}),
    # second round (issue 14): results that looked fine but were wrong, tracebacks, reruns
    "negative_lora_dim": (STEP1, [*TINY, "--lora_dim", "-8"], {}, ["--lora_dim must be ≥ 0", "got -8"], {}),
    "negative_actor_lora_dim": (STEP3, [*STEP3_MODELS, "--actor_lora_dim", "-8"], {},
                                ["--actor_lora_dim must be ≥ 0", "got -8"], {}),
    "negative_max_steps_dpo": (DPO, [*TINY, "--max_steps", "-1"], {}, ["--max_steps must be ≥ 0", "got -1"], {}),
    "nan_learning_rate_step2": (STEP2, [*TINY, "--learning_rate", "nan"], {},
                                ["--learning_rate must be a finite number > 0", "got nan"], {}),
    "negative_learning_rate_step3": (STEP3, [*STEP3_MODELS, "--critic_learning_rate", "-1"], {},
                                     ["--critic_learning_rate must be a finite number > 0", "got -1"], {}),
    "one_token_sequences": (STEP1, [*TINY, "--max_seq_len", "1"], {}, ["--max_seq_len must be ≥ 2", "no next token"],
                            {}),
    "max_seq_len_beyond_positions": (STEP1, [*TINY, "--max_seq_len", "600"], {},
                                     ["--max_seq_len = 600", "512 positions", "tiny-opt"], {}),
    "step3_lengths_beyond_positions": (STEP3, [*STEP3_MODELS, "--max_prompt_seq_len", "400", "--max_answer_seq_len",
                                               "200"], {}, ["--max_prompt_seq_len + --max_answer_seq_len = 600",
                                                            "512 positions"], {}),
    "actor_and_reward_vocabularies_differ": (STEP3, [*STEP3_MODELS, "--critic_model_name_or_path", "{rm_llama}"], {},
                                             ["vocabulary mismatch", "669 tokens", "673 tokens",
                                              "--allow_vocab_mismatch"], {}),
    "truncated_weights_step1": (STEP1, [*TINY, "--model_name_or_path", "{dir}/model"], {},
                                ["--model_name_or_path", "model.safetensors is damaged", "truncated"],
                                {"copy": {"model": ("tiny-opt", "truncate")}}),
    "truncated_weights_chat": (CHAT, ["--path", "{dir}/model"], {}, ["--path", "model.safetensors is damaged"],
                               {"bare": True, "copy": {"model": ("tiny-opt", "truncate")}}),
    "chat_zero_new_tokens": (CHAT, ["--path", "tiny-opt", "--max_new_tokens", "0"], {},
                             ["--max_new_tokens must be ≥ 1, got 0"], {"bare": True}),
    "model_path_is_a_file": (STEP1, [*TINY, "--model_name_or_path", "{dir}/weights.bin"], {"weights.bin": "x"},
                             ["weights.bin", "is a file, not a model folder"], {}),
    "finished_output_dir": (STEP1, [*TINY], {}, ["--output_dir", "already holds a finished run", "--overwrite"],
                            {"copy": {"out": ("tiny-opt", None)}, "keep_out": True, "untouched": True}),
    "overwrite_and_resume": (STEP2, [*TINY, "--overwrite", "--resume"], {}, ["--overwrite", "--resume"], {}),
    # critic-free RL and reward functions (issue 22): refused up front, or at the first scoring (nothing saved)
    "group_estimator_with_one_answer": (STEP3, [*STEP3_MODELS, "--advantage_estimator", "grpo"], {},
                                        ["--advantage_estimator grpo", "--n_samples_per_prompt ≥ 2 (got 1)"], {}),
    "unknown_reward_fn": (STEP3, [*GRPO, "--reward_fn", "exact_match"], {},
                          ["--reward_fn exact_match: unknown reward function",
                           "builtin_rule, builtin_preference, gsm8k"], {}),
    "reward_fn_file_missing": (STEP3, [*GRPO, "--reward_fn", "{dir}/nowhere.py:score"], {},
                               ["--reward_fn", "nowhere.py:score: no such file"], {}),
    "reward_fn_not_defined": (STEP3, [*GRPO, "--reward_fn", "{dir}/r.py:score"],
                              {"r.py": "def other(prompts, answers, rows):\n    return [0.0] * len(answers)\n"},
                              ["r.py:score", "defines no 'score'"], {}),
    "reward_fn_raises": (STEP3, [*GRPO, "--reward_fn", "{dir}/r.py:score"],
                         {"r.py": "def score(prompts, answers, rows):\n    raise RuntimeError('boom')\n"},
                         ["r.py:score raised RuntimeError: boom on row 0 (prompt"], {}),
    "reward_fn_wrong_count": (STEP3, [*GRPO, "--reward_fn", "{dir}/r.py:score"],
                              {"r.py": "def score(prompts, answers, rows):\n    return [1.0]\n"},
                              ["r.py:score returned 1 scores for 32 answers"], {}),
    "reward_fn_nan": (STEP3, [*GRPO, "--reward_fn", "{dir}/r.py:score"],
                      {"r.py": "def score(prompts, answers, rows):\n    return [float('nan')] * len(answers)\n"},
                      ["r.py:score returned nan for row 0", "scores must be finite"], {}),
    "gsm8k_without_reference_answers": (STEP3, [*GRPO, "--reward_fn", "gsm8k"], {},
                                        ["--reward_fn gsm8k", "have no reference answer ending in '#### <number>'"],
                                        {}),
    "reward_fn_with_a_critic_flag": (STEP3, [*GRPO, "--reward_fn", "builtin_rule", "--critic_learning_rate", "1e-4"],
                                     {}, ["--critic_learning_rate would not be used", "grpo"], {}),
    "critic_folder_without_critic_or_reward_model": (STEP3, [*GRPO, "--reward_fn", "builtin_rule",
                                                             "--critic_model_name_or_path", "{rm}"], {},
                                                     ["--critic_model_name_or_path", "would not be used",
                                                      "--reward_fn_weight"], {}),
    # refused once the data are split (after model set-up, before training): a 40-row file has no phase-1 eval rows
    "empty_eval_split": (STEP1, ["--model_name_or_path", "tiny-opt", "--data_path", "{dir}/forty.jsonl"],
                         {"forty.jsonl": FORTY_ROWS}, ["forty.jsonl", "phase-1 eval split is empty", "perplexity"],
                         {}),
    # third round (issue 25): runs in which no optimizer step can happen are refused with the numbers
    "accumulation_beyond_the_data": (STEP1, [*TINY, "--gradient_accumulation_steps", "1000"], {},
                                     ["--gradient_accumulation_steps 1000", "no optimizer step would run"], {}),
    "one_token_answers": (STEP3, [*STEP3_MODELS, "--max_answer_seq_len", "1"], {},
                          ["--max_answer_seq_len 1", "no RL step could run"], {}),
    "opt_reward_model_without_its_leading_pad": (STEP2, [*TINY, "--num_padding_at_beginning", "0"], {},
                                                  ["--num_padding_at_beginning 0", "starts every text with 1 pad",
                                                   "pass --num_padding_at_beginning 1"], {}),
    "llama_reward_model_with_two_leading_pads": (STEP2, [*TINY, "--model_name_or_path", "tiny-llama",
                                                         "--num_padding_at_beginning", "2"], {},
                                                 ["--num_padding_at_beginning 2", "starts every text with 0 pad"], {}),
    "negative_leading_pads": (STEP2, [*TINY, "--num_padding_at_beginning", "-1"], {},
                              ["--num_padding_at_beginning", "must be ≥ 0, got -1"], {}),
    "chat_on_a_gpu_that_is_not_there": (CHAT, ["--path", "tiny-opt", "--device", "cuda:7"], {},
                                        ["--device cuda:7", "CUDA GPU(s)"], {"bare": True}),
    "chat_on_an_unknown_device": (CHAT, ["--path", "tiny-opt", "--device", "gpu"], {}, ["--device gpu"],
                                  {"bare": True}),
    "rw_eval_zero_batch": (RW_EVAL, ["--model_name_or_path", "{rm}", "--batch_size", "0"], {},
                           ["--batch_size", "must be ≥ 1, got 0"], {"bare": True}),
    "no_cpu_ranks": (TRAIN, ["--demo", "--dry-run", "--cpu-ranks", "0"], {}, ["--cpu-ranks", "must be between 1"],
                     {"bare": True}),
    "a_thousand_cpu_ranks": (TRAIN, ["--demo", "--dry-run", "--cpu-ranks", "1000"], {},
                             ["--cpu-ranks", "this machine's cores), got 1000"], {"bare": True}),
    "output_dir_is_the_input_model": (STEP1, [*TINY, "--model_name_or_path", "{dir}/model", "--overwrite"], {},
                                      ["--output_dir", "is the input model of --model_name_or_path",
                                       "give another --output_dir"],
                                      {"copy": {"model": ("tiny-opt", None)}, "out": "{dir}/model"}),
    "overwrite_then_data_refused_after_set_up": (STEP1, ["--model_name_or_path", "tiny-opt", "--data_path",
                                                         "{dir}/forty.jsonl", "--overwrite"],
                                                 {"forty.jsonl": FORTY_ROWS}, ["phase-1 eval split is empty"],
                                                 {"copy": {"out": ("tiny-opt", None)}, "keep_out": True,
                                                  "untouched": True}),
    "model_folder_without_weights": (STEP1, [*TINY, "--model_name_or_path", "{dir}/model"], {},
                                     ["--model_name_or_path", "no weights in it"],
                                     {"copy": {"model": ("tiny-opt", "no_weights")}}),
    "llama_folder_without_tokenizer_files": (STEP1, [*TINY, "--model_name_or_path", "{dir}/model"], {},
                                             ["--model_name_or_path", "no tokenizer files in it"],
                                             {"copy": {"model": ("tiny-llama", "no_tokenizer")}}),
    "unknown_model_type_chat": (CHAT, ["--path", "{dir}/model"], {}, ["--path", "model_type 'foo'", "does not know"],
                                {"bare": True, "copy": {"model": ("tiny-opt", "unknown_type")}}),
    "data_output_path_is_a_file": (STEP1, [*TINY, "--data_output_path", "{dir}/afile", "--output_dir", "{dir}/out"],
                                   {"afile": "x"}, ["--data_output_path", "afile: exists and is not a folder"],
                                   {"bare": True}),
    "train_py_output_dir_is_a_file": (TRAIN, ["--demo", "--output-dir", "{dir}/afile"], {"afile": "x"},
                                      ["--output-dir", "afile: exists and is not a folder"], {"bare": True}),
    "prompt_eval_unknown_model_type": (PROMPT_EVAL, ["--model_name_or_path_baseline", "tiny-opt",
                                                     "--model_name_or_path_finetune", "{dir}/model"], {},
                                       ["--model_name_or_path_finetune", "model_type 'foo'"],
                                       {"bare": True, "copy": {"model": ("tiny-opt", "unknown_type")}}),
    "prompt_eval_on_a_reward_folder": (PROMPT_EVAL, ["--model_name_or_path_baseline", "tiny-opt",
                                                     "--model_name_or_path_finetune", "{rm}"], {},
                                       ["--model_name_or_path_finetune", "step-2 reward model folder"],
                                       {"bare": True}),
    # a run that trains, then hits a full disk (a 1.5 MB file-size limit) writing its first checkpoint
    "disk_full_while_checkpointing": (STEP1, [*TINY, "--per_device_train_batch_size", "8", "--max_steps", "2",
                                              "--save_interval", "2"], {},
                                      ["cannot write checkpoint", "step-00000002", "disk full"],
                                      {"fsize": ONE_AND_A_HALF_MB, "trains": True}),
}


def _limit_file_size(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.fixture(scope="module")
def llama_reward_folder(tmp_path_factory):
    """A real (untrained) step-2 folder of tiny-llama (another tokenizer than tiny-opt's)."""
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer

    folder = tmp_path_factory.mktemp("rm_llama") / "reward"
    tokenizer = load_hf_tokenizer("tiny-llama")
    save_reward_model(create_critic_model("tiny-llama", tokenizer, None, 0), tokenizer, str(folder))
    return folder


def copy_builtin(name, dst, damage=None):
    """A copy of a built-in model's folder; ``damage``: "truncate" cuts its weights file in half, "no_weights",
    "no_tokenizer" remove them, "unknown_type" writes model_type "foo" into its config."""
    import shutil

    from utils.model.model_utils import resolve_model_name_or_path

    shutil.copytree(resolve_model_name_or_path(name), dst)
    if damage == "truncate":
        weights = os.path.join(dst, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
    elif damage == "no_weights":
        os.remove(os.path.join(dst, "model.safetensors"))
    elif damage == "no_tokenizer":
        for name in os.listdir(dst):
            if name.startswith("tokenizer"):
                os.remove(os.path.join(dst, name))
    elif damage == "unknown_type":
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(dict(config, model_type="foo"), f)
    return dst


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, reward_folder, llama_reward_folder):
    """Run every CLI case, at most 4 at a time (each pays Python + torch + DeepSpeed imports)."""
    base = tmp_path_factory.mktemp("bad_cli")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    pending, running, results, before = list(CLI_CASES.items()), {}, {}, {}
    while pending or running:
        while pending and len(running) < 4:
            case, (script, args, files, _, opts) = pending.pop(0)
            folder = base / case
            folder.mkdir()
            for name, text in files.items():
                (folder / name).write_text(text)
            for name, (model, damage) in opts.get("copy", {}).items():
                copy_builtin(model, folder / name, damage)
            before[case] = tree(folder / "out") if opts.get("untouched") else None
            out = opts.get("out", "{dir}/out").format(dir=folder)
            cmd = [sys.executable, str(REPO / script),
                   *[a.format(dir=folder, rm=reward_folder, rm_llama=llama_reward_folder) for a in args]]
            if not opts.get("bare"):
                cmd += ["--data_output_path", str(folder / "data"), "--output_dir", out]
            limit = opts.get("fsize")
            running[case] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, preexec_fn=_limit_file_size(limit) if limit else None),
                             folder)
        case = next(iter(running))
        proc, folder = running.pop(case)
        out, err = proc.communicate(timeout=600)
        results[case] = (proc.returncode, out, err, folder, before.get(case))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_input_is_one_clear_error_with_exit_code_2(case, cli_runs):
    rc, out, err, folder, before = cli_runs[case]
    fragments, opts = CLI_CASES[case][3], CLI_CASES[case][4]
    assert rc == 2, (out[-2000:], err[-3000:])
    assert "Traceback" not in err
    message = [line for line in err.splitlines() if "error: " in line]
    assert len(message) == 1, err[-3000:]
    for fragment in fragments:
        assert fragment in message[0], message[0]
    out_dir = folder / "out"
    if opts.get("trains"):  # trained before the disk filled up: only its metrics log, no partial checkpoint/model
        files = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file())
        assert files == sorted([MANIFEST, "metrics.jsonl"]), files  # and the manifest that lists it
    elif not opts.get("keep_out"):
        assert not out_dir.exists()  # failed before any set-up: nothing written
    if opts.get("untouched"):
        assert tree(out_dir) == before  # an earlier run's result is neither overwritten nor appended to


# --------------------------------------------------------------------------- function level

def test_read_only_output_folder_is_refused_before_training(tmp_path, monkeypatch):
    """Root ignores permission bits, so the read-only file system is simulated at the probe."""
    from utils.preflight import check_output_dir_writable

    check_output_dir_writable(str(tmp_path / "new" / "out"))  # a writable parent is enough
    assert not (tmp_path / "new").exists()  # the probe leaves nothing behind

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(UserInputError, match=r"--output_dir .*out: cannot write in .*\(Read-only file system\)"):
        check_output_dir_writable(str(tmp_path / "out"))


def test_full_disk_while_saving_a_model_leaves_the_old_folder(tmp_path):
    from utils.files import atomic_directory

    out = tmp_path / "actor"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old model")
    with pytest.raises(UserInputError, match=r"cannot write output folder .*actor: .*No space left on device"):
        with atomic_directory(str(out)) as tmp:
            with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
                f.write(b"half a mod")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert os.listdir(tmp_path) == ["actor"] and (out / "model.safetensors").read_bytes() == b"old model"


@pytest.mark.slow
def test_safetensors_write_failure_is_a_write_failure(tmp_path):
    """What safetensors raises when the disk is full is recognised (and turned into a clear error)."""
    import torch
    from safetensors.torch import save_file

    from utils.files import is_write_failure

    def write_big():
        save_file({"w": torch.zeros(1_000_000)}, str(tmp_path / "w.safetensors"))

    code = ("import resource, sys, torch; sys.path.insert(0, %r)\n"
            "from safetensors.torch import save_file\nfrom utils.files import is_write_failure\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))\n"
            "try:\n    save_file({'w': torch.zeros(1000000)}, %r)\n"
            "except Exception as e:\n    print(type(e).__name__, is_write_failure(e))\n") % (str(REPO),
                                                                                       str(tmp_path / "w.st"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["SafetensorError", "True"], proc.stderr[-2000:]
    write_big()  # without the limit the same write works
    assert not is_write_failure(RuntimeError("an ordinary bug")) and not is_write_failure(ValueError("x"))


def common_args(**changes):
    args = SimpleNamespace(data_split="2,4,4", per_device_train_batch_size=8, per_device_eval_batch_size=8,
                           gradient_accumulation_steps=1, max_seq_len=64, num_train_epochs=1, max_steps=0,
                           only_optimize_lora=False, lora_dim=0, output_dir="out", save_interval=0,
                           max_checkpoints=2, resume=False, learning_rate=1e-3, lora_learning_rate=5e-4,
                           weight_decay=0.0, dropout=None)
    for field, value in changes.items():
        setattr(args, field, value)
    return args


@pytest.mark.parametrize("field, value, message", [
    ("per_device_train_batch_size", 0, "--per_device_train_batch_size must be ≥ 1, got 0"),
    ("gradient_accumulation_steps", -2, "--gradient_accumulation_steps must be ≥ 1, got -2"),
    ("max_seq_len", 0, "--max_seq_len must be ≥ 1"),
    ("max_seq_len", 1, "--max_seq_len must be ≥ 2, got 1: a one-token sequence leaves no next token"),
    ("max_steps", -1, r"--max_steps must be ≥ 0 \(0 = no limit\), got -1"),
    ("lora_dim", -8, r"--lora_dim must be ≥ 0 \(0 = no LoRA\), got -8"),
    ("learning_rate", -1.0, "--learning_rate must be a finite number > 0, got -1.0"),
    ("learning_rate", float("nan"), "--learning_rate must be a finite number > 0, got nan"),
    ("learning_rate", 0.0, "--learning_rate must be a finite number > 0, got 0.0"),
    ("lora_learning_rate", float("inf"), "--lora_learning_rate must be a finite number > 0, got inf"),
    ("weight_decay", float("nan"), "--weight_decay must be a finite number ≥ 0, got nan"),
    ("dropout", 1.0, r"--dropout must be in \[0, 1\), got 1.0"),
    ("only_optimize_lora", True, "--only_optimize_lora needs --lora_dim > 0"),
    ("output_dir", None, "--output_dir is required"),
])
def test_common_flag_checks(field, value, message):
    from utils.arguments import validate_common

    validate_common(common_args())  # the defaults pass
    with pytest.raises(UserInputError, match=message):
        validate_common(common_args(**{field: value}))


@pytest.mark.parametrize("flags, message", [
    (["--actor_lora_dim", "-8"], "--actor_lora_dim must be ≥ 0"),
    (["--critic_lora_dim", "-1"], "--critic_lora_dim must be ≥ 0"),
    (["--actor_learning_rate", "nan"], "--actor_learning_rate must be a finite number > 0, got nan"),
    (["--critic_lora_learning_rate", "-1"], "--critic_lora_learning_rate must be a finite number > 0"),
    (["--actor_weight_decay", "-0.1"], "--actor_weight_decay must be a finite number ≥ 0"),
    (["--critic_dropout", "2"], r"--critic_dropout must be in \[0, 1\)"),
    (["--max_steps", "-1"], "--max_steps must be ≥ 0"),
    (["--gamma", "2"], "--gamma must be between 0 and 1, got 2.0"),
    (["--lam", "1.5"], "--lam must be between 0 and 1, got 1.5"),
    (["--kl_ctl", "-1"], "--kl_ctl must be a finite number ≥ 0, got -1.0"),
])
def test_step3_role_flags_are_checked_like_the_common_ones(flags, message):
    """Step 3's own flags, and its RL coefficients, are refused in one line before any set-up."""
    from step3_rlhf_finetuning.main import parse_args, validate_step3

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o"]
    validate_step3(parse_args(base))
    with pytest.raises(UserInputError, match=message):
        validate_step3(parse_args(base + flags))


@pytest.mark.parametrize("flags, message", [
    (["--overlong_penalty", "999"], "--overlong_penalty 999: the penalised tokens must be between 0"),
    (["--overlong_penalty", "32", "--overlong_penalty_weight", "0"], "--overlong_penalty_weight must be a finite "
                                                                      r"number > 0 \(--overlong_penalty 0 turns"),
    (["--overlong_penalty", "32", "--overlong_penalty_weight", "inf"], "--overlong_penalty_weight must be a finite "
                                                                        "number > 0"),
    (["--overlong_penalty_weight", "0.5"], "--overlong_penalty_weight 0.5 weighs the overlong penalty: it needs "
                                           "--overlong_penalty L"),
])
def test_dapo_flags_are_refused_in_one_line(flags, message):
    """The weight's range is NUMBER_RANGES' (validate_step3); what it needs and the buffer's range, validate_dapo's."""
    from step3_rlhf_finetuning.main import parse_args, validate_dapo, validate_step3

    def validate(args):
        validate_step3(args)
        validate_dapo(args)

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o"]
    validate(parse_args(base + ["--overlong_penalty", "32", "--overlong_penalty_weight", "0.25"]))
    with pytest.raises(UserInputError, match=message):
        validate(parse_args(base + flags))


@pytest.mark.parametrize("flags, message", [
    (["--enable_hybrid_engine"], "--generation_dtype bf16 and --enable_hybrid_engine both choose how the actor "
                                 "generates; give one"),
    (["--dtype", "bf16"], r"--generation_dtype bf16 with --dtype bf16: the actor's weights are bf16 already"),
])
def test_a_generation_copy_is_refused_where_it_cannot_copy_or_gains_nothing(flags, message):
    from step3_rlhf_finetuning.main import parse_args, validate_step3

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
            "--generation_dtype", "bf16"]
    for accepted in ([], ["--dtype", "bf16", "--torch_autocast"], ["--dtype", "fp32"], ["--actor_zero_stage", "2"],
                     ["--actor_zero_stage", "3"]):  # ZeRO-3: the copy is gathered from the partitions
        validate_step3(parse_args(base + accepted))
    with pytest.raises(UserInputError, match=message):
        validate_step3(parse_args(base + flags))


@pytest.mark.parametrize("seed", ["-1", str(2 ** 32)])
def test_a_seed_numpy_refuses_is_an_argparse_error_not_a_traceback(seed, capsys):
    """numpy raised "Seed must be between 0 and 2**32 - 1" from inside set_random_seed, after set-up."""
    from step1_supervised_finetuning.main import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--seed", seed])
    assert exit_info.value.code == 2
    assert f"argument --seed: must be between 0 and 2**32 - 1, got {seed}" in capsys.readouterr().err


def test_a_small_dataset_without_eval_rows_is_refused_for_steps_1_and_2(tmp_path):
    """40 rows: phase 1 gets 8 train and 0 eval rows (its perplexity would read 1.0 -> 1.0)."""
    from utils.data.data_utils import create_prompt_dataset
    from utils.model.model_utils import load_hf_tokenizer

    path = tmp_path / "forty.jsonl"
    path.write_text(FORTY_ROWS)
    tokenizer = load_hf_tokenizer("tiny-opt")
    with pytest.raises(UserInputError, match=r"forty\.jsonl: the phase-1 eval split is empty \(8 train rows, 0 eval "
                                             r"rows with --data_split 2,4,4\), so the perplexity cannot be measured"):
        create_prompt_dataset(-1, [str(path)], "2,4,4", str(tmp_path / "data"), 1, 1234, tokenizer, 64)
    train, evaluation = create_prompt_dataset(-1, [str(path)], "2,4,4", str(tmp_path / "data"), 2, 1234, tokenizer,
                                              64)
    assert len(train) > 0 and len(evaluation) > 0  # phase 2's larger share leaves eval rows: accepted
    with pytest.raises(UserInputError, match="phase-2 eval split is empty .* reward accuracy"):
        create_prompt_dataset(-1, [str(path)], "8,1,1", str(tmp_path / "data"), 2, 1234, tokenizer, 64)


def test_vocabularies_must_match_unless_allowed(reward_folder, llama_reward_folder):
    from utils.preflight import check_shared_vocabulary, preflight

    check_shared_vocabulary("tiny-opt", str(reward_folder))
    with pytest.raises(UserInputError, match=r"tiny-opt \(669 tokens\) and --critic_model_name_or_path .* \(673 "
                                             r"tokens\) disagree on \d+ tokens"):
        check_shared_vocabulary("tiny-opt", str(llama_reward_folder))
    args = SimpleNamespace(output_dir=None, trust_remote_code=False, allow_vocab_mismatch=False)
    step3_models = dict(causal_lms={"--actor_model_name_or_path": "tiny-opt"},
                        reward_models={"--critic_model_name_or_path": str(llama_reward_folder)},
                        length=(24, "--max_prompt_seq_len + --max_answer_seq_len"), data=False)
    with pytest.raises(UserInputError, match="--allow_vocab_mismatch"):
        preflight(args, **step3_models)
    args.allow_vocab_mismatch = True
    preflight(args, **step3_models)  # the user asked for it explicitly


def test_damaged_weights_and_file_paths_are_named(tmp_path):
    from utils.model.model_utils import resolve_model_name_or_path
    from utils.preflight import check_causal_lm_path, check_weights_readable

    good = copy_builtin("tiny-opt", tmp_path / "good")
    check_weights_readable("--x", str(good))
    bad = copy_builtin("tiny-opt", tmp_path / "bad", "truncate")
    with pytest.raises(UserInputError, match=r"--model_name_or_path .*bad: model\.safetensors is damaged \("
                                             r"incomplete metadata"):
        check_causal_lm_path("--model_name_or_path", str(bad))
    os.truncate(bad / "model.safetensors", 3)
    with pytest.raises(UserInputError, match="model.safetensors is damaged"):
        check_weights_readable("--x", str(bad))
    with pytest.raises(UserInputError, match=r"is a file, not a model folder"):
        resolve_model_name_or_path(str(good / "config.json"))


def test_sequence_lengths_must_fit_the_position_table():
    from utils.preflight import check_sequence_fits, model_positions
    from utils.model.model_utils import resolve_model_name_or_path

    assert model_positions(resolve_model_name_or_path("tiny-llama")) == 512
    assert model_positions("facebook/opt-1.3b") is None  # a hub name is not read (no network): unknown, accepted
    check_sequence_fits("--model_name_or_path", "tiny-opt", 512, "--max_seq_len")
    with pytest.raises(UserInputError, match=r"--max_seq_len = 513 is longer than the 512 positions of "
                                             r"--model_name_or_path tiny-llama; use at most 512"):
        check_sequence_fits("--model_name_or_path", "tiny-llama", 513, "--max_seq_len")


@pytest.mark.parametrize("flags, message", [
    (["--max_new_tokens", "0"], "--max_new_tokens must be ≥ 1, got 0"),
    (["--do_sample", "--temperature", "0"], "sampling needs --temperature > 0"),
    (["--do_sample", "--top_p", "1.5"], "0 < --top_p ≤ 1"),
    (["--do_sample", "--top_k", "-1"], "--top_k ≥ 0"),
    (["--do_sample", "--temperature", "nan"], "sampling needs --temperature > 0"),
])
def test_chat_flags(flags, message):
    from inference.chatbot import parse_args, validate

    validate(parse_args(["--path", "tiny-opt"]))
    with pytest.raises(UserInputError, match=message):
        validate(parse_args(["--path", "tiny-opt", *flags]))


def test_help_shows_defaults_and_one_deepspeed_group():
    from scripts import gen_readme_tables as gen

    for name, script in gen.ENTRY_POINTS.items():
        parser = gen.load_parser(script)
        text = parser.format_help()
        assert "(default: " in text, name
        titles = [g.title.lower() for g in parser._action_groups]
        assert titles.count("deepspeed") <= 1 and len(titles) == len(set(titles)), (name, titles)
    text = " ".join(gen.load_parser(gen.ENTRY_POINTS["step1"]).format_help().split())
    assert "--learning_rate LEARNING_RATE Initial learning rate (after warm-up). (default: 0.001)" in text


def test_every_prompt_over_the_length_limit_is_a_clear_error(tmp_path):
    from utils.data.data_utils import create_prompt_dataset
    from utils.model.model_utils import load_hf_tokenizer

    rows = [{"prompt": "Human: " + "very " * 40 + f"long question {i}? Assistant:", "chosen": " yes",
             "rejected": " no"} for i in range(20)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserInputError, match=r"long\.jsonl: no usable rows for phase 3"):
        create_prompt_dataset(-1, [str(path)], "2,4,4", str(tmp_path / "data"), 3, 1234, load_hf_tokenizer("tiny-opt"),
                              16)


def test_blank_prompts_and_answers_leave_no_usable_pairs(tmp_path):
    from utils.data.data_utils import create_prompt_dataset
    from utils.model.model_utils import load_hf_tokenizer

    path = tmp_path / "blank.jsonl"
    path.write_text("".join(json.dumps({"prompt": " Human: hi Assistant:", "chosen": "  ", "rejected": ""}) + "\n"
                            for _ in range(20)))
    with pytest.raises(UserInputError, match=r"blank\.jsonl: no usable rows for phase 2"):
        create_prompt_dataset(-1, [str(path)], "0,1,0", str(tmp_path / "data"), 2, 1234, load_hf_tokenizer("tiny-opt"),
                              64)


def test_empty_dataset_name_and_empty_data_path():
    from utils.data.data_utils import create_prompt_dataset
    from utils.data.raw_datasets import get_raw_dataset

    with pytest.raises(UserInputError, match="empty dataset name"):
        get_raw_dataset("  ", "/unused", 1234, -1)
    with pytest.raises(UserInputError, match="--data_path: give at least one dataset"):
        create_prompt_dataset(-1, [], "2,4,4", "/unused", 1, 1234, None, 64)


def test_gpu_out_of_memory_is_one_line_with_the_remedies(capsys):
    # a model too large for the GPU ends in torch.OutOfMemoryError (at load, initialize or the first step)
    from utils.entrypoint import OUT_OF_MEMORY, run_main

    def main(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                     "capacity of 79.19 GiB of which 3.12 GiB is free.")

    with pytest.raises(SystemExit) as stop:
        run_main(main, None)
    assert stop.value.code == OUT_OF_MEMORY == 4
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: out of GPU memory (CUDA out of memory)")
    for remedy in ("--per_device_", "ZeRO stage", "--offload", "--gradient_checkpointing", "--only_optimize_lora"):
        assert remedy in err


@pytest.mark.slow
def test_a_last_update_that_leaves_nan_weights_saves_nothing(tmp_path):
    """--learning_rate 1e3: every loss the step checks is finite, the weights after the last update are not;
    exit 3 (diverged), one error line, no model in --output_dir."""
    from tests.conftest import run_entry

    out = tmp_path / "out"
    proc = run_entry(STEP1, *TINY, "--learning_rate", "1e3", "--max_steps", "3", "--output_dir", out,
                     "--data_output_path", tmp_path / "data", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: non-finite weights in the model (first: " in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))


def test_a_bin_model_that_would_run_code_is_refused_in_one_line(tmp_path):
    """A model folder whose pytorch_model.bin is a pickle payload: one line naming what it would import,
    before transformers gets to it (its weights_only load stops with a traceback); a real .bin passes."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from utils.model.tiny import resolve_model_path
    from utils.preflight import check_causal_lm_path

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny-opt"), folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    os.remove(folder / "model.safetensors")
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    check_causal_lm_path("--model_name_or_path", str(folder))  # plain weights: fine
    marker = tmp_path / "payload-ran"
    torch.save({"x": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(UserInputError, match=r"pytorch_model.bin would import (posix|os)\.system when loaded, which "
                                             r"can run code; not loading it"):
        check_causal_lm_path("--model_name_or_path", str(folder))
    assert not marker.exists()


@pytest.fixture
def small_disk(tmp_path):
    """``mount(size, read_only=False)``: a real tmpfs of ``size`` (e.g. "12k") under tmp_path, unmounted afterwards
    (read-only even for root with ``read_only``); the test is
    skipped where mounting is not allowed (not root, no privilege)."""
    mounted = []

    def mount(size, read_only=False):
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip() or res.returncode})")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("full", ["data_output_path", "output_dir"])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, small_disk, full):
    """A real full disk (a small tmpfs): while writing the data split index and cache, or the model. One
    error line, exit 2, no temporary file or folder left on the full disk."""
    from tests.conftest import run_entry

    disk = small_disk("12k" if full == "data_output_path" else "40k")
    data = disk / "data" if full == "data_output_path" else tmp_path / "data"
    out = tmp_path / "out" if full == "data_output_path" else disk / "out"
    res = run_entry(STEP1, *TINY, "--max_steps", "2", "--output_dir", out, "--data_output_path", data,
                    env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if "error: " in line]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in res.stderr
    left = [str(p) for p in disk.rglob("*") if ".tmp" in p.name]
    assert not left, left
    assert not (out / "config.json").exists()


READ_ONLY_CASES = {  # name: (entry point, arguments with {ro} on the read-only disk and {rw} beside it, flag named)
    "step1_output_dir": (STEP1, [*TINY, "--output_dir", "{ro}/out", "--data_output_path", "{rw}/data"],
                         "--output_dir"),
    "step1_data_output_path": (STEP1, [*TINY, "--output_dir", "{rw}/out", "--data_output_path", "{ro}/data"],
                               "--data_output_path"),
    "step1_tensorboard_path": (STEP1, [*TINY, "--output_dir", "{rw}/out", "--data_output_path", "{rw}/data",
                                       "--enable_tensorboard", "--tensorboard_path", "{ro}/tb"], "--tensorboard_path"),
    "step3_grpo_output_dir": (STEP3, [*GRPO, "--reward_fn", "builtin_rule", "--output_dir", "{ro}/out",
                               "--data_output_path", "{rw}/data"],
                              "--output_dir"),
    "train_output_dir": (TRAIN, ["--demo", "--output-dir", "{ro}/out"], "--output-dir"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(READ_ONLY_CASES))
def test_a_read_only_file_system_is_one_line_before_anything_runs(tmp_path, small_disk, name):
    """Issue 25, rule 8, on a real read-only mount (which root cannot write either, unlike a folder whose
    permission bits say so): one error line naming the flag, exit 2, nothing written beside it."""
    from tests.conftest import run_entry

    script, args, flag = READ_ONLY_CASES[name]
    ro, rw = small_disk("1m", read_only=True), tmp_path / "rw"
    res = run_entry(script, *[a.format(ro=ro, rw=rw) for a in args], env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if "error: " in line]
    assert len(lines) == 1 and f"{flag} {ro}" in lines[0] and "Read-only file system" in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not rw.exists()
