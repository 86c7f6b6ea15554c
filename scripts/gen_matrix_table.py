#!/usr/bin/env python
"""Render docs/zero_matrix.md: which ZeRO stage × offload × LoRA × dtype combinations each step accepts.

    .venv/bin/python scripts/gen_matrix_table.py                 # re-render (keeps the recorded sweep)
    .venv/bin/python scripts/gen_matrix_table.py --verify        # run every cell with 2 CPU ranks, record, render
    .venv/bin/python scripts/gen_matrix_table.py --verify --steps step1 --missing-only

The expected outcome of every cell comes from :mod:`utils.compat` (the rules each
step checks up front); the "T" marks come from ``utils.compat.TWO_RANK_CELLS`` (the cells
``tests/test_multiproc.py`` runs with 2 ranks). ``--verify`` launches each cell as a real 2-rank run
(``deepspeed --num_gpus 2``, one optimizer step, tiny model) and records what it saw
(works / refused by which rule / crashed) inside the document (an HTML comment), so a
later plain re-render keeps it. The whole sweep takes about an hour on 2 CPU cores;
results are saved after every run, so it can be stopped and resumed
(``--missing-only``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
from utils.compat import (DTYPES, LORA, OFFLOAD, RULES, STEPS, TWO_RANK_CELLS, ZERO_STAGES, Combination,
                          all_combinations, expected_outcome)
from utils.launch import deepspeed_launcher, free_port

DOC = os.path.join(REPO, "docs", "zero_matrix.md")
SWEEP_MARK = "sweep-results"
STEP_TITLES = {
    "step1": "Step 1: supervised fine-tuning",
    "step2_rm": "Step 2: reward model",
    "step2_dpo": "Step 2 (alternative): DPO",
    "step3": "Step 3: PPO (actor and critic at the same stage / LoRA; EMA on)",
}
RULE_LETTERS = {rule.rule_id: chr(ord("A") + i) for i, rule in enumerate(RULES)}

# ----------------------------------------------------------------------------- the sweep

# One optimizer step on the tiny model: what every sweep run shares, per step.
QUICK = ["--data_path", "builtin/preference-small", "--max_steps", "1", "--seed", "1234"]
STEP_ARGS = {
    "step1": ["--model_name_or_path", "tiny-opt", "--per_device_train_batch_size", "4",
              "--per_device_eval_batch_size", "8", "--max_seq_len", "32"],
    "step2_rm": ["--model_name_or_path", "tiny-opt", "--per_device_train_batch_size", "4",
                 "--per_device_eval_batch_size", "8", "--max_seq_len", "32", "--eval_iters", "1"],
    "step2_dpo": ["--model_name_or_path", "tiny-opt", "--per_device_train_batch_size", "4",
                  "--per_device_eval_batch_size", "8", "--max_seq_len", "32", "--eval_iters", "1"],
    "step3": ["--actor_model_name_or_path", "{actor}", "--critic_model_name_or_path", "{critic}",
              "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
              "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8", "--num_warmup_steps", "0",
              "--enable_ema"],
}


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    env.setdefault("DSCHAT_HOME", os.path.join(REPO, ".cache", "dschat"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch(script: str, args: list, ranks: int, timeout: int) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus 2 script args`` (plain ``python`` for one rank); never raises on failure."""
    if ranks == 1:
        cmd = [sys.executable, os.path.join(REPO, script)]
    else:
        cmd = [deepspeed_launcher(), "--num_gpus", str(ranks), "--master_port", str(free_port()),
               os.path.join(REPO, script)]
    try:
        return subprocess.run(cmd + [str(a) for a in args], cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        def text(out):
            return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
        return subprocess.CompletedProcess(e.cmd, 124, text(e.stdout), text(e.stderr) + "\nTIMEOUT")


def classify(proc: subprocess.CompletedProcess) -> tuple:
    """``(outcome, detail)``: works / refused:<rule id> / refused:other / crash, with the telling line."""
    text = (proc.stdout or "") + "\n" + (proc.stderr or "")
    # "error: ..." lines (two ranks' lines can run together: keep the first message only)
    errors = ["error: " + line.split("error: ")[1].strip() for line in text.splitlines() if line.startswith("error: ")]
    if proc.returncode == 0:
        return "works", ""
    if errors:
        for rule in RULES:
            if rule.message.split("{")[0][:60] in errors[0]:
                return f"refused:{rule.rule_id}", errors[0][:300]
        return "refused:other", errors[0][:300]
    lines = [line.strip() for line in text.splitlines()
             if re.search(r"(Error|Exception|TIMEOUT)\b", line) and "Warning" not in line]
    return "crash", (lines[-1] if lines else f"exit code {proc.returncode}")[:300]


def prepare_inputs(work: str) -> dict:
    """A step-1 actor and a step-2 critic (one rank, ZeRO 0) for the step-3 cells."""
    out = {"actor": os.path.join(work, "actor"), "critic": os.path.join(work, "critic")}
    for step, key in (("step1", "actor"), ("step2_rm", "critic")):
        if os.path.isfile(os.path.join(out[key], "config.json")):
            continue
        proc = launch(STEPS[step], STEP_ARGS[step] + QUICK + ["--data_output_path", os.path.join(work, "data"),
                                                              "--output_dir", out[key]], ranks=1, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"preparing the step-3 inputs: {step} failed:\n{proc.stderr[-3000:]}")
    return out


def run_cell(combo: Combination, work: str, inputs: dict, timeout: int) -> dict:
    args = [a.format(**inputs) for a in STEP_ARGS[combo.step]] + QUICK + combo.flags()
    out_dir = os.path.join(work, "out", combo.key.replace("|", "_"))
    args += ["--data_output_path", os.path.join(work, f"data_{combo.step}"), "--output_dir", out_dir,
             "--overwrite"]  # a reused --work folder holds the previous verification's models
    start = time.time()
    proc = launch(STEPS[combo.step], args, ranks=2, timeout=timeout)
    outcome, detail = classify(proc)
    if outcome == "crash":
        with open(os.path.join(work, combo.key.replace("|", "_") + ".log"), "w") as f:
            f.write(proc.stdout + "\n----- stderr\n" + proc.stderr)
    return {"observed": outcome, "detail": detail, "seconds": round(time.time() - start, 1)}


# ----------------------------------------------------------------------------- the document

def tested_cells() -> dict:
    """key → test name of the cells ``tests/test_multiproc.py`` runs with 2 ranks (``utils.compat.TWO_RANK_CELLS``)."""
    return {combo.key: test for combo, test in TWO_RANK_CELLS.items()}


def read_sweep(path: str = DOC) -> dict:
    """The sweep record embedded in an existing document ({} when none)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        text = f.read()
    found = re.search(rf"<!-- {SWEEP_MARK}\n(.*?)\n-->", text, re.S)
    return json.loads(found.group(1)) if found else {}


def _cell(combo: Combination, tested: dict, sweep: dict) -> str:
    expected = expected_outcome(combo)
    text = "works" if expected == "works" else f"refused ({RULE_LETTERS[expected.split(':', 1)[1]]})"
    seen = sweep.get("cells", {}).get(combo.key)
    if seen is not None:
        text += " ✓" if seen["observed"] == expected else " ✗"
    if combo.key in tested:
        text += " T"
    return text


def step_tables(tested: dict, sweep: dict, heading: str) -> list:
    """One table per step (rows: stage × offload; columns: LoRA × dtype), then the refusal reasons."""
    lines = []
    columns = [(lora, dtype) for lora in LORA for dtype in DTYPES]
    header = "| ZeRO | offload | " + " | ".join(f"{d}{' + LoRA' if lora else ''}" for lora, d in columns) + " |"
    for step, script in STEPS.items():
        lines += [f"{heading} {STEP_TITLES[step]} (`{script}`)", "", header,
                  "|" + "---|" * (len(columns) + 2)]
        for stage in ZERO_STAGES:
            for offload in OFFLOAD:
                row = [_cell(Combination(step, stage, offload, lora, dtype), tested, sweep) for lora, dtype in columns]
                lines.append(f"| {stage} | {'on' if offload else 'off'} | " + " | ".join(row) + " |")
        lines.append("")
    lines += [f"{heading} Reasons", ""]
    for rule in RULES:
        message = rule.message.format(stage_flag="--zero_stage", stage=0, accelerator="cpu")
        lines.append(f"- **{RULE_LETTERS[rule.rule_id]}** (`{rule.rule_id}`): {message}")
    lines.append("")
    return lines


README = os.path.join(REPO, "docs", "running.md")  # the page that holds the matrix section
README_START = "<!-- zero-matrix:start (generated by scripts/gen_matrix_table.py; do not edit by hand) -->"
README_END = "<!-- zero-matrix:end -->"


def render_readme_section(tested: dict, sweep: dict) -> str:
    """docs/running.md's copy of the matrix (between its markers): legend, the step tables, the reasons."""
    cells = sweep.get("cells", {})
    every = list(all_combinations())
    seen = [c for c in every if c.key in cells]
    agree = [c for c in seen if cells[c.key]["observed"] == expected_outcome(c)]
    lines = [README_START, "",
             f"CPU ranks (gloo); on a GPU the fp16 cells follow their fp32 neighbours. The outcome of each cell is "
             f"the rule table in `utils/compat.py`; **✓** means a real 2-rank run "
             f"(`scripts/gen_matrix_table.py --verify`) saw exactly that ({len(agree)} of {len(seen)} run cells "
             f"agree), **T** that `tests/test_multiproc.py` runs it with 2 ranks in CI. Details, launcher notes: "
             f"[docs/zero_matrix.md](zero_matrix.md).", ""]
    lines += step_tables(tested, sweep, "####")
    return "\n".join(lines + [README_END])


def update_readme(tested: dict, sweep: dict, path: str = README) -> None:
    with open(path) as f:
        text = f.read()
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    with open(path, "w") as f:
        f.write(text[:start] + render_readme_section(tested, sweep) + text[end:])


def render(tested: dict, sweep: dict) -> str:
    """The whole markdown document (deterministic: same table, tests and sweep → same text)."""
    cells = sweep.get("cells", {})
    every = list(all_combinations())
    seen = [c for c in every if c.key in cells]
    agree = [c for c in seen if cells[c.key]["observed"] == expected_outcome(c)]
    lines = [
        "# ZeRO matrix: which combinations each step accepts",
        "",
        "<!-- generated by scripts/gen_matrix_table.py from utils/compat.py; do not edit by hand -->",
        "",
        "Every step checks its ZeRO stage / `--offload` / LoRA / `--dtype` combination up front "
        "(`utils/compat.py: check_zero_combination`, called by each `main.py` right after its argument "
        "checks): a combination that cannot run is refused with exit code 2 and one `error: ...` line "
        "instead of a crash inside DeepSpeed. The table is for **CPU** ranks (DeepSpeed's CPU accelerator, "
        "gloo); on a GPU the fp16 cells follow their fp32 neighbours.",
        "",
    ]
    if seen:
        lines += [
            f"**Verified:** `scripts/gen_matrix_table.py --verify` ran {len(seen)} of the {len(every)} cells as "
            f"real 2-rank runs (`deepspeed --num_gpus 2`, tiny-opt, one optimizer step, step 3 with EMA; "
            f"{sweep.get('versions', '')}, {sweep.get('date', '')}): {len(agree)} behaved exactly as the table "
            "says.",
            "",
        ]
    lines += [
        "Legend: **works**: trains, evaluates and saves a model that loads; **refused (X)**: exits 2 before "
        "DeepSpeed starts, reason X below; **✓** / **✗**: the 2-rank sweep saw / did not see exactly this; "
        "**T**: also run with 2 ranks by `tests/test_multiproc.py` (which checks the saved shapes against "
        "one rank).",
        "",
    ]
    lines += step_tables(tested, sweep, "##")
    wrong = [c for c in seen if cells[c.key]["observed"] != expected_outcome(c)]
    if wrong:
        lines += ["## Cells the sweep saw differently", "", "| cell | expected | observed | detail |",
                  "|---|---|---|---|"]
        lines += [f"| `{c.key}` | {expected_outcome(c)} | {cells[c.key]['observed']} | "
                  f"{cells[c.key]['detail'].replace('|', '/')} |" for c in wrong]
        lines.append("")
    lines += LAUNCH_NOTES
    record = {"date": sweep.get("date", ""), "versions": sweep.get("versions", ""),
              "cells": {k: cells[k] for k in sorted(cells)}}
    lines += ["", f"<!-- {SWEEP_MARK}", json.dumps(record, indent=0, sort_keys=True, ensure_ascii=False), "-->", ""]
    return "\n".join(lines)


LAUNCH_NOTES = [
    "## Running with several ranks on CPU",
    "",
    "- `deepspeed --num_gpus 2 main.py ...` works without GPUs: `--num_gpus N` sets the slot count "
    "directly (`--num_nodes 1 --num_gpus 2` too). `--include localhost:0,1` fails with "
    "`No slot '1' specified on host 'localhost'`, because the CPU accelerator counts NUMA nodes as devices "
    "(1 here) unless `LOCAL_SIZE=2` is set.",
    "- `torchrun --standalone --nproc_per_node 2 main.py ...` works as well (the steps read "
    "`RANK`/`LOCAL_RANK`/`WORLD_SIZE` from the environment).",
    "- Set `OMP_NUM_THREADS` to at most cores ÷ ranks (1 on a 2-core machine): ranks whose threads outnumber "
    "the free cores spin-wait on each other; on a busy 2-core machine one rank with 2 threads trained step 1 "
    "36× slower than with 1 thread (`bench/bench_scaling.py`).",
    "- The global batch is micro batch × ranks × gradient accumulation (`utils/ds_utils.py: set_batch_sizes`), "
    "so 2 ranks take half as many optimizer steps per epoch as 1; evaluation metrics (perplexity, reward-model "
    "accuracy and scores, DPO statistics, step-3 average reward) are all-reduced, so every rank reports the "
    "numbers of the whole eval set; only global rank 0 prints, writes `metrics.jsonl`/tensorboard and saves.",
    "- The tokenised-data cache is built once per node: local rank 0 builds it (files written to a "
    "temporary name and renamed), the others wait at a barrier and then read it.",
    "- ZeRO-3 saving gathers the partitioned weights (`save_hf_format` / `save_reward_model`): the saved "
    "model has full shapes and loads with plain `from_pretrained`. Step 3 under ZeRO-3 gathers the actor's "
    "weights once per rollout into a whole-weight copy that each rank generates from on its own (freed after the "
    "rollout); only when that copy would not fit in memory does it generate with `synced_gpus=True`, so ranks "
    "whose answers end early keep joining the other ranks' forward passes.",
    "- `--offload` on a CPU-only machine moves nothing (everything already lives in CPU memory) but switches "
    "the optimizer to DeepSpeedCPUAdam, which is compiled on first use (about a minute, cached in "
    "`~/.cache/torch_extensions`).",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", action="store_true", help="Run the cells with 2 CPU ranks and record outcomes.")
    parser.add_argument("--steps", nargs="*", default=list(STEPS), choices=list(STEPS), help="Steps to verify.")
    parser.add_argument("--missing-only", action="store_true", help="Verify only cells the record lacks.")
    parser.add_argument("--work", default=None, help="Scratch folder for the sweep (default: a temp folder).")
    parser.add_argument("--timeout", type=int, default=600, help="Seconds per 2-rank run.")
    parser.add_argument("--output", default=DOC, help="Document to write.")
    args = parser.parse_args(argv)

    sweep = read_sweep(args.output)
    tested = tested_cells()
    if args.verify:
        import deepspeed
        import torch

        work = args.work or tempfile.mkdtemp(prefix="zero_matrix_")
        inputs = prepare_inputs(work) if "step3" in args.steps else {}
        sweep.setdefault("cells", {})
        sweep["versions"] = f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}"
        sweep["date"] = datetime.date.today().isoformat()
        todo = [c for c in all_combinations(tuple(args.steps))
                if not (args.missing_only and c.key in sweep["cells"])]
        for i, combo in enumerate(todo, 1):
            result = run_cell(combo, work, inputs, args.timeout)
            sweep["cells"][combo.key] = result
            mark = "ok " if result["observed"] == expected_outcome(combo) else "MISMATCH"
            print(f"[{i}/{len(todo)}] {mark} {combo.key}: {result['observed']} ({result['seconds']} s) "
                  f"{result['detail'][:160]}", flush=True)
            os.makedirs(os.path.dirname(args.output), exist_ok=True)
            with open(args.output, "w") as f:
                f.write(render(tested, sweep))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(render(tested, sweep))
    update_readme(tested, sweep)
    print(f"wrote {os.path.relpath(args.output, REPO)} and the README's matrix section")


if __name__ == "__main__":
    main()
