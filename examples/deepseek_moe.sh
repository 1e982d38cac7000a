# Sourced by pretrain_deepseek_v3.sh and pretrain_deepseek_v2_lite.sh (not run on its own):
# the launch (NODES nodes of 8 GPUs) and the flags the DeepSeek presets share (MLA with qk
# head 128 + 64 RoPE channels and value head 128, YaRN factor 40 over 4096 positions, RoPE
# base 10000, RMSNorm eps 1e-6, SwiGLU, untied embeddings, no linear biases, fp32 router,
# grouped GEMM, alltoall dispatch, the distributed optimizer, bf16), after the preset's
# MODEL_ARGS (layout, shape, routing and schedule) and before the caller's "$@".
torchrun --nproc_per_node 8 --nnodes "${NNODES:-$NODES}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py "${MODEL_ARGS[@]}" \
    --multi-latent-attention --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 \
    --seq-length 4096 --max-position-embeddings 163840 \
    --position-embedding-type rope --rotary-base 10000 \
    --rope-scaling-type yarn --rope-scaling-factor 40 \
    --rope-scaling-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1 \
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --hidden-dropout 0 --attention-dropout 0 \
    --moe-router-dtype fp32 --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
    --use-distributed-optimizer --micro-batch-size 1 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --bf16 --recompute-granularity selective \
    --data-path $DATA --split 99,1,0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
