#!/usr/bin/env bash
# Qwen2.5 7B (28 layers, hidden 3584, 28 heads in 4 key/value groups, SwiGLU ffn 18944,
# RoPE base 1000000, RMSNorm eps 1e-6, a bias on the QKV projection alone, untied
# embeddings, seq 4096, vocabulary 152064 rows) on one node of 8 GPUs: TP 4 x DP 2, bf16.
# TOKENIZER is Qwen2.5's Hugging Face tokenizer directory (tokenizer.json), e.g. the
# <save>/hf_files of tools/convert_checkpoint.py --from hf --to megatron --load Qwen2.5-7B
# --save checkpoints/qwen2.5_7b --target-tensor-model-parallel-size 4 (then this script
# continues from it; or run pretrain_gpt.py --load checkpoints/qwen2.5_7b with only data,
# batch and schedule flags: the checkpoint supplies the rest).
# Launch once per node; set NNODES, NODE_RANK and MASTER_ADDR for several nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the Qwen2.5 tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/qwen2.5_7b}

MODEL_ARGS=(
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel
    --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28
    --group-query-attention --num-query-groups 4 --add-qkv-bias
    --seq-length 4096 --max-position-embeddings 32768)
source examples/qwen_dense.sh "$@"
