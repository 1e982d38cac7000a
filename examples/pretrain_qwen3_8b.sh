#!/usr/bin/env bash
# Qwen3 8B (36 layers, hidden 4096, 32 heads of 128 channels in 8 key/value groups, an
# RMSNorm over each query and key head, SwiGLU ffn 12288, RoPE base 1000000, RMSNorm eps
# 1e-6, no biases, untied embeddings, seq 4096, vocabulary 151936 rows) on one node of 8
# GPUs: TP 2 x DP 4, bf16.
# TOKENIZER is Qwen3's Hugging Face tokenizer directory (tokenizer.json), e.g. the
# <save>/hf_files of tools/convert_checkpoint.py --from hf --to megatron --load Qwen3-8B
# --save checkpoints/qwen3_8b --target-tensor-model-parallel-size 2.
# Launch once per node; set NNODES, NODE_RANK and MASTER_ADDR for several nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the Qwen3 tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/qwen3_8b}

MODEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 32
    --kv-channels 128 --group-query-attention --num-query-groups 8 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 40960)
source examples/qwen_dense.sh "$@"
