#!/usr/bin/env bash
# A Megatron-DeepSpeed-style GPT-2 345M command, as its examples write it: no --tokenizer-type
# (GPT2BPETokenizer is the default), --data-impl mmap, --checkpoint-activations.
# DATA=... VOCAB=... MERGE=... bash examples/megatron_deepspeed_gpt2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA=${DATA:?set DATA to a preprocessed prefix}
VOCAB=${VOCAB:?set VOCAB to a GPT-2 vocab.json}
MERGE=${MERGE:?set MERGE to a GPT-2 merges.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt2_345m_ds}

python -m torch.distributed.launch --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 16 \
    --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine \
    --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 \
    --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --data-path "$DATA" --data-impl mmap --split 949,50,1 --distributed-backend nccl \
    --checkpoint-activations --log-interval 100 --save-interval 10000 --eval-interval 1000 \
    --eval-iters 10 --fp16 --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
