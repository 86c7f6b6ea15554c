#!/bin/bash
# Step 2 (reward model), OPT-350m on one GPU (main.py's defaults otherwise: Dahoas/rm-static, batch 16).
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
set -eo pipefail
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-0}
shift $(( $# < 2 ? $# : 2 ))
STEP2_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

deepspeed --num_gpus 1 "$STEP2_DIR/main.py" --model_name_or_path facebook/opt-350m \
   --num_padding_at_beginning 1 --weight_decay 0.1 --dropout 0.0 --gradient_accumulation_steps 4 \
   --zero_stage "$ZERO_STAGE" \
   --enable_tensorboard \
   --tensorboard_path "$OUTPUT" \
   --deepspeed --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/training.log"
