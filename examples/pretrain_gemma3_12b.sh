#!/usr/bin/env bash
# Gemma 3 12B, the text model (48 layers, hidden 3840, 16 heads of 256 channels in 8
# key/value groups, tanh GeGLU ffn 15360, RMSNorms applied as 1 + w with eps 1e-6 before
# and after attention and the MLP, (1 + w) q / k norms, softmax scale
# query_pre_attn_scalar ** -0.5 = 256 ** -0.5 (the default 1 / sqrt(256)), word embeddings
# times sqrt(3840), tied, no biases; 5 sliding-window layers (window 1024, RoPE base 10000)
# to 1 global layer (RoPE base 1000000, linear scaling 8), vocabulary 262208, seq 8192 of its
# 131072 positions) on one node of 8 GPUs: TP 4 x DP 2, bf16.
# TOKENIZER is Gemma 3's Hugging Face tokenizer directory (tokenizer.json), e.g. the
# <save>/hf_files of tools/convert_checkpoint.py --from hf --to megatron --load gemma-3-12b-pt
# --save checkpoints/gemma3_12b --target-tensor-model-parallel-size 4.
# Launch once per node; set NNODES, NODE_RANK and MASTER_ADDR for several nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the Gemma 3 tokenizer directory}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gemma3_12b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel \
    --num-layers 48 --hidden-size 3840 --ffn-hidden-size 15360 --num-attention-heads 16 \
    --kv-channels 256 --group-query-attention --num-query-groups 8 \
    --seq-length 8192 --max-position-embeddings 131072 \
    --normalization RMSNorm --norm-epsilon 1e-6 --apply-layernorm-1p --sandwich-norm \
    --qk-layernorm --glu-activation geglu_tanh --disable-bias-linear \
    --embedding-multiplier 61.96773353931867 \
    --position-embedding-type rope --rotary-base 1000000 --rotary-base-local 10000 \
    --rotary-seq-len-interpolation-factor 8 --no-rope-scaling-local \
    --window-size 1024 --window-attn-skip-freq 6 \
    --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02 \
    --micro-batch-size 1 --global-batch-size 256 \
    --train-iters 100000 --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --checkpoint-activations \
    --data-path $DATA --split 99,1,0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
