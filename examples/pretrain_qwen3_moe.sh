#!/usr/bin/env bash
# A Qwen3-MoE-style model (Qwen3-30B-A3B's shape: 48 layers, hidden 2048, 32 query heads of
# 128 channels in 4 key/value groups with q/k RMSNorm, 128 SwiGLU experts of width 768,
# top-8 softmax routing renormalised over the 8 (pre-softmax off), load-balancing loss
# 1e-3, RoPE base 1e6, RMSNorm eps 1e-6, untied embeddings, no biases, seq 4096) on
# 2 nodes of 8 GPUs: TP 1, PP 2, EP 8 over the data-parallel ranks, alltoall dispatch.
# TOKENIZER is the Hugging Face tokenizer directory of Qwen3.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the Qwen3 tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/qwen3_moe}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-2}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
    --expert-model-parallel-size 8 --use-distributed-optimizer \
    --num-layers 48 --hidden-size 2048 --num-attention-heads 32 --kv-channels 128 \
    --group-query-attention --num-query-groups 4 --qk-layernorm \
    --seq-length 4096 --max-position-embeddings 40960 \
    --position-embedding-type rope --rotary-base 1000000 \
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02 \
    --num-experts 128 --moe-ffn-hidden-size 768 --ffn-hidden-size 6144 \
    --moe-router-topk 8 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
    --moe-router-dtype fp32 --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
    --micro-batch-size 1 --global-batch-size 512 \
    --train-samples 244140625 --lr-warmup-samples 1024000 --lr-decay-samples 243000000 \
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --bf16 --checkpoint-activations \
    --data-path $DATA --split 99,1,0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
