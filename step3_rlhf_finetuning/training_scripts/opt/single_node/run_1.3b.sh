#!/bin/bash
# Step 3 (RLHF, PPO): OPT-1.3B actor + OPT-350M reward on one node (all its GPUs), ZeRO-2, EMA.
# Usage: bash $0 ACTOR_MODEL_PATH CRITIC_MODEL_PATH [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [extra main.py flags...]
#   ACTOR_MODEL_PATH = step 1's --output_dir, CRITIC_MODEL_PATH = step 2's --output_dir (hyper-parameters of DeepSpeed-Chat's script)
set -eo pipefail
ACTOR_MODEL_PATH=$1
CRITIC_MODEL_PATH=$2
ACTOR_ZERO_STAGE=${3:-2}
CRITIC_ZERO_STAGE=${4:-2}
OUTPUT=${5:-./output}
shift $(( $# < 5 ? $# : 5 ))
if [ -z "$ACTOR_MODEL_PATH" ] || [ -z "$CRITIC_MODEL_PATH" ]; then
    echo "usage: bash $0 ACTOR_MODEL_PATH CRITIC_MODEL_PATH [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [flags...]" >&2
    exit 2
fi
STEP3_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

deepspeed "$STEP3_DIR/main.py" \
   --data_path Dahoas/rm-static \
   --data_split 2,4,4 \
   --actor_model_name_or_path "$ACTOR_MODEL_PATH" \
   --critic_model_name_or_path "$CRITIC_MODEL_PATH" \
   --actor_zero_stage "$ACTOR_ZERO_STAGE" \
   --critic_zero_stage "$CRITIC_ZERO_STAGE" \
   --num_padding_at_beginning 1 \
   --per_device_generation_batch_size 4 \
   --per_device_training_batch_size 4 \
   --generation_batches 1 \
   --ppo_epochs 1 \
   --max_answer_seq_len 256 \
   --max_prompt_seq_len 256 \
   --actor_learning_rate 9.65e-6 \
   --critic_learning_rate 5e-6 \
   --actor_dropout 0.0 \
   --enable_ema \
   --enable_tensorboard \
   --tensorboard_path "$OUTPUT" \
   --num_train_epochs 1 \
   --lr_scheduler_type cosine \
   --gradient_accumulation_steps 1 \
   --num_warmup_steps 100 \
   --deepspeed --seed 1234 \
   --enable_hybrid_engine \
   --output_dir "$OUTPUT" \
   "$@" 2>&1 | tee "$OUTPUT/training.log"
