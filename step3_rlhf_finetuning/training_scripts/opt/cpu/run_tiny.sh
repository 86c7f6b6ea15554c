#!/bin/bash
# Step 3 (RLHF, PPO) on CPU: the tiny-opt actor of step 1 against the tiny-opt reward model of step 2 on the
# built-in preference prompts, fp32, sampled answers (a few minutes on 2 cores; the average reward rises).
# Usage: bash $0 ACTOR_MODEL_PATH CRITIC_MODEL_PATH [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [extra main.py flags...]
set -eo pipefail
ACTOR_MODEL_PATH=$1
CRITIC_MODEL_PATH=$2
ACTOR_ZERO_STAGE=${3:-0}
CRITIC_ZERO_STAGE=${4:-0}
OUTPUT=${5:-./output/step3_tiny}
shift $(( $# < 5 ? $# : 5 ))
if [ -z "$ACTOR_MODEL_PATH" ] || [ -z "$CRITIC_MODEL_PATH" ]; then
    echo "usage: bash $0 ACTOR_MODEL_PATH CRITIC_MODEL_PATH [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [flags...]" >&2
    exit 2
fi
STEP3_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

PYTHON=${PYTHON:-python}

"$PYTHON" "$STEP3_DIR/main.py" \
   --data_path builtin/preference \
   --data_split 2,4,4 \
   --data_output_path "$OUTPUT/data" \
   --actor_model_name_or_path "$ACTOR_MODEL_PATH" \
   --critic_model_name_or_path "$CRITIC_MODEL_PATH" \
   --actor_zero_stage "$ACTOR_ZERO_STAGE" \
   --critic_zero_stage "$CRITIC_ZERO_STAGE" \
   --num_padding_at_beginning 1 \
   --per_device_generation_batch_size 16 \
   --per_device_training_batch_size 16 \
   --max_prompt_seq_len 32 \
   --max_answer_seq_len 24 \
   --do_sample \
   --actor_learning_rate 2e-4 \
   --critic_learning_rate 1e-3 \
   --actor_dropout 0.0 \
   --critic_dropout 0.0 \
   --num_warmup_steps 0 \
   --lr_scheduler_type constant \
   --max_steps 80 \
   --enable_ema \
   --seed 1234 \
   --dtype fp32 \
   --output_dir "$OUTPUT" \
   "$@" 2>&1 | tee "$OUTPUT/training.log"
