#!/bin/bash
# Step 2 (DPO), OPT-350m on one GPU (main.py's defaults otherwise: Dahoas/rm-static, batch 16).
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [MODEL] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
#   MODEL: the policy to start from, usually step 1's --output_dir (default: the base model, as the reference)
set -eo pipefail
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-0}
MODEL=${3:-facebook/opt-350m}
shift $(( $# < 3 ? $# : 3 ))
DPO_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

# DeepSpeed-Chat's script leaves the learning rate at main.py's default, 1e-3, far too high for full
# fine-tuning; its multi_node and single_node scripts use 5e-5, as this one does.
deepspeed --num_gpus 1 "$DPO_DIR/main.py" --model_name_or_path "$MODEL" \
   --weight_decay 0.1 --dropout 0.0 --gradient_accumulation_steps 4 --zero_stage "$ZERO_STAGE" \
   --learning_rate 5e-5 \
   --enable_tensorboard \
   --tensorboard_path "$OUTPUT" \
   --deepspeed --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/training.log"
