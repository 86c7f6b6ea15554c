#!/bin/bash
# Step 2 (DPO), OPT-350m on one node (all its GPUs).
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [MODEL] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
#   MODEL: the policy to start from, usually step 1's --output_dir (default: the base model, as the reference)
set -eo pipefail
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-0}
MODEL=${3:-facebook/opt-350m}
shift $(( $# < 3 ? $# : 3 ))
DPO_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

deepspeed "$DPO_DIR/main.py" \
   --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
   --data_split 2,4,4 \
   --model_name_or_path "$MODEL" \
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
