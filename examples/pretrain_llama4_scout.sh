#!/usr/bin/env bash
# Llama-4-Scout-17B-16E's text model with Megatron-LM's flags: 48 layers, hidden 5120, 40
# heads of 128 channels in 8 key/value groups, a 202048-token vocabulary, untied head,
# RMSNorm (eps 1e-5); every layer MoE (interleave_moe_layer_step 1) with 16 experts of width
# 8192, top-1 sigmoid routing applied to the expert input and a shared expert of width 8192
# (dense MLP width, unused when every layer is MoE: 16384); every 4th layer NoPE (with
# attention temperature tuning, floor scale 8192, scale 0.1), the others interleaved RoPE
# (base 500000) with q / k L2 norm and attention chunks of 8192.
# Where the values come from: the sizes, the expert and MoE settings, the NoPE interval, the
# chunk, q / k norm, the temperature settings and RoPE base 500000 are transformers 5.25's
# Llama4TextConfig defaults (checked by tests/unit/test_convert_hf_llama4.py's defaults test).
# The llama3 RoPE scaling (factor 16, low and high frequency factors 1 and 1 over the
# original 8192 positions) and max_position_embeddings 10485760 are from memory of Scout's
# published config.json (Llama4TextConfig's default is no scaling and 131072): unverified
# here; check them against the config.json of the weights you continue.
# Layout: 4 nodes of 8 GPUs, TP 4 (experts: expert TP 1, EP 8), PP 2, the distributed
# optimizer, bf16. TOKENIZER is the directory of Llama 4's Hugging Face tokenizer; to
# continue the released weights, convert them first (README, "Hugging Face") and --load them.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the Llama 4 tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/llama4_scout}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-4}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --sequence-parallel \
    --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 \
    --use-distributed-optimizer \
    --num-layers 48 --hidden-size 5120 --ffn-hidden-size 16384 --num-attention-heads 40 \
    --kv-channels 128 --group-query-attention --num-query-groups 8 \
    --seq-length 8192 --max-position-embeddings 10485760 \
    --position-embedding-type rope --rotary-base 500000 --rotary-interleaved \
    --rope-scaling-type llama3 --rope-scaling-factor 16 --rope-scaling-low-freq-factor 1 \
    --rope-scaling-high-freq-factor 1 --rope-scaling-original-max-position-embeddings 8192 \
    --no-rope-freq 4 --attention-chunk-size 8192 --qk-l2-norm \
    --attn-temperature-tuning --attn-temperature-floor-scale 8192 --attn-temperature-scale 0.1 \
    --normalization RMSNorm --norm-epsilon 1e-5 --untie-embeddings-and-output-weights \
    --swiglu --disable-bias-linear \
    --num-experts 16 --moe-ffn-hidden-size 8192 --moe-router-topk 1 \
    --moe-router-score-function sigmoid --moe-apply-probs-on-input \
    --moe-shared-expert-intermediate-size 8192 --moe-layer-freq 1 \
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
    --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 \
    --micro-batch-size 1 --global-batch-size 256 \
    --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine \
    --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 \
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER" \
    --pad-vocab-size-to 202048 \
    --data-path $DATA --split 99990,8,2 \
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
