#!/bin/bash
# Step 3 (RLHF, PPO): OPT-1.3B actor + OPT-350M reward on a single GPU (LoRA + hybrid engine + checkpointing).
# Usage: bash $0 ACTOR_MODEL_PATH CRITIC_MODEL_PATH [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [extra main.py flags...]
#   ACTOR_MODEL_PATH = step 1's --output_dir, CRITIC_MODEL_PATH = step 2's --output_dir (hyper-parameters of DeepSpeed-Chat's script)
set -eo pipefail
ACTOR_MODEL_PATH=$1
CRITIC_MODEL_PATH=$2
ACTOR_ZERO_STAGE=${3:-0}
CRITIC_ZERO_STAGE=${4:-0}
OUTPUT=${5:-./output}
shift $(( $# < 5 ? $# : 5 ))
if [ -z "$ACTOR_MODEL_PATH" ] || [ -z "$CRITIC_MODEL_PATH" ]; then
    echo "usage: bash $0 ACTOR_MODEL_PATH CRITIC_MODEL_PATH [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [flags...]" >&2
    exit 2
fi
STEP3_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

deepspeed --num_gpus 1 "$STEP3_DIR/main.py" \
   --actor_model_name_or_path "$ACTOR_MODEL_PATH" \
   --critic_model_name_or_path "$CRITIC_MODEL_PATH" \
   --actor_zero_stage "$ACTOR_ZERO_STAGE" \
   --critic_zero_stage "$CRITIC_ZERO_STAGE" \
   --num_padding_at_beginning 1 \
   --gradient_accumulation_steps 2 \
   --deepspeed \
   --actor_lora_dim 128 \
   --enable_hybrid_engine \
   --actor_gradient_checkpointing \
   --actor_dropout 0.0 \
   --output_dir "$OUTPUT" \
   "$@" 2>&1 | tee "$OUTPUT/training.log"
