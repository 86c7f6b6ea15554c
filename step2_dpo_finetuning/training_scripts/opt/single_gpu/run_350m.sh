#!/bin/bash
# Step 2 DPO: OPT-350m policy, single gpu. (DeepSpeed-Chat's script keeps the 1e-3 default learning rate, far too high for full fine-tuning; 5e-6 here.)
# Usage: bash run_350m.sh [OUTPUT=./output] [ZERO_STAGE=0] [MODEL=facebook/opt-350m]
# Mirrors DeepSpeed-Chat's step2_dpo_finetuning/training_scripts/opt/single_gpu/run_350m.sh.
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-0}
MODEL=${3:-facebook/opt-350m}  # the policy to start from: usually the step-1 output folder
[ -d "$MODEL" ] && MODEL=$(cd "$MODEL" && pwd)
mkdir -p "$OUTPUT" && OUTPUT=$(cd "$OUTPUT" && pwd)  # absolute: we cd below
cd "$(dirname "$0")/../../.." || exit 1  # the step folder (main.py)

deepspeed --num_gpus 1 main.py \
   --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
   --data_split 2,4,4 \
   --model_name_or_path "$MODEL" \
   --per_device_train_batch_size 4 \
   --per_device_eval_batch_size 4 \
   --max_seq_len 512 \
   --learning_rate 5e-6 \
   --weight_decay 0.1 \
   --num_train_epochs 1 \
   --dropout 0.0 \
   --gradient_accumulation_steps 4 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --beta 0.1 \
   --gradient_checkpointing \
   --zero_stage "$ZERO_STAGE" \
   --deepspeed \
   --enable_tensorboard \
   --tensorboard_path "$OUTPUT" \
   --output_dir "$OUTPUT" \
   2>&1 | tee "$OUTPUT/training.log"
exit "${PIPESTATUS[0]}"
