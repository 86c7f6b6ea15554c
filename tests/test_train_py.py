"""train.py: step selection, output layout, launcher commands, refusals and failures; the summary."""
import json
import os
import shlex
import subprocess
import sys

import pytest

import train
from tests.conftest import REPO, run_entry
from utils import summary

SHORT = "--data_path builtin/preference-small --max_seq_len 64 --per_device_train_batch_size 8 --max_steps 3"


def plan_for(argv, gpus=0):
    return train.make_plan(train.parse_args(argv), gpus)


def flag(cmd, name):
    """The value after the LAST occurrence of ``name`` in ``cmd`` (argparse: last wins)."""
    i = len(cmd) - 1 - cmd[::-1].index(name)
    return cmd[i + 1]


# --------------------------------------------------------------------------- planning (no processes)

def test_model_names_map_like_the_reference(tmp_path):
    assert train.parse_model("1.3b") == train.Model("facebook/opt-1.3b", "1.3b", opt_size="1.3b")
    assert train.parse_model("facebook/opt-350m").label == "350m"
    assert train.parse_model("tiny-opt") == train.Model("tiny-opt", "tiny-opt", builtin=True)
    assert train.parse_model("meta-llama/Llama-2-7b-hf").label == "Llama-2-7b-hf"
    local = tmp_path / "my-actor"
    local.mkdir()
    assert train.parse_model(str(local)) == train.Model(str(local), "my-actor")


def test_step_selection_and_output_layout(tmp_path):
    out = str(tmp_path)
    plan = plan_for(["--step", "3", "1", "--actor-model", "1.3b", "--reward-model", "350m", "--output-dir", out,
                     "--actor-zero-stage", "2", "--reward-zero-stage", "3"])
    assert [launch.step.number for launch in plan] == [1, 3]  # sorted, step 2 left out
    s1, s3 = plan
    assert s1.out_dir == f"{out}/actor-models/1.3b" and s3.out_dir == f"{out}/step3-models/1.3b"
    assert flag(s1.cmd, "--model_name_or_path") == "facebook/opt-1.3b"
    assert flag(s1.cmd, "--zero_stage") == "2"
    assert flag(s3.cmd, "--actor_model_name_or_path") == f"{out}/actor-models/1.3b"
    assert flag(s3.cmd, "--critic_model_name_or_path") == f"{out}/reward-models/350m"
    assert (flag(s3.cmd, "--actor_zero_stage"), flag(s3.cmd, "--critic_zero_stage")) == ("2", "3")
    assert s3.needs == [(1, f"{out}/actor-models/1.3b"), (2, f"{out}/reward-models/350m")]
    assert s1.cmd[:2] == [sys.executable, os.path.join(REPO, "step1_supervised_finetuning", "main.py")]  # CPU


def test_launchers_per_deployment_type(tmp_path):
    base = ["--step", "2", "--output-dir", str(tmp_path)]
    single_gpu = plan_for(base, gpus=4)[0].cmd
    assert single_gpu[0].endswith("deepspeed") and flag(single_gpu, "--num_gpus") == "1"
    node = plan_for(base + ["--deployment-type", "single_node"], gpus=4)[0].cmd
    assert flag(node, "--num_gpus") == "4"
    cpu_node = plan_for(base + ["--deployment-type", "single_node"])[0]
    assert cpu_node.cmd[0] == sys.executable and "CPU" in cpu_node.note  # one CPU process by default
    cpu_ranks = plan_for(base + ["--deployment-type", "single_node", "--cpu-ranks", "2"])[0].cmd
    assert cpu_ranks[0].endswith("deepspeed") and flag(cpu_ranks, "--num_gpus") == "2"
    # tiny-opt is OPT-like: its BOS is the pad token
    assert flag(node, "--num_padding_at_beginning") == "1"
    llama = plan_for(base + ["--reward-model", "tiny-llama"])[0].cmd
    assert flag(llama, "--num_padding_at_beginning") == "0"


def test_per_size_script_used_on_gpus_when_present(tmp_path, monkeypatch):
    script = tmp_path / "step1_supervised_finetuning" / "training_scripts" / "opt" / "single_gpu" / "run_1.3b.sh"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/bash\n")
    monkeypatch.setattr(train, "REPO", str(tmp_path))
    argv = ["--step", "1", "--actor-model", "facebook/opt-1.3b", "--output-dir", "/o", "--actor-zero-stage", "1"]
    launch = plan_for(argv, gpus=1)[0]
    assert launch.cmd == ["bash", str(script), "/o/actor-models/1.3b", "1"]
    assert not launch.tee  # the script tees its own training.log
    assert plan_for(argv, gpus=0)[0].cmd[0] == sys.executable  # no GPU: the command line is built instead


def test_pass_through_args_come_last_and_win(tmp_path):
    cmd = plan_for(["--step", "1", "--demo", "--output-dir", str(tmp_path),
                    "--step1-args", "--max_steps 2 --learning_rate 0.5"])[0].cmd
    assert flag(cmd, "--data_path") == "builtin/demonstrations"  # from the demo settings
    assert flag(cmd, "--learning_rate") == "0.5"  # the user's flag overrides the demo's 1e-3
    assert cmd[-4:] == ["--max_steps", "2", "--learning_rate", "0.5"]


@pytest.mark.slow
def test_multi_node_dry_run_prints_hostfile_commands(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    res = run_entry("train.py", "--dry-run", "--deployment-type", "multi_node", "--hostfile", hostfile,
                    "--actor-model", "6.7b", "--reward-model", "350m", "--output-dir", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    commands = [shlex.split(line) for line in res.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == 3
    for n, cmd in zip((1, 2, 3), commands):
        assert cmd[0].endswith("deepspeed") and cmd[1:3] == ["--hostfile", str(hostfile)]
        assert cmd[3] == os.path.join(REPO, train.STEPS[n].folder, "main.py")
    assert flag(commands[1], "--output_dir") == str(tmp_path / "out" / "reward-models" / "350m")
    assert not (tmp_path / "out").exists()  # nothing ran


# --------------------------------------------------------------------------- refusals and failures

@pytest.mark.slow
def test_step3_refuses_before_launching_when_step1_output_is_missing(tmp_path):
    out = tmp_path / "out"
    res = run_entry("train.py", "--step", "3", "--output-dir", out, timeout=120)
    assert res.returncode == 2
    assert str(out / "actor-models" / "tiny-opt") in res.stderr and "step-1" in res.stderr
    assert "Running Step" not in res.stdout and not (out / "step3-models").exists()


@pytest.mark.slow
def test_failing_step_exits_nonzero_naming_step_and_log(tmp_path):
    out = tmp_path / "out"
    res = run_entry("train.py", "--step", "1", "2", "--output-dir", out,
                    "--step1-args", "--data_path nonexistent/set", timeout=300)
    log = out / "actor-models" / "tiny-opt" / "training.log"
    assert res.returncode != 0
    assert "step 1 (supervised fine-tuning (actor)) failed" in res.stderr and str(log) in res.stderr
    assert "nonexistent/set" in log.read_text()  # the step's own error message is kept in its log
    assert "Running Step 2" not in res.stdout  # later steps do not start


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", ["train.py", *[f"{s.folder}/main.py" for s in train.STEPS.values()],
                                         "step2_dpo_finetuning/main.py", "chat.py"])
def test_help_is_offline_and_starts_no_process_group(entry_point):
    if not (REPO / entry_point).exists():
        pytest.skip(f"{entry_point} not in this checkout")
    res = run_entry(entry_point, "--help", env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout and "--help" in res.stdout
    assert "Initializing TorchBackend" not in res.stdout + res.stderr


# --------------------------------------------------------------------------- an end-to-end run

@pytest.mark.smoke
@pytest.mark.slow
def test_steps_1_and_2_end_to_end_layout_and_summary(tmp_path):
    """Steps 1 + 2 for real (step 3's engines cost ~1 min of CPU more; its layout is covered by the plan tests)."""
    out = tmp_path / "out"
    res = run_entry("train.py", "--step", "1", "2", "--output-dir", out, "--step1-args", SHORT,
                    "--step2-args", SHORT, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for folder in (out / "actor-models" / "tiny-opt", out / "reward-models" / "tiny-opt"):
        assert train.has_model(str(folder)), sorted(os.listdir(folder))
        assert "Running training" in (folder / "training.log").read_text()  # the log holds the step's output
        assert (folder / "metrics.jsonl").is_file()
    assert not (out / "step3-models").exists()
    result = json.loads((out / "summary.json").read_text())
    assert set(result["steps"]) == {"1", "2"}
    s1, s2 = result["steps"]["1"], result["steps"]["2"]
    assert s1["optimizer_steps"] == 3 and s2["optimizer_steps"] == 3
    assert s1["perplexity_after"] < s1["perplexity_before"]  # 3 steps at lr 1e-3 already help
    assert 0 <= s2["accuracy_after"] <= 1 and s1["wall_time_s"] > 0
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 SFT (actor)" in res.stdout and "2 reward model" in res.stdout  # the table is printed
    assert f"python chat.py --path {out / 'actor-models' / 'tiny-opt'}" in res.stdout
    heldout = result["heldout"]  # built-in data: the held-out check of the step-1 actor and the reward model
    assert set(heldout["actors"]) == {"1"} and heldout["actors"]["1"]["n"] == 40
    assert 0 <= heldout["actors"]["1"]["rule_score"] <= 1 and len(heldout["actors"]["1"]["samples"]) == 3
    assert heldout["reward_model"]["pairs"] == 400 and "repeated_word" in heldout["reward_model"]["accuracy"]
    scale = heldout["reward_model"]["scale"]
    assert scale["prompts"] == 40 and len(scale["ranked"]) == 4 and all(0 <= v <= 1 for v in scale["ranked"].values())
    assert "held-out check without the reward model" in res.stdout


def test_demo_defaults_to_tiny_llama_and_a_users_model_wins():
    assert (train.parse_args([]).actor.label, train.parse_args([]).reward.label) == ("tiny-opt", "tiny-opt")
    demo = train.parse_args(["--demo"])
    assert (demo.actor.label, demo.reward.label) == ("tiny-llama", "tiny-llama")
    assert train.parse_args(["--demo", "--reward-model", "tiny-opt"]).reward.label == "tiny-opt"


@pytest.mark.slow
def test_demo_reward_model_starts_from_the_step1_actor(tmp_path):
    plan = plan_for(["--demo", "--output-dir", str(tmp_path)])
    actor = str(tmp_path / "actor-models" / "tiny-llama")
    assert flag(plan[2].cmd, "--model_name_or_path") == actor and plan[2].needs == [(1, actor)]
    assert flag(plan_for(["--output-dir", str(tmp_path)])[1].cmd, "--model_name_or_path") == "tiny-opt"
    res = run_entry("train.py", "--demo", "--step", "2", "--output-dir", tmp_path)  # no step-1 actor yet
    assert res.returncode == 2 and "step 2 needs the step-1 model" in res.stderr


def test_demo_collects_comparisons_from_the_step1_actor_for_step2(tmp_path):
    """--demo (or --label-fn) puts the collector between steps 1 and 2; step 2 trains on all its comparisons."""
    plan = plan_for(["--demo", "--output-dir", str(tmp_path)])
    actor, comparisons = str(tmp_path / "actor-models" / "tiny-llama"), str(tmp_path / "comparisons" / "tiny-llama")
    assert [launch.step.script for launch in plan] == ["main.py", "collect_comparisons.py", "main.py", "main.py"]
    collect = plan[1]
    assert collect.cmd[1].endswith("step2_reward_model_finetuning/collect_comparisons.py")
    assert collect.out_dir == comparisons and collect.needs == [(1, actor)]
    assert flag(collect.cmd, "--actor_model_name_or_path") == actor
    assert flag(collect.cmd, "--label_fn") == "builtin_preference"
    assert flag(collect.cmd, "--data_path") == "builtin/demonstrations"  # step 1's data
    assert (flag(plan[2].cmd, "--data_path"), flag(plan[2].cmd, "--data_split")) == (comparisons, "0,1,0")
    # a user's own labeller, without --demo; --collect-args come last
    plan = plan_for(["--label-fn", "my.py:rank", "--collect-args", "--num_answers 6", "--output-dir", str(tmp_path),
                     "--step1-args", "--data_path my.jsonl"])
    assert flag(plan[1].cmd, "--label_fn") == "my.py:rank" and plan[1].cmd[-2:] == ["--num_answers", "6"]
    assert flag(plan[1].cmd, "--data_path") == "my.jsonl"
    no_labeller = plan_for(["--output-dir", str(tmp_path)])
    assert [launch.step.script for launch in no_labeller] == ["main.py"] * 3


def test_held_out_check_runs_only_on_builtin_data():
    assert train.builtin_dataset(train.parse_args(["--demo"])) == "builtin/demonstrations"
    assert train.builtin_dataset(train.parse_args([])) is None
    args = train.parse_args(["--step", "2", "--step2-args", "--data_path local/jsonfile builtin/preference-small"])
    assert train.builtin_dataset(args) == "builtin/preference-small"


def test_held_out_check_samples_as_step3_sampled():
    """The demo samples in step 3 (top-k 5), so the check also scores sampled answers, with step 3's settings."""
    assert train.step3_sampling(train.parse_args(["--demo"])) == {"temperature": 1.0, "top_k": 5, "top_p": 1.0}
    assert train.step3_sampling(train.parse_args(["--demo", "--step3-args", "--top_k 0 --temperature 0.7"])) == \
        {"temperature": 0.7, "top_k": 0, "top_p": 1.0}  # the user's flags win, as in the step's own command
    assert train.step3_sampling(train.parse_args([])) is None  # greedy step 3: greedy answers only
    assert train.step3_sampling(train.parse_args(["--demo", "--step", "1", "2"])) is None  # no step 3 in this run


# --------------------------------------------------------------------------- summary (utils/summary.py)

def write_rows(folder, rows):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write("not json\n")  # a torn last line is skipped


def test_summary_condenses_metrics_and_tolerates_missing_keys(tmp_path):
    write_rows(tmp_path / "s1", [{"step": 0, "phase": "eval", "perplexity": 700.0, "loss": 6.5},
                                 {"step": 1, "phase": "train", "loss": 6.0},
                                 {"step": 2, "phase": "train"},  # no loss at all
                                 {"step": 2, "phase": "eval", "perplexity": 10.0, "loss": 2.3}])
    write_rows(tmp_path / "s2", [{"step": 0, "phase": "eval", "acc": 0.5, "chosen": 0.1, "rejected": 0.2},
                                 {"step": 4, "phase": "eval", "acc": 0.75, "chosen": 1.0, "rejected": -1.0}])
    write_rows(tmp_path / "s3", [{"step": i, "phase": "train", "reward": float(i), "kl": "nan" if i == 7 else 0.01 * i}
                                 for i in range(8)])
    folders = {1: str(tmp_path / "s1"), 2: str(tmp_path / "s2"), 3: str(tmp_path / "s3")}
    result = summary.build_summary(folders, {1: 61.0, 3: 5.0})
    s1, s2, s3 = (result["steps"][k] for k in "123")
    assert (s1["perplexity_before"], s1["perplexity_after"], s1["eval_loss"]) == (700.0, 10.0, 2.3)
    assert s1["final_train_loss"] == 6.0 and s1["wall_time_s"] == 61.0
    assert (s2["accuracy_before"], s2["accuracy_after"], s2["chosen_score"]) == (0.5, 0.75, 1.0)
    assert s2["wall_time_s"] is None and "final_train_loss" not in s2
    # 8 noisy rewards: start/end are means of the first/last 2 (a quarter); "nan" KL values are skipped
    assert (s3["reward_start"], s3["reward_end"]) == (0.5, 6.5)
    assert s3["kl_end"] == pytest.approx(0.06)  # the last finite value: the last step's, as step 3 logs it
    table = summary.format_table(result)
    assert "0:01:01" in table and "eval ppl 700.0 -> 10.00" in table
    assert "reward 0.500 -> 6.500, KL at the last step 0.0600" in table
    text = summary.write_summary(str(tmp_path / "out"), folders, {1: 61.0})
    assert (tmp_path / "out" / "training_curves.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"]["1"]["wall_time_s"] == 61.0
    assert "summary.json" in text


HELDOUT = {"prompts": 40, "max_new_tokens": 32,
           "actors": {"1": {"rule_score": 0.5, "all_four": 0.25, "mean_words": 9.5, "n": 40,
                            "checks": {"names_object": 0.5, "only_good": 0.25, "no_repeat": 0.75, "well_formed": 0.5},
                            "samples": [{"prompt": "Human: Describe the lamp. Assistant:",
                                         "answer": "The lamp is dull and kind and kind."}]},
                      "3": {"rule_score": 1.0, "all_four": 1.0, "mean_words": 8.0, "n": 40,
                            "checks": {"names_object": 1.0, "only_good": 1.0, "no_repeat": 1.0, "well_formed": 1.0},
                            "samples": [{"prompt": "Human: Describe the lamp. Assistant:",
                                         "answer": "The lamp is bright and kind and calm."}]}},
           "reward_model": {"pairs": 400, "accuracy": {"overall": 0.95, "fewer_good": 0.98, "repeated_word": 0.9},
                            "scale": {"prompts": 40, "per_class": 8,
                                      "ranked": {"three_good>repeat": 0.75, "one_good>repeat": 0.125}}}}


def test_summary_shows_the_held_out_check(tmp_path):
    folders = {n: str(tmp_path / f"missing{n}") for n in (1, 2, 3)}
    text = summary.write_summary(str(tmp_path / "out"), folders, {}, HELDOUT)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["heldout"] == HELDOUT
    lines = text.splitlines()
    assert any(line.split()[:7] == ["1", "SFT", "actor", "greedy", "0.500", "0.500", "0.250"] for line in lines), text
    assert any(line.split()[:5] == ["3", "PPO", "actor", "greedy", "1.000"] and line.split()[-1] == "8.0"
               for line in lines)
    assert "sampled" not in text  # step 3 ran greedy: no sampled rows
    assert "3 PPO actor, greedy: Human: Describe the lamp. Assistant: The lamp is bright and kind and calm." in text
    assert "accuracy 0.950 (per rejected kind: fewer_good 0.980, repeated_word 0.900)" in text
    assert ("reward model on answers drawn independently for the same prompt (8 per kind and prompt), share ranked "
            "as the rules rank them: three good > repeat 0.750, one good > repeat 0.125") in text
    assert (tmp_path / "out" / "training_curves.png").stat().st_size > 10_000
    assert "held-out" not in summary.write_summary(str(tmp_path / "out2"), folders, {})  # no check, no block


def test_summary_shows_sampled_answers_below_the_greedy_ones(tmp_path):
    sampled = {"rule_score": 0.75, "all_four": 0.5, "mean_words": 8.5, "n": 320,
               "checks": {"names_object": 1.0, "only_good": 0.5, "no_repeat": 0.625, "well_formed": 0.875}}
    heldout = {**HELDOUT, "sampling": {"temperature": 1.0, "top_k": 5, "top_p": 1.0, "per_prompt": 8, "seed": 1234},
               "actors": {"1": HELDOUT["actors"]["1"], "3": {**HELDOUT["actors"]["3"], "sampled": sampled}}}
    folders = {n: str(tmp_path / f"missing{n}") for n in (1, 2, 3)}
    lines = summary.write_summary(str(tmp_path / "out"), folders, {}, heldout).splitlines()
    rows = [line.split() for line in lines if line.split()[1:3] in (["SFT", "actor"], ["PPO", "actor"])]
    assert [r[:5] for r in rows] == [["1", "SFT", "actor", "greedy", "0.500"], ["3", "PPO", "actor", "greedy", "1.000"],
                                     ["1", "SFT", "actor", "8", "sampled"], ["3", "PPO", "actor", "8", "sampled"]]
    assert rows[2][5:] == ["-"] * 7  # the step-1 actor has no sampled report here: dashes, not zeros
    assert rows[3][5:] == ["0.750", "1.000", "0.500", "0.625", "0.875", "0.500", "8.5"]
    assert any("8 answers per prompt sampled with step 3's settings (temperature 1, top_k 5, top_p 1; seed 1234)" in line
               for line in lines)


def test_summary_of_empty_folders_still_draws(tmp_path):
    folders = {n: str(tmp_path / f"missing{n}") for n in (1, 2, 3)}
    result = summary.build_summary(folders, {})
    assert result["steps"] == {} and result["total_wall_time_s"] is None
    assert os.path.isfile(summary.plot_curves(folders, str(tmp_path / "c.png")))


@pytest.mark.slow
def test_train_py_runs_outside_the_repo_directory(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "train.py"), "--dry-run", "--step", "1", "--output-dir", "o"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and str(tmp_path / "o" / "actor-models" / "tiny-opt") in res.stdout


@pytest.mark.parametrize("extra, message", [
    (["--step3-args", "--nonsense 3"],
     "error: step 3 (RLHF with PPO) would refuse its flags: unrecognized arguments: --nonsense 3 (check --step3-args)"),
    (["--step2-args", "--learning_rate abc"],
     "error: step 2 (reward model) would refuse its flags: argument --learning_rate: invalid float value: 'abc'"),
    (["--collect-args", "--num_answers x"], "error: step 2 (comparisons of the step-1 actor's answers) would refuse "
                                            "its flags: argument --num_answers: invalid int value: 'x'"),
    (["--label-fn", "{tmp}/nope.py:f"], "error: --label-fn {tmp}/nope.py:f: no such file {tmp}/nope.py"),
    (["--step3-args", "--advantage_estimator grpo --n_samples_per_prompt 2 --reward_fn {tmp}/labels.py:missing"],
     "error: --reward_fn (in --step3-args) {tmp}/labels.py:missing: {tmp}/labels.py defines no 'missing'"),
    # flags each step's parser takes but its own checks refuse (issue 32: steps 1 and 2 used to train first)
    (["--step3-args", "--advantage_estimator grpo"],
     "error: step 3 (RLHF with GRPO) would refuse its flags: --advantage_estimator grpo compares the answers of one "
     "prompt: it needs --n_samples_per_prompt ≥ 2 (got 1)"),
    (["--step3-args", "--advantage_estimator grpo --n_samples_per_prompt 2 --dynamic_sampling_max_batches 3"],
     "error: step 3 (RLHF with GRPO) would refuse its flags: --dynamic_sampling_max_batches needs --dynamic_sampling "
     "(check --step3-args)"),
    (["--step3-args", "--cliprange_high -1"],
     "error: step 3 (RLHF with PPO) would refuse its flags: --cliprange_high must be a finite number ≥ 0, got -1.0"),
])
def test_a_later_steps_bad_flags_are_refused_before_step_1_runs(tmp_path, monkeypatch, capsys, extra, message):
    """Issue 25: a typo in --step3-args used to surface only after steps 1 and 2 had trained (minutes on the
    demo, hours on real models); every planned step's flags now go through that step's own parser first."""
    (tmp_path / "labels.py").write_text("def score(prompts, answers, rows):\n    return [0.0] * len(answers)\n")
    monkeypatch.setattr(train, "run_step", lambda *a, **k: pytest.fail("a step was launched"))
    argv = ["--demo", "--output-dir", str(tmp_path / "out"), *[a.format(tmp=tmp_path) for a in extra]]
    assert train.main(train.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and err.strip().endswith("nothing was run"), err
    assert not (tmp_path / "out" / "actor-models").exists()


def test_an_unbalanced_quote_in_a_step_args_string_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--step1-args", "--data_path 'my data"])
    assert exit_info.value.code == 2
    assert "error: --step1-args \"--data_path 'my data\": No closing quotation" in capsys.readouterr().err


@pytest.mark.parametrize("step3_args, title", [
    ("", "PPO"),
    ("--advantage_estimator group_norm --n_samples_per_prompt 2", "GRPO"),
    ("--advantage_estimator rloo --n_samples_per_prompt 2 --policy_loss gspo", "RLOO with GSPO's loss"),
    ("--policy_loss cispo", "PPO with CISPO's loss"),
])
def test_a_critic_free_run_is_not_called_ppo(tmp_path, step3_args, title):
    """train.py's step name and the summary name step 3 by its algorithm (its flags' estimator and policy loss)."""
    plan = plan_for(["--demo", "--step", "3", "--step3-args", step3_args, "--output-dir", str(tmp_path)])
    assert plan[0].step.title == f"RLHF with {title}" and plan[0].step.number == 3
    assert train.STEPS[3].title == "RLHF with PPO"  # the table itself is left alone
    folders = {n: str(tmp_path / f"missing{n}") for n in (1, 2, 3)}
    write_rows(tmp_path / "s3", [{"step": 1, "phase": "train", "reward": 0.5}])
    text = summary.write_summary(str(tmp_path / "out"), {**folders, 3: str(tmp_path / "s3")}, {3: 5.0}, HELDOUT,
                                 train.step3_title(shlex.split(step3_args)))
    assert f"3 {title} (RLHF)" in text and f"3 {title} actor, greedy:" in text
    assert ("PPO" in text) == ("PPO" in title)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["step3_algorithm"] == title


def test_a_per_size_scripts_step_3_is_not_judged_without_the_scripts_own_flags(tmp_path):
    """step3/.../run_1.3b.sh adds --actor_lora_dim 128 itself: train.py cannot know it, so step 3's flag checks
    (which would refuse --only_optimize_lora without a LoRA rank) run only on commands it builds; the parser still
    runs."""
    argv = ["--step", "3", "--actor-model", "facebook/opt-1.3b", "--reward-model", "facebook/opt-350m",
            "--output-dir", str(tmp_path), "--step3-args=--only_optimize_lora"]
    args = train.parse_args(argv)
    on_gpu = train.make_plan(args, 1)
    assert on_gpu[0].size_script
    train.check_step_flags(args, on_gpu)
    with pytest.raises(train.PlanError, match="--only_optimize_lora needs --actor_lora_dim > 0"):
        train.check_step_flags(args, train.make_plan(args, 0))  # the command train.py builds is known in full
    with pytest.raises(train.PlanError, match="unrecognized arguments: --nonsense"):
        args = train.parse_args(argv[:-1] + ["--step3-args=--nonsense"])
        train.check_step_flags(args, train.make_plan(args, 1))


@pytest.mark.parametrize("extra, message", [
    # the built-in demo data has no reference answers, no IFEval instructions
    (["--step3-args", "--advantage_estimator grpo --n_samples_per_prompt 2 --reward_fn gsm8k"],
     "error: step 3 (RLHF with GRPO) would refuse its data: --reward_fn gsm8k: "),
    (["--step3-args", "--advantage_estimator grpo --n_samples_per_prompt 2 --reward_fn ifeval"],
     "error: step 3 (RLHF with GRPO) would refuse its data: --reward_fn ifeval: "),
    (["--label-fn", "gsm8k"],
     "error: step 2 (comparisons of the step-1 actor's answers) would refuse its data: --label_fn gsm8k: "),
    # more prompts a round than the phase-3 share holds, before any length filter
    (["--step3-args", "--per_device_generation_batch_size 100000"],
     "error: step 3 (RLHF with PPO) would refuse its data: --data_path builtin/"),
])
def test_a_later_steps_data_that_it_would_refuse_is_refused_before_step_1(tmp_path, monkeypatch, capsys, extra,
                                                                           message):
    """Issue 57, rule 5: a built-in reward or labelling function whose columns the data lack used to be found by
    step 3 (or the collector) only after step 1 had trained."""
    monkeypatch.setattr(train, "run_step", lambda *a, **k: pytest.fail("a step was launched"))
    argv = ["--demo", "--output-dir", str(tmp_path / "out"), *extra]
    assert train.main(train.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().endswith("nothing was run"), err
    assert not (tmp_path / "out" / "actor-models").exists()


def test_a_hub_dataset_is_left_to_the_steps(monkeypatch, tmp_path):
    """The data check reads local and built-in data only: a hub name is fetched by step 1 first."""
    from utils.data.raw_datasets import from_hub

    assert from_hub("Dahoas/rm-static") and not from_hub("builtin/preference-small")
    assert not from_hub(str(tmp_path)) and not from_hub("local/jsonfile")


def test_the_demos_own_flags_pass_every_steps_parser(tmp_path):
    """The check above must not refuse a good plan: the demo's, and DeepSpeed-Chat's OPT plan."""
    for argv in (["--demo"], ["--demo", "--step3-args", "--advantage_estimator rloo --n_samples_per_prompt 4 "
                                                         "--reward_fn builtin_rule"], []):
        args = train.parse_args([*argv, "--output-dir", str(tmp_path / "out")])
        train.check_step_flags(args, train.make_plan(args, 0))
