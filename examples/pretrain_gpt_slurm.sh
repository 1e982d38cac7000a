#!/usr/bin/env bash
# GPT pretraining under SLURM: one task per GPU, started by srun; each task reads its
# rank from SLURM_PROCID and the world size from SLURM_NTASKS.
#   DATA=... VOCAB=... MERGE=... sbatch examples/pretrain_gpt_slurm.sh [extra flags]
#SBATCH --job-name=megatron-gpt
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
NNODES=${SLURM_JOB_NUM_NODES:-4}
GPUS_PER_NODE=${SLURM_NTASKS_PER_NODE:-8}
# The first node of the allocation hosts the rendezvous store.
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1 || echo localhost)}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-8}
PP=${PP:-${NNODES}}
DATA=${DATA:?set DATA to a preprocessed prefix}
VOCAB=${VOCAB:?set VOCAB to a GPT-2 vocab.json}
MERGE=${MERGE:?set MERGE to a GPT-2 merges.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt_slurm_tp${TP}_pp${PP}}

# torch.distributed reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
srun --nodes "$NNODES" --ntasks-per-node "$GPUS_PER_NODE" --export=ALL \
    bash -c 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec "$@"' _ \
    env MASTER_ADDR="$MASTER_ADDR" MASTER_PORT="$MASTER_PORT" \
    python pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 4 --global-batch-size 256 \
    --lr 0.0002 --min-lr 2.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
    --train-iters 100000 --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --log-interval 10 --log-throughput --save-interval 2000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
