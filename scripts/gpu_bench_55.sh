#!/usr/bin/env bash
# Issue 55's GPU measurement: this project's SFT, reward model, DPO (and GRPO) against TRL's on one GPU, bf16 on
# both sides, on random-initialised models of SmolLM2-135M's and a Llama-1B shape (bench/bench_peers.py --shape;
# every answer runs to the cap), with peak GPU memory per run (nvidia-smi, polled). docs/benchmarks.md explains.
#
#   bash scripts/gpu_bench_55.sh prepare     # here, once: wheels into .whl/, data and SmolLM2's tokenizer into .data/
#   bash scripts/gpu_bench_55.sh run         # on the GPU machine (no package index), with .whl and .data carried
#
# `run` installs the carried wheels into /tmp/site, then runs bench_peers.py once per (shape, trainer), the most
# wanted first, each under its own time limit, and stops starting new ones when BUDGET seconds (default 480) are
# spent. What it writes to $OUT (default /tmp/bench55): bench55.log (every command, run and table), results.json
# (all runs' numbers) and env.txt (GPU, driver, versions). Knobs (environment): SHAPES, TRAINERS, GRPO (1: also
# GRPO on the first shape), STEPS (optimizer steps per run, 2 of them warm-up), BATCH, BUDGET.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-run}" in
prepare)
  bash scripts/device_wheels.sh
  mkdir -p .data/gsm8k .data/hh-rlhf .data/smollm2-tokenizer
  shared=${SHARED_DATA:-../shared/data}
  head -n 256 "$shared/gsm8k/train.jsonl" > .data/gsm8k/train.jsonl  # the bench reads the first 256
  cp "$shared/hh-rlhf/harmless-base-test.jsonl.gz" .data/hh-rlhf/
  model=${SMOLLM2_DIR:-../smollm2}
  if [ -f "$model/tokenizer.json" ]; then  # SmolLM2's real tokenizer and chat template (3.5 MB); else the offline BPE
    cp "$model"/tokenizer.json "$model"/tokenizer_config.json .data/smollm2-tokenizer/
    [ -f "$model/chat_template.jinja" ] && cp "$model/chat_template.jinja" .data/smollm2-tokenizer/
  fi
  du -sh .whl .data
  echo "now, on the GPU machine: bash scripts/gpu_bench_55.sh run   (carry .whl and .data)"
  ;;
run)
  OUT=${OUT:-/tmp/bench55}
  mkdir -p "$OUT"
  start=$SECONDS
  budget=${BUDGET:-480}
  log="$OUT/bench55.log"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* >"$OUT/pip.log" 2>&1 \
    || { tail -20 "$OUT/pip.log"; exit 1; }
  rm -f "$OUT/pip.log"
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  { nvidia-smi; python3 -c "import torch, transformers, deepspeed, trl; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__, '| trl', \
trl.__version__)"; } >"$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
  tail -1 "$OUT/env.txt" | tee "$log"
  tokenizer=()
  [ -f .data/smollm2-tokenizer/tokenizer.json ] && tokenizer=(--tokenizer .data/smollm2-tokenizer)
  steps=${STEPS:-6}
  batch=${BATCH:-8}
  jobs=()
  for shape in ${SHAPES:-smollm2-135m llama-1b}; do
    for trainer in $(echo "${TRAINERS:-sft,dpo,rm}" | tr , ' '); do jobs+=("$shape:$trainer"); done
  done
  [ "${GRPO:-1}" = 1 ] && jobs+=("$(echo "${SHAPES:-smollm2-135m}" | cut -d' ' -f1):grpo")
  for job in "${jobs[@]}"; do
    shape=${job%%:*} trainer=${job##*:}
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 60 ]; then echo "budget spent: $job not run" | tee -a "$log"; continue; fi
    echo "=== $shape $trainer ($left s of the budget left)" | tee -a "$log"
    # GRPO as the issue measured it: 8 prompts x 8 answers, 256 new tokens
    timeout "$left" python3 bench/bench_peers.py --device cuda --shape "$shape" --shape_dir "/tmp/shape-$shape" \
      "${tokenizer[@]}" --data .data --peer-python python3 --trainers "$trainer" --steps "$steps" --warmup 2 \
      --batch "$batch" --max_len 512 --grpo_batch 64 --group 8 --answer_len 256 --work "/tmp/peers/$shape-$trainer" \
      2>&1 | tee -a "$log" || echo "($job: exit $?)" | tee -a "$log"
  done
  python3 - "$OUT/results.json" <<'EOF'
import glob, json, sys
merged = {}
for path in sorted(glob.glob("/tmp/peers/*/results.json")):
    run = json.load(open(path))
    merged[path.split("/")[-2]] = run
json.dump(merged, open(sys.argv[1], "w"), indent=1)
print(f"{len(merged)} bench runs in {sys.argv[1]}")
EOF
  echo "done in $((SECONDS - start)) s" | tee -a "$log"
  ;;
*)
  echo "usage: bash scripts/gpu_bench_55.sh prepare|run" >&2
  exit 2
  ;;
esac
