#!/usr/bin/env bash
# GPT pretraining under SLURM: one task per GPU (per rank on CPUs), started by srun with no
# launcher in between, as Megatron users' srun scripts do:
#   DATA=... VOCAB=... MERGE=... sbatch examples/pretrain_gpt_slurm.sh [extra flags]
# Each task reads its rank from SLURM_PROCID, the world size from SLURM_NTASKS, its local
# rank from SLURM_LOCALID and the master address from the first host of SLURM_NODELIST
# (bracket syntax such as node[01-04,07]); MASTER_PORT defaults to 29500. Set MASTER_ADDR or
# RANK/WORLD_SIZE yourself and they win. GPT_ARGS, DATA_ARGS and OUTPUT_ARGS replace the
# model/training, data/tokenizer and logging/checkpoint flags below when set (even empty).
#SBATCH --job-name=megatron-gpt
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
NNODES=${SLURM_JOB_NUM_NODES:-4}
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-8}
# The interface between the nodes, when the default route's is not it (a name that does
# not exist stops every rank at start-up, naming the interfaces that do):
#   export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=ib0
TP=${TP:-8}
PP=${PP:-${NNODES}}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt_slurm_tp${TP}_pp${PP}}
GPT_ARGS=${GPT_ARGS-"--num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 4 --global-batch-size 256 \
    --lr 0.0002 --min-lr 2.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
    --train-iters 100000 --weight-decay 0.1 --clip-grad 1.0 --bf16"}
DATA_ARGS=${DATA_ARGS-"--data-path ${DATA:?set DATA to a preprocessed prefix} --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file ${VOCAB:?set VOCAB to a GPT-2 vocab.json} \
    --merge-file ${MERGE:?set MERGE to a GPT-2 merges.txt}"}
OUTPUT_ARGS=${OUTPUT_ARGS-"--log-interval 10 --log-throughput --save-interval 2000 \
    --eval-interval 1000 --eval-iters 10 --save $CHECKPOINTS --load $CHECKPOINTS"}

# shellcheck disable=SC2086  # the *_ARGS are lists of flags
srun --nodes "$NNODES" --ntasks-per-node "$TASKS_PER_NODE" --export=ALL \
    python pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS "$@"
