#!/bin/bash
# Step 1 (SFT) on CPU: the built-in tiny-opt model on the built-in preference data, fp32 (about 10 s).
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
set -eo pipefail
OUTPUT=${1:-./output/step1_tiny}
ZERO_STAGE=${2:-0}
shift $(( $# < 2 ? $# : 2 ))
STEP1_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

PYTHON=${PYTHON:-python}

"$PYTHON" "$STEP1_DIR/main.py" \
   --model_name_or_path tiny-opt \
   --data_path builtin/preference \
   --data_split 2,4,4 \
   --data_output_path "$OUTPUT/data" \
   --per_device_train_batch_size 16 \
   --per_device_eval_batch_size 16 \
   --max_seq_len 64 \
   --learning_rate 1e-3 \
   --weight_decay 0. \
   --num_train_epochs 1 \
   --lr_scheduler_type cosine \
   --seed 1234 \
   --zero_stage "$ZERO_STAGE" \
   --dtype fp32 \
   --output_dir "$OUTPUT" \
   "$@" 2>&1 | tee "$OUTPUT/training.log"
