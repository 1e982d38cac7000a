#!/usr/bin/env bash
# LLaMA-2 7B (32 layers, hidden 4096, 32 heads, SwiGLU ffn 11008, RoPE, RMSNorm eps 1e-5,
# untied embeddings, no biases, seq 4096) on one node of 8 GPUs: TP 2 x DP 4, bf16.
# TOKENIZER is LLaMA-2's SentencePiece model file (tokenizer.model, 32000 ids), e.g. the one
# in <save>/hf_files after tools/convert_checkpoint.py. To continue from
# Meta's weights: tools/convert_checkpoint.py --from hf --to megatron --load Llama-2-7b-hf
# --save checkpoints/llama2_7b --target-tensor-model-parallel-size 2, then run this script.
# Launch once per node; set NNODES, NODE_RANK and MASTER_ADDR for several nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the LLaMA-2 tokenizer.model}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/llama2_7b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \
    --seq-length 4096 --max-position-embeddings 4096 \
    --position-embedding-type rope --rotary-base 10000 \
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02 \
    --micro-batch-size 1 --global-batch-size 1024 \
    --train-iters 500000 --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --checkpoint-activations \
    --data-path $DATA --split 99,1,0 \
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
