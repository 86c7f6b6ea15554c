#!/bin/bash
# Step 1 (SFT), OPT-66B on several nodes (HOSTFILE, default /job/hostfile), ZeRO-3 + LoRA.
# Usage: bash $0 [OUTPUT] [ZERO_STAGE] [extra main.py flags...]   (hyper-parameters of DeepSpeed-Chat's script)
set -eo pipefail
OUTPUT=${1:-./output}
ZERO_STAGE=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
STEP1_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUTPUT"

HOSTFILE=${HOSTFILE:-/job/hostfile}

deepspeed --hostfile "$HOSTFILE" "$STEP1_DIR/main.py" \
   --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
   --data_split 2,4,4 \
   --model_name_or_path facebook/opt-66b \
   --per_device_train_batch_size 4 \
   --per_device_eval_batch_size 4 \
   --max_seq_len 512 \
   --learning_rate 1e-4 \
   --weight_decay 0.1 \
   --num_train_epochs 2 \
   --gradient_accumulation_steps 1 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --gradient_checkpointing \
   --zero_stage "$ZERO_STAGE" \
   --lora_dim 128 \
   --lora_module_name decoder.layers. \
   --deepspeed \
   --output_dir "$OUTPUT" \
   "$@" 2>&1 | tee "$OUTPUT/training.log"
