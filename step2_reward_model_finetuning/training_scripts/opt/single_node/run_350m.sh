#!/bin/bash
# Step 2 reward model: OPT-350m, single node.
# Usage: bash run_350m.sh [OUTPUT=./output] [ZERO_STAGE=0]
# Mirrors DeepSpeed-Chat's training_scripts/opt/single_node/run_350m.sh.
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-0}
mkdir -p "$OUTPUT" && OUTPUT=$(cd "$OUTPUT" && pwd)  # absolute: we cd below
cd "$(dirname "$0")/../../.." || exit 1  # the step folder (main.py)

deepspeed main.py \
   --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
   --data_split 2,4,4 \
   --model_name_or_path facebook/opt-350m \
   --num_padding_at_beginning 1 \
   --per_device_train_batch_size 8 \
   --per_device_eval_batch_size 8 \
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
   --enable_tensorboard \
   --tensorboard_path "$OUTPUT" \
   --output_dir "$OUTPUT" \
   2>&1 | tee "$OUTPUT/training.log"
exit "${PIPESTATUS[0]}"
