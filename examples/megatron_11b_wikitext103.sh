#!/usr/bin/env bash
# fairseq's Megatron-11b WikiText-103 evaluation on a fairseq checkpoint, as its README runs
# it: detokenise (fairseq's detok.py rules) -> GPT-2 BPE -> dictionary ids with a </s> per
# line -> fairseq-eval-lm --tokens-per-sample 1024 --context-window 992 -> the perplexity
# renormalised to words, 2 ** (log2(ppl) x bpe tokens / word tokens) (the README: 8.46 ->
# 10.54 with 270847 / 245566).
#   bash examples/megatron_11b_wikitext103.sh MODEL WIKI_TEST_TOKENS [extra tasks/main.py flags]
# MODEL: fairseq's model.pt (with its model-model_part-K.pt partitions and dict.txt beside
# it) or a checkpoint already converted here. VOCAB / MERGE: GPT-2's encoder.json / vocab.bpe.
# TP processes (default 8): NCCL on GPUs, gloo on CPUs (any TP there, e.g. TP=2).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: megatron_11b_wikitext103.sh MODEL WIKI_TEST_TOKENS [flags]}
TEST=${2:?usage: megatron_11b_wikitext103.sh MODEL WIKI_TEST_TOKENS [flags]}
shift 2
VOCAB=${VOCAB:?set VOCAB to GPT-2 encoder.json}
MERGE=${MERGE:?set MERGE to GPT-2 vocab.bpe}
TP=${TP:-8}
TOKENS_PER_SAMPLE=${TOKENS_PER_SAMPLE:-1024}
CONTEXT_WINDOW=${CONTEXT_WINDOW:-992}
CONVERTED=${CONVERTED:-checkpoints/megatron_11b_tp${TP}}
PYTHON=${PYTHON:-python}

if [ -f "$MODEL/latest_checkpointed_iteration.txt" ]; then
    CONVERTED=$MODEL
elif [ ! -f "$CONVERTED/latest_checkpointed_iteration.txt" ]; then
    "$PYTHON" tools/convert_checkpoint.py --from fairseq --to megatron --load "$MODEL" \
        --save "$CONVERTED" --target-tensor-model-parallel-size "$TP" \
        --vocab-file "$VOCAB" --merge-file "$MERGE"
fi
torchrun --nproc_per_node "$TP" tasks/main.py --task WIKITEXT103 --fairseq-eval-lm \
    --valid-data "$TEST" --detokenizer fairseq \
    --tokens-per-sample "$TOKENS_PER_SAMPLE" --context-window "$CONTEXT_WINDOW" \
    --load "$CONVERTED" --tensor-model-parallel-size "$TP" \
    --vocab-file "$VOCAB" --merge-file "$MERGE" --micro-batch-size "${MICRO_BATCH:-8}" \
    --log-interval 100 "$@"
