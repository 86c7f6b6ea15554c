#!/bin/bash
# Step 2 (DPO), Llama-2-7B on one node (all its GPUs), ZeRO-3 + offload + gradient checkpointing.
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [MODEL] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
#   MODEL: the policy to start from, usually step 1's --output_dir (default: the base model, as the reference)
set -eo pipefail
OUTPUT=${1:-./output_step2_llama_7b_epoch1_lr9.65e-6}
ZERO_STAGE=${2:-3}
MODEL=${3:-meta-llama/Llama-2-7b-hf}
shift $(( $# < 3 ? $# : 3 ))
DPO_DIR=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUTPUT"

deepspeed "$DPO_DIR/main.py" \
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
   --gradient_checkpointing \
   --zero_stage "$ZERO_STAGE" \
   --deepspeed \
   --offload \
   --output_dir "$OUTPUT" \
   "$@" 2>&1 | tee "$OUTPUT/training.log"
