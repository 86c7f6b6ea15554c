#!/usr/bin/env python
"""The demo pipeline for several seeds, each against an oracle: does step 3 make the answers better?

    .venv/bin/python bench/bench_demo_seeds.py                      # seeds 1234 7 99, ~10 min on 2 cores
    .venv/bin/python bench/bench_demo_seeds.py --seeds 1234 --work /tmp/seeds

For each seed: ``train.py --demo`` with that ``--seed`` for every stage (step 1, the comparison
collector, step 2, step 3), timed; then two **oracles**, the same step-3 command with a perfect
reward instead of the learned reward model, and the held-out check of their actors: the rule
itself (``--reward_fn builtin_rule``, in [0, 1]) and the labeller the reward model learnt from
(``--reward_fn builtin_preference``, on the reward model's scale: what perfect preferences give). Everything is judged by the held-out check, never by the
reward model (:mod:`utils.heldout`): the rule score of greedy answers and of 8 sampled answers
per prompt, "all four" (the share passing every check), each check, and the reward model's
ranks of independently drawn answers.

Target (issue 21), checked per seed and printed as ok/FAIL: step 3 beats step 1 by ≥ 0.10 rule
score, greedy and sampled; "all four" rises; no check falls by more than 0.02; the chatbot's
answer passes all four checks; the learned reward model reaches ≥ 70 % of the better oracle's gain,
greedy and sampled.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))

SCALE = ("three_good>two_good", "two_good>one_good", "three_good>repeat", "one_good>repeat")
ORACLES = ("builtin_rule", "builtin_preference")


def demo_args(seed: int, work: str) -> list:
    seed_flag = f"--seed {seed}"
    return ["--demo", "--output-dir", work, "--overwrite", "--step1-args", seed_flag, "--step2-args", seed_flag,
            "--step3-args", seed_flag, "--collect-args", seed_flag]


def run_demo(seed: int, work: str, reuse: bool = False) -> dict:
    """``train.py --demo`` for ``seed``: (wall seconds, summary.json, the chatbot's answer); with ``reuse``, an
    earlier run's results in ``work``."""
    saved = os.path.join(work, "bench_demo.json")
    if reuse and os.path.isfile(saved):
        with open(saved) as f:
            return json.load(f)
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *demo_args(seed, work)], cwd=REPO,
                          capture_output=True, text=True)
    wall = time.time() - start
    with open(os.path.join(work, "train.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: train.py --demo failed (exit {proc.returncode}); log: {work}/train.log")
    answers = [line for line in proc.stdout.splitlines() if line.startswith("Assistant:")]
    with open(os.path.join(work, "summary.json")) as f:
        result = {"wall": wall, "summary": json.load(f), "chat": answers[-1][len("Assistant:"):].strip()}
    with open(saved, "w") as f:
        json.dump(result, f)
    return result


def run_oracle(seed: int, work: str, reward_fn: str, reuse: bool = False) -> dict:
    """The demo's step-3 command with ``--reward_fn reward_fn``, then the held-out check of its actor; with
    ``reuse``, an earlier run's results in ``work``."""
    import train
    from utils.heldout import heldout_check

    out = os.path.join(work, f"oracle-{reward_fn}")
    saved = os.path.join(out, "bench_oracle.json")
    if reuse and os.path.isfile(saved):
        with open(saved) as f:
            return json.load(f)
    args = train.parse_args(demo_args(seed, work) + ["--step", "3"])
    cmd = train.make_plan(args, gpus=0)[-1].cmd
    cmd[cmd.index("--output_dir") + 1] = out
    start = time.time()
    proc = subprocess.run(cmd + ["--reward_fn", reward_fn, "--overwrite"], cwd=REPO, capture_output=True, text=True,
                          env=train.child_env(train.DEMO_CPU_THREADS))
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: the oracle's step 3 failed:\n{proc.stderr[-3000:]}")
    wall = time.time() - start
    check = heldout_check({3: os.path.join(out, "actor")}, None, "builtin/demonstrations",
                          train.step3_sampling(args))
    result = {"wall": wall, "actor": check["actors"]["3"]}
    with open(saved, "w") as f:
        json.dump(result, f)
    return result


def scores(actor: dict) -> dict:
    return {"greedy": actor["rule_score"], "sampled": actor["sampled"]["rule_score"],
            "all_four_greedy": actor["all_four"], "all_four_sampled": actor["sampled"]["all_four"],
            "checks_greedy": actor["checks"], "checks_sampled": actor["sampled"]["checks"]}


def verdict(sft: dict, ppo: dict, oracles: dict, chat: str) -> dict:
    """Issue 21's target 1 (and the oracle comparison: against the better oracle) for one seed."""
    from utils.data.rule_score import rule_checks

    falls = [ppo[f"checks_{mode}"][c] - sft[f"checks_{mode}"][c] for mode in ("greedy", "sampled")
             for c in sft[f"checks_{mode}"]]
    out = {"gain_greedy": ppo["greedy"] - sft["greedy"], "gain_sampled": ppo["sampled"] - sft["sampled"],
           "worst_check_change": min(falls), "chat_passes": all(rule_checks(chat, "lamp").values())}
    ok = (out["gain_greedy"] >= 0.10 and out["gain_sampled"] >= 0.10 and out["worst_check_change"] >= -0.02
          and ppo["all_four_greedy"] > sft["all_four_greedy"] and ppo["all_four_sampled"] > sft["all_four_sampled"]
          and out["chat_passes"])
    if oracles:
        for mode in ("greedy", "sampled"):
            gain = max(oracle[mode] for oracle in oracles.values()) - sft[mode]
            out[f"oracle_gain_{mode}"] = gain
            out[f"share_of_oracle_{mode}"] = out[f"gain_{mode}"] / gain if gain > 0 else float("inf")
        ok = ok and min(out["share_of_oracle_greedy"], out["share_of_oracle_sampled"]) >= 0.70
    out["ok"] = ok
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 7, 99])
    parser.add_argument("--work", default=None, help="Output folder (default: a new temporary one).")
    parser.add_argument("--oracles", nargs="*", default=list(ORACLES), help="Reward functions of the oracle runs.")
    parser.add_argument("--reuse", action="store_true", help="Reuse the demo and oracle runs already in --work.")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args(argv)
    import tempfile

    work = args.work or tempfile.mkdtemp(prefix="bench-demo-seeds-")
    results = []
    for seed in args.seeds:
        folder = os.path.join(work, f"seed{seed}")
        print(f"seed {seed}: train.py --demo ...", flush=True)
        demo = run_demo(seed, folder, args.reuse)
        heldout = demo["summary"]["heldout"]
        sft, ppo = scores(heldout["actors"]["1"]), scores(heldout["actors"]["3"])
        oracles = {}
        for reward_fn in args.oracles:
            print(f"seed {seed}: the oracle (step 3 with --reward_fn {reward_fn}) ...", flush=True)
            oracles[reward_fn] = scores(run_oracle(seed, folder, reward_fn, args.reuse)["actor"])
        row = {"seed": seed, "wall": demo["wall"], "sft": sft, "ppo": ppo, "oracles": oracles, "chat": demo["chat"],
               "scale": heldout["reward_model"]["scale"]["ranked"], **verdict(sft, ppo, oracles, demo["chat"])}
        results.append(row)
        print(f"seed {seed}: done in {demo['wall']:.0f}s", flush=True)

    names = " / ".join(args.oracles) or "none"
    print(f"\nheld-out rule score (40 built-in eval prompts; greedy and 8 sampled per prompt), step 1 -> step 3 "
          f"with the learned reward model, and step 3 with the oracle rewards ({names})")
    print("| seed | greedy: SFT -> PPO | oracles | sampled: SFT -> PPO | oracles | all four greedy | all four sampled "
          "| worst check | share of the better oracle's gain (greedy / sampled) | RM scale ranks "
          "(3>2, 2>1, 3>rep, 1>rep) | chatbot | demo wall | target |")
    print("|" + "---|" * 13)
    for r in results:
        share = (f"{r['share_of_oracle_greedy']:.2f} / {r['share_of_oracle_sampled']:.2f}"
                 if "share_of_oracle_greedy" in r else "—")
        scale = ", ".join(f"{r['scale'].get(k, float('nan')):.2f}" for k in SCALE)
        oracle = {mode: " / ".join(f"{o[mode]:.3f}" for o in r["oracles"].values()) or "—"
                  for mode in ("greedy", "sampled")}
        print(f"| {r['seed']} | {r['sft']['greedy']:.3f} -> {r['ppo']['greedy']:.3f} | {oracle['greedy']} "
              f"| {r['sft']['sampled']:.3f} -> {r['ppo']['sampled']:.3f} | {oracle['sampled']} "
              f"| {r['sft']['all_four_greedy']:.3f} -> {r['ppo']['all_four_greedy']:.3f} "
              f"| {r['sft']['all_four_sampled']:.3f} -> {r['ppo']['all_four_sampled']:.3f} "
              f"| {r['worst_check_change']:+.3f} | {share} | {scale} "
              f"| \"{r['chat']}\" | {r['wall'] / 60:.1f} min | {'ok' if r['ok'] else 'FAIL'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\nruns kept in {work}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
