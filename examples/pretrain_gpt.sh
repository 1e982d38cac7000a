#!/usr/bin/env bash
# GPT-2 345M-style pretraining in one process (CPU with gloo, or one GPU).
#   DATA=my-gpt2_text_document VOCAB=gpt2-vocab.json MERGE=gpt2-merges.txt bash examples/pretrain_gpt.sh
# DATA is the prefix that tools/preprocess_data.py wrote (without .bin/.idx).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA to a preprocessed prefix, e.g. my-gpt2_text_document}
VOCAB=${VOCAB:?set VOCAB to a GPT-2 vocab.json}
MERGE=${MERGE:?set MERGE to a GPT-2 merges.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt2_345m}

python pretrain_gpt.py \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 8 \
    --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
    --train-iters 500000 --lr-decay-iters 320000 --weight-decay 1e-2 --clip-grad 1.0 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
