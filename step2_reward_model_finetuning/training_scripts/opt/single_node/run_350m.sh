#!/bin/bash
# Step 2 (reward model), OPT-350m on one node (all its GPUs).
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
set -eo pipefail
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-0}
shift $(( $# < 2 ? $# : 2 ))
STEP2_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

deepspeed "$STEP2_DIR/main.py" \
   --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
   --data_split 2,4,4 \
   --model_name_or_path facebook/opt-350m \
   --num_padding_at_beginning 1 \
   --per_device_train_batch_size 4 \
   --per_device_eval_batch_size 4 \
   --max_seq_len 512 \
   --learning_rate 5e-5 \
   --weight_decay 0.1 \
   --num_train_epochs 1 \
   --dropout 0.0 \
   --gradient_accumulation_steps 1 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --zero_stage "$ZERO_STAGE" \
   --deepspeed \
   --output_dir "$OUTPUT" \
   "$@" 2>&1 | tee "$OUTPUT/training.log"
