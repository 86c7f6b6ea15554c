#!/usr/bin/env python
"""``--enable_hybrid_engine`` across actors, ZeRO stages and LoRA: does step 3 run, how does it generate,
and are the greedy answers the same as without the flag?

    python3 bench/bench_hybrid_engine.py                                  # tiny-opt + tiny-llama, all cells
    python3 bench/bench_hybrid_engine.py --actors tiny-llama --stages 0 2 --jobs 4

For each cell (actor × ZeRO stage × LoRA rank) step 3 runs twice on the built-in prompts,
with and without ``--enable_hybrid_engine``: one greedy PPO step (``--max_steps 1
--print_answers``), same seed, the actor also as the critic's backbone (a fresh step-2
folder made by ``bench_step3.make_critic``). Both runs answer the same prompts with the
same untrained actor, so their first answers must be identical. The table gives each
cell's exit codes, the generation path step 3 chose with the flag (its
``generation: ...`` log line: DeepSpeed's hybrid engine where DeepSpeed has an inference
policy for the actor's layers, else the project's own backend) and whether the answers
match. ``--dtype`` is left to step 3 (bf16 on a GPU, fp32 on a CPU). Cells run ``--jobs`` at a time.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
LORA_MODULES = {"tiny-opt": "decoder.layers.", "tiny-llama": "layers.", "small-opt": "decoder.layers."}


def run_cell(name: str, actor: str, critic: str, stage: int, lora: int, hybrid: bool, work: str) -> dict:
    """One step-3 run of the built-in model ``name``; its exit code, generation path, first answers, wall time."""
    out = os.path.join(work, f"{name}-z{stage}-lora{lora}-{'he' if hybrid else 'plain'}")
    cmd = [sys.executable, os.path.join(REPO, "step3_rlhf_finetuning/main.py"),
           "--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic,
           "--data_path", "builtin/preference-small", "--data_output_path", os.path.join(out, "data"),
           "--output_dir", out, "--max_steps", "1", "--num_warmup_steps", "0", "--print_answers",
           "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
           "--max_prompt_seq_len", "16", "--max_answer_seq_len", "16", "--seed", "1234",
           "--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage),
           "--actor_lora_dim", str(lora), *(["--actor_lora_module_name", LORA_MODULES[name]] if lora else []),
           *(["--enable_hybrid_engine"] if hybrid else [])]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    with open(out + ".log", "w") as f:
        f.write(log)
    path = re.search(r"generation: (.+)", log)
    answers = re.search(r"--- ans    --> step=\d+, (.+)", log)
    error = [line for line in log.splitlines() if line.startswith(("error:", "Traceback")) or "Error" in line]
    return {"code": proc.returncode, "path": path.group(1).strip() if path else None,
            "answers": answers.group(1) if answers else None, "wall": time.time() - start,
            "error": error[-1][:120] if error else "", "log": out + ".log"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", nargs="+", default=["tiny-opt", "tiny-llama"], choices=sorted(LORA_MODULES))
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--lora", nargs="+", type=int, default=[0, 8], help="actor LoRA ranks (0 = off)")
    parser.add_argument("--jobs", type=int, default=2, help="cells run at the same time")
    parser.add_argument("--work", default=None, help="keep the runs' logs here (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench_step3 import make_critic  # beside this script

    import torch

    from utils.model.tiny import resolve_model_path

    work = args.work or tempfile.mkdtemp(prefix="bench_hybrid_")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    models = {name: (resolve_model_path(name), make_critic(name, os.path.join(work, f"{name}-critic")))
              for name in args.actors}
    cells = list(itertools.product(args.actors, args.stages, args.lora))
    runs = [(cell, hybrid) for cell in cells for hybrid in (True, False)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(runs, pool.map(
            lambda run: run_cell(run[0][0], *models[run[0][0]], run[0][1], run[0][2], run[1], work),
            runs)))
    lines = [f"--enable_hybrid_engine on {device} (step 3, 1 greedy PPO step, 4 prompts of 16 + 16 tokens); "
             f"logs in {work}", "",
             "| actor | ZeRO | LoRA | with the flag | without | generation with the flag | same greedy answers |",
             "|---|---|---|---|---|---|---|"]
    for cell in cells:
        on, off = results[(cell, True)], results[(cell, False)]
        same = "—" if not (on["answers"] and off["answers"]) else ("yes" if on["answers"] == off["answers"] else "NO")
        status = lambda r: "ok" if r["code"] == 0 else f"exit {r['code']}: {r['error']}"  # noqa: E731
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2] or 'off'} | {status(on)} | {status(off)} | "
                     f"{on['path'] or '—'} | {same} |")
    print("\n".join(lines))


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
