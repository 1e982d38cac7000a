#!/usr/bin/env bash
# BLOOM 176B as BigScience trained it with Megatron-DeepSpeed (tr11-176B-ml): 70 layers,
# hidden 14336, 112 heads, seq 2048, ALiBi, an embedding layer norm, bf16, TP 4, the
# BLOOM tokenizer (250680 ids) padded to 250880 rows. BigScience ran PP 12 on 48 nodes,
# balancing 70 layers + embeddings over 12 stages (--pp-partition-method
# 'type:transformer|embedding'); our pipeline splits the layers evenly, so this preset
# runs PP 14 (5 layers per stage): TP 4 x PP 14 x DP 8 on 56 nodes of 8 GPUs.
# TOKENIZER is a Hugging Face directory of bigscience/tokenizer (tokenizer.json).
# Launch once per node (SLURM: srun sets the node rank; see examples/pretrain_gpt_distributed.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the BLOOM tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/bloom_176b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-56}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 14 \
    --num-layers 70 --hidden-size 14336 --num-attention-heads 112 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --position-embedding-type alibi --embed-layernorm --pad-vocab-size-to 250880 \
    --micro-batch-size 2 --global-batch-size 2048 --rampup-batch-size 192 16 9765625 \
    --train-samples 220000000 --lr-decay-samples 200000000 --lr-warmup-samples 183105 \
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --weight-decay 1e-1 \
    --init-method-std 0.0048 --hidden-dropout 0 --attention-dropout 0 --seed 42 \
    --bf16 --checkpoint-activations \
    --data-path $DATA --split 949,50,1 \
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER" \
    --log-interval 1 --save-interval 100 --eval-interval 1000 --eval-iters 1 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
