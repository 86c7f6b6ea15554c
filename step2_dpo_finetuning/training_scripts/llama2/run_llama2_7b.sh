#!/bin/bash
# Step 2 DPO: Llama-2-7b policy, one node.
# Usage: bash run_llama2_7b.sh [OUTPUT] [ZERO_STAGE=3] [MODEL]
# Mirrors DeepSpeed-Chat's step2_dpo_finetuning/training_scripts/llama2/run_llama2_7b.sh.
OUTPUT=${1:-./output_step2_llama_7b_epoch1_lr9.65e-6}
ZERO_STAGE=${2:-3}
MODEL=${3:-meta-llama/Llama-2-7b-hf}  # the policy to start from: usually the step-1 output folder
[ -d "$MODEL" ] && MODEL=$(cd "$MODEL" && pwd)
mkdir -p "$OUTPUT" && OUTPUT=$(cd "$OUTPUT" && pwd)  # absolute: we cd below
cd "$(dirname "$0")/../.." || exit 1  # the step folder (main.py)

deepspeed main.py \
   --data_path Dahoas/rm-static \
   --data_split 2,4,4 \
   --model_name_or_path "$MODEL" \
   --per_device_train_batch_size 8 \
   --per_device_eval_batch_size 8 \
   --max_seq_len 512 \
   --learning_rate 9.65e-6 \
   --weight_decay 0.1 \
   --num_train_epochs 1 \
   --gradient_accumulation_steps 1 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --beta 0.1 \
   --gradient_checkpointing \
   --zero_stage "$ZERO_STAGE" \
   --deepspeed \
   --offload \
   --output_dir "$OUTPUT" \
   2>&1 | tee "$OUTPUT/training.log"
exit "${PIPESTATUS[0]}"
