# Sourced by pretrain_qwen2.5_7b.sh and pretrain_qwen3_8b.sh (not run on its own): the
# launch and the flags the dense Qwen presets share (RoPE base 1e6, RMSNorm eps 1e-6,
# SwiGLU, untied embeddings, no linear biases, Qwen's schedule, bf16, the distributed
# optimizer), after the preset's MODEL_ARGS (layout and shape) and before the caller's "$@".
torchrun --nproc_per_node 8 --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py "${MODEL_ARGS[@]}" \
    --position-embedding-type rope --rotary-base 1000000 \
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02 \
    --micro-batch-size 1 --global-batch-size 512 \
    --train-iters 100000 --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --checkpoint-activations \
    --data-path $DATA --split 99,1,0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
