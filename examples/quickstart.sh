#!/usr/bin/env bash
# Install the framework and run its main job on a built-in default: a corpus of the
# Python standard library's own documentation, a byte-level BPE vocabulary trained
# on it, preprocessing, 500 iterations of a small GPT on the CPU (or GPU), a
# validation perplexity and a generated sample. No download, no outside file.
#
#   bash examples/quickstart.sh [OUTPUT_DIR]        (default: ./quickstart_output)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-quickstart_output}
PY=${PYTHON:-python}

# torch: keep the user's own build; install the pinned CPU wheel only when none is present.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[hf]"

mkdir -p "$OUT"
$PY tools/stdlib_corpus.py --output "$OUT/corpus.jsonl"
$PY tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --vocab-size 4096 --output-dir "$OUT/tokenizer"
$PY tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/stdlib" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/tokenizer/vocab.json" \
    --merge-file "$OUT/tokenizer/merges.txt" --append-eod --workers 2

MODEL="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128"
TOKENIZER="--tokenizer-type GPT2BPETokenizer --vocab-file $OUT/tokenizer/vocab.json --merge-file $OUT/tokenizer/merges.txt"

# Start fresh each time: an old checkpoint here would be resumed, and the run
# would have nothing left to do.
rm -rf "$OUT/checkpoints"
$PY pretrain_gpt.py $MODEL $TOKENIZER \
    --micro-batch-size 8 --global-batch-size 8 --train-iters 500 \
    --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.05 \
    --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path "$OUT/stdlib_text_document" --split 95,5,0 --data-cache-path "$OUT/cache" \
    --log-interval 25 --eval-interval 100 --eval-iters 5 --num-workers 0 \
    --save "$OUT/checkpoints" --save-interval 500 --tensorboard-dir "$OUT/tensorboard"

$PY tools/generate_samples_gpt.py $TOKENIZER --load "$OUT/checkpoints" \
    --prompt "The import statement" --out-seq-length 48 --top-k 20 --temperature 0.8 --seed 1234
