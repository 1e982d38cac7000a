#!/usr/bin/env bash
# DeepSeek-V3 (671B total, 37B active; the shape of its config.json) with Megatron-LM's
# DeepSeek-V3 flags on 128 nodes of 8 GPUs: 61 layers, hidden 7168, 128 heads with
# multi-latent attention (query LoRA rank 1536, KV LoRA rank 512, qk head 128 + 64 RoPE
# channels, value head 128), YaRN (factor 40 over 4096 positions, mscale 1.0), the first 3
# layers dense (SwiGLU 18432), then 256 routed experts of width 2048 + 1 shared expert of
# 2048, sigmoid top-8 over 8 groups keeping 4 with an expert bias (and a 1e-4 sequence-wise
# auxiliary loss) and routed scaling 2.5, 1 MTP layer (loss weight 0.1).
# Parallelism as Megatron's published 1024-GPU DeepSeek-V3 recipe: TP 2 with SP, PP 8 with
# its layout "Et|(tt|)*30mL" (32 chunks: virtual PP 4; the embedding with the first layer,
# two layers a chunk, the MTP layer and the loss alone in the last), EP 64 with expert TP 1,
# global batch 8192, the distributed optimizer (the shared flags: examples/deepseek_moe.sh).
# TOKENIZER is the Hugging Face tokenizer directory of DeepSeek-V3.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the DeepSeek-V3 tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/deepseek_v3}

NODES=128
MODEL_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8
    --pipeline-model-parallel-layout "Et|(tt|)*30mL"
    --expert-model-parallel-size 64 --expert-tensor-parallel-size 1
    --num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size 18432
    --q-lora-rank 1536 --kv-lora-rank 512 --mscale 1.0 --mscale-all-dim 1.0
    --init-method-std 0.006
    --num-experts 256 --moe-ffn-hidden-size 2048 --moe-layer-freq "([0]*3+[1]*58)"
    --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-topk-scaling-factor 2.5
    --moe-router-num-groups 8 --moe-router-group-topk 4
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --global-batch-size 8192 --train-samples 3662109375
    --lr-warmup-samples 16384000 --lr-decay-samples 3600000000 --lr 2.2e-4 --min-lr 2.2e-5)
source examples/deepseek_moe.sh "$@"
