#!/bin/bash
# Step 1 (SFT), OPT-1.3B with LoRA on one GPU.
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
set -eo pipefail
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-0}
shift $(( $# < 2 ? $# : 2 ))
STEP1_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

deepspeed --num_gpus 1 "$STEP1_DIR/main.py" --model_name_or_path facebook/opt-1.3b \
   --gradient_accumulation_steps 8 --lora_dim 128 --zero_stage "$ZERO_STAGE" \
   --enable_tensorboard \
   --tensorboard_path "$OUTPUT" \
   --deepspeed --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/training.log"
