#!/usr/bin/env bash
# LLaMA-3 8B (32 layers, hidden 4096, 32 heads in 8 key/value groups, SwiGLU ffn 14336,
# RoPE base 500000, RMSNorm eps 1e-5, untied embeddings, no biases, seq 8192,
# vocabulary 128256) on one node of 8 GPUs: TP 2 x DP 4, bf16.
# TOKENIZER is a Hugging Face tokenizer directory of LLaMA-3 (tokenizer.json; Megatron-LM's
# --tokenizer-type HuggingFaceTokenizer), e.g. the
# <save>/hf_files of tools/convert_checkpoint.py --from hf --to megatron --load Meta-Llama-3-8B.
# Launch once per node; set NNODES, NODE_RANK and MASTER_ADDR for several nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the LLaMA-3 tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/llama3_8b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 \
    --seq-length 8192 --max-position-embeddings 8192 \
    --position-embedding-type rope --rotary-base 500000 \
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.01 \
    --micro-batch-size 1 --global-batch-size 128 \
    --train-samples 1953125000 --lr-warmup-samples 1536000 --lr-decay-samples 1949218748 \
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --checkpoint-activations \
    --data-path $DATA --split 99,1,0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
