#!/usr/bin/env bash
# DeepSeek-V2-Lite (16B total, 2.4B active; the shape of its config.json) on 2 nodes of 8
# GPUs: 27 layers, hidden 2048, 16 heads with multi-latent attention without query
# compression (KV LoRA rank 512, qk head 128 + 64 RoPE channels, value head 128), YaRN
# (factor 40 over 4096 positions, mscale 0.707), the first layer dense (SwiGLU 10944), then
# 64 routed experts of width 1408 + 2 shared (2816), softmax top-6 without renormalisation,
# a 1e-3 sequence-wise auxiliary loss. Parallelism: TP 1, PP 1, EP 16 over the
# data-parallel ranks, distributed optimizer (the shared flags: examples/deepseek_moe.sh).
# TOKENIZER is the Hugging Face tokenizer directory of DeepSeek-V2-Lite.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the DeepSeek-V2-Lite tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/deepseek_v2_lite}

NODES=2
MODEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --expert-model-parallel-size 16
    --num-layers 27 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 10944
    --kv-lora-rank 512 --mscale 0.707 --mscale-all-dim 0.707 --init-method-std 0.02
    --num-experts 64 --moe-ffn-hidden-size 1408 --moe-layer-freq "([0]*1+[1]*26)"
    --moe-shared-expert-intermediate-size 2816 --moe-router-topk 6
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3
    --global-batch-size 1024 --train-samples 1391601562
    --lr-warmup-samples 2048000 --lr-decay-samples 1380000000 --lr 4.2e-4 --min-lr 4.2e-5)
source examples/deepseek_moe.sh "$@"
