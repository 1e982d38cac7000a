#!/usr/bin/env bash
# gpt-oss-20b (its published config: 24 layers, hidden 2880, 64 heads of 64 channels in 8
# key/value groups, learned attention sinks, sliding window 128 on every other layer
# (layers 1, 3, ...; the even ones attend to everything), 32 experts of width 2880 with
# top-4 routing, the clamped GLU (quick GeLU gate, limit 7, up + 1), biases on attention,
# router and experts, yarn RoPE (base 150000, factor 32 over the original 4096 positions,
# unrounded ramp), RMSNorm, untied embeddings, 201088 vocabulary rows) with Megatron-LM's
# flags: TP 1, PP 1, EP 8 on one node of 8 GPUs, the distributed optimizer, bf16.
# TOKENIZER is the directory of gpt-oss's Hugging Face tokenizer (o200k_harmony); to
# continue the released weights, convert them first (README, "Hugging Face") and --load them.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the gpt-oss tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt_oss_20b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --expert-model-parallel-size 8 --use-distributed-optimizer \
    --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 \
    --kv-channels 64 --group-query-attention --num-query-groups 8 \
    --seq-length 4096 --max-position-embeddings 131072 \
    --position-embedding-type rope --rotary-base 150000 \
    --rope-scaling-type yarn --rope-scaling-factor 32 \
    --rope-scaling-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1 \
    --no-yarn-correction-range-round-to-int \
    --window-size 128 --window-attn-skip-freq 2 --softmax-type learnable \
    --normalization RMSNorm --norm-epsilon 1e-5 --untie-embeddings-and-output-weights \
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
    --num-experts 32 --moe-ffn-hidden-size 2880 --moe-router-topk 4 \
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
    --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 \
    --micro-batch-size 1 --global-batch-size 256 \
    --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine \
    --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 \
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER" \
    --pad-vocab-size-to 201088 \
    --data-path $DATA --split 99990,8,2 \
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
