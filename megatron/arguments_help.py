"""One line of `--help` text for every training flag (kept apart from the parser's wiring)."""

HELP = {
    "--use-mcore-models": "accepted for Megatron-LM scripts: there is one model implementation",
    "--no-position-embedding": "no learned absolute positions (rope/alibi stay as given)",
    "--overlap-param-gather": "accepted; the distributed optimizer gathers after the step",
    "--num-experts": "routed experts per MoE layer (turns MoE on)",
    "--moe-ffn-hidden-size": "inner width of each expert (default --ffn-hidden-size)",
    "--moe-layer-freq": "every N-th layer is MoE, or a 0/1 list such as ([0]*1+[1]*3)*8",
    "--moe-router-topk": "experts per token (default 2)",
    "--moe-router-score-function": "softmax (default) or sigmoid router scores",
    "--moe-router-pre-softmax": "softmax over all experts before top-k",
    "--moe-router-topk-scaling-factor": "multiply the top-k probabilities by this",
    "--moe-router-num-groups": "expert groups of group-limited routing",
    "--moe-router-group-topk": "groups each token may route to",
    "--moe-router-dtype": "fp32 or fp64 router gemm and routing",
    "--moe-router-load-balancing-type": "aux_loss (default), seq_aux_loss, sinkhorn or none",
    "--moe-aux-loss-coeff": "load-balancing loss coefficient (default 0)",
    "--moe-z-loss-coeff": "router z-loss coefficient (default off)",
    "--moe-router-enable-expert-bias": "aux-loss-free balancing with a per-expert routing bias",
    "--moe-router-bias-update-rate": "expert bias step per iteration (default 1e-3)",
    "--moe-expert-capacity-factor": "expert capacity factor (default dropless)",
    "--moe-token-drop-policy": "drop the lowest-probability (probs) or latest (position) tokens",
    "--moe-pad-expert-input-to-capacity": "pad each expert's input to its capacity",
    "--moe-shared-expert-intermediate-size": "width of the shared expert (default none)",
    "--moe-shared-expert-gate": "sigmoid gate on the shared expert's output (Qwen-MoE)",
    "--moe-grouped-gemm": "all local experts in one batched matmul",
    "--moe-token-dispatcher-type": "allgather (default) or alltoall token dispatch over EP",
    "--expert-model-parallel-size": "ranks that split the experts (carved out of DP)",
    "--expert-tensor-parallel-size": "ranks that split each expert (default TP)",
    # model
    "--num-layers": "transformer layers",
    "--hidden-size": "width of the residual stream",
    "--num-attention-heads": "attention heads per layer (divisible by TP)",
    "--seq-length": "tokens per training sample",
    "--max-position-embeddings": "rows of the learned position embedding (>= seq length)",
    "--ffn-hidden-size": "MLP inner width (default 4 x hidden size)",
    "--make-vocab-size-divisible-by": "pad the vocabulary to a multiple of this x TP (default 128)",
    "--layernorm-epsilon": "layer norm epsilon (default 1e-5)",
    "--init-method-std": "std of the normal init; output projections use std/sqrt(2 x layers)",
    "--hidden-dropout": "dropout on embeddings and each residual branch (default 0.1)",
    "--attention-dropout": "dropout on attention probabilities (default 0.1)",
    "--checkpoint-activations": "recompute layers in backward to save activation memory",
    "--checkpoint-num-layers": "layers per recomputed chunk (default 1)",
    "--recompute-granularity": "full (whole layers) or selective (attention core only)",
    "--use-cpu-initialization": "init full weights from the seed and slice them: same model at any TP/PP",
    "--attention-impl": "auto: SDPA for causal attention, fused softmax for masks; or force one",
    "--fused-kernels-choice": "where a fused kernel and a PyTorch path both apply: auto (time "
                              "both on this machine, cached, rank 0's choice for all ranks), "
                              "ours, plain, or rule (fixed rules, no timing); default "
                              "$MEGATRON_FUSED_KERNELS_CHOICE, else auto",
    "--attention-softmax-in-fp32": "compute the attention softmax in fp32 for 16-bit models",
    "--apply-query-key-layer-scaling": "scale q.k by 1/layer number (fp16 range), softmax in fp32",
    "--fp16-lm-cross-entropy": "compute the LM cross entropy in fp16 (default fp32)",
    "--no-masked-softmax-fusion": "use the plain PyTorch softmax",
    "--no-mask-vocab-padding": "let the vocabulary-padding rows count in the training loss, "
                               "as Megatron-LM does (by default they get probability 0)",
    "--no-bias-gelu-fusion": "use the plain PyTorch bias + GeLU",
    "--no-bias-dropout-fusion": "use the plain PyTorch bias + dropout + add",
    "--no-persist-layer-norm": "use torch.nn.functional.layer_norm (same as --no-layer-norm-fusion)",
    "--no-layer-norm-fusion": "use torch.nn.functional.layer_norm",
    # architecture (the model spec)
    "--position-embedding-type": "learned_absolute (GPT-2), rope (LLaMA), alibi (BLOOM), sinusoidal (fairseq) or none",
    "--use-rotary-position-embeddings": "same as --position-embedding-type rope",
    "--rotary-percent": "fraction of each head's channels that RoPE rotates, in (0, 1] (default 1)",
    "--rotary-base": "RoPE frequency base (default 10000; LLaMA-3 uses 500000)",
    "--rotary-seq-len-interpolation-factor": "divide positions by this before RoPE (>= 1)",
    "--rope-scaling-type": "RoPE frequency scaling: llama3 (LLaMA-3.1) or yarn (default none)",
    "--use-rope-scaling": "same as --rope-scaling-type llama3 (Megatron-LM's flag)",
    "--rope-scaling-factor": "context extension factor of llama3 / yarn (default 8)",
    "--rotary-scaling-factor": "same as --rope-scaling-factor",
    "--rope-scaling-low-freq-factor": "llama3: low-frequency factor (default 1)",
    "--rope-scaling-high-freq-factor": "llama3: high-frequency factor (default 4)",
    "--rope-scaling-original-max-position-embeddings":
        "llama3 / yarn: the context length of pretraining (default 8192)",
    "--yarn-beta-fast": "yarn: rotations above which frequencies are kept (default 32)",
    "--yarn-beta-slow": "yarn: rotations below which frequencies are interpolated (default 1)",
    "--no-yarn-correction-range-round-to-int":
        "yarn: keep the ramp's ends fractional (HF's truncate=false, gpt-oss)",
    "--yarn-attention-factor": "yarn: cos / sin multiplier (default 0.1 ln(factor) + 1)",
    "--multi-latent-attention": "DeepSeek's multi-latent attention (needs --position-embedding-type rope)",
    "--q-lora-rank": "MLA: rank of the compressed query (default none: no query compression)",
    "--kv-lora-rank": "MLA: rank of the compressed key / value latent (default 32)",
    "--qk-head-dim": "MLA: per-head query / key channels without position (default 128)",
    "--qk-pos-emb-head-dim": "MLA: per-head RoPE channels of the query and shared key (default 64)",
    "--v-head-dim": "MLA: per-head value channels (default 128)",
    "--mscale": "MLA with yarn: cos / sin magnitude mscale(f, mscale) / mscale(f, mscale-all-dim) (default 1)",
    "--mscale-all-dim": "MLA with yarn: softmax scale times mscale(f, mscale-all-dim)^2 (default 0)",
    "--context-parallel-size": "ranks that split each sequence (2·CP load-balanced chunks; default 1)",
    "--cp-comm-type": "attention across CP ranks: p2p (K/V ring, LSE merge) or a2a (Ulysses)",
    "--window-attn-skip-freq": "with --window-size: every N-th layer attends to all earlier "
                               "positions (gpt-oss 2, Gemma 3 6), or a 0/1 list such as "
                               "([1]*5+[0]*1)*8 (1 = sliding window, 0 = full)",
    "--rotary-base-local": "RoPE base of the sliding-window layers (Gemma 3: 10000; default "
                           "--rotary-base)",
    "--no-rope-freq": "layers without RoPE: every N-th layer, or a 0/1 list such as "
                      "([0]*3+[1]*1)*12 (1 = no RoPE; Llama 4's NoPE layers)",
    "--no-rope-scaling-local": "sliding-window layers do not divide their RoPE positions by "
                               "--rotary-seq-len-interpolation-factor (Gemma 3 scales its "
                               "global layers only)",
    "--window-size": "sliding-window attention: each query sees itself and the W - 1 "
                     "positions before it (Mistral's sliding_window; default: all)",
    "--rotary-interleaved": "RoPE on interleaved channel pairs (x[2i], x[2i+1]), as Llama 4's "
                            "complex rotation, instead of the two halves",
    "--qk-l2-norm": "L2-normalise queries and keys per head after RoPE, without weight, on the "
                    "RoPE layers (Llama 4's use_qk_norm; eps: --norm-epsilon)",
    "--attention-chunk-size": "chunked causal attention on the RoPE layers: query i sees key "
                              "j <= i only in the same chunk of N positions (Llama 4; NoPE "
                              "layers attend to all)",
    "--attn-temperature-tuning": "Llama 4: queries of the NoPE layers at position p times "
                                 "log(floor((p + 1) / floor-scale) + 1) x scale + 1",
    "--attn-temperature-floor-scale": "floor_scale of --attn-temperature-tuning (default 8192)",
    "--attn-temperature-scale": "attn_scale of --attn-temperature-tuning (default 0.1)",
    "--moe-apply-probs-on-input": "the router's weight scales the expert's input, not its "
                                  "output (Llama 4; needs --moe-router-topk 1)",
    "--softmax-type": "attention softmax: vanilla, off-by-one (a fixed 0 logit joins the "
                      "denominator) or learnable (a learned sink logit per head, gpt-oss)",
    "--normalization": "LayerNorm (GPT-2, BLOOM) or RMSNorm (LLaMA)",
    "--norm-epsilon": "epsilon of every norm (default 1e-5); same as --layernorm-epsilon",
    "--apply-layernorm-1p": "norm weights stored zero-centred, applied as 1 + w",
    "--qk-layernorm": "normalise queries and keys per head before attention",
    "--sandwich-norm": "also normalise the attention and MLP outputs before each residual add "
                       "(Gemma 2 / 3's post-attention and post-feedforward norms)",
    "--softmax-scale": "multiply q k^T by this before the softmax (default 1 / sqrt(kv channels); "
                       "Gemma 3: query_pre_attn_scalar ** -0.5)",
    "--embed-layernorm": "a norm right after the word embeddings (BLOOM)",
    "--scale-embeddings": "multiply the word embeddings by sqrt(hidden size) (fairseq's embed_scale)",
    "--exact-gelu": "the exact erf GeLU (fairseq's gelu) instead of the tanh approximation",
    "--swiglu": "gated SiLU MLP (LLaMA); same as --glu-activation swiglu",
    "--quick-geglu": "gated MLP with the quick GeLU x sigmoid(1.702 x) (gpt-oss); same as "
                     "--glu-activation quick_geglu",
    "--glu-linear-offset": "gated MLP: act(gate) * (up + this) (default 0; gpt-oss 1)",
    "--activation-func-clamp-value": "gated MLP: clamp gate to <= V and up to [-V, V] first "
                                     "(default: no clamp; gpt-oss 7)",
    "--glu-activation": "gated MLP activation: geglu, liglu, reglu or swiglu",
    "--openai-gelu": "OpenAI's tanh-approximated GeLU, unfused (the fused default computes the same)",
    "--squared-relu": "relu(x)^2 as the MLP activation",
    "--group-query-attention": "grouped-query attention: --num-query-groups key/value heads",
    "--num-query-groups": "key/value heads with --group-query-attention (1: multi-query)",
    "--kv-channels": "channels per attention head (default hidden size / heads)",
    "--add-qkv-bias": "keep the QKV bias with --disable-bias-linear (Qwen style)",
    "--disable-bias-linear": "no biases in the linear layers (LLaMA)",
    "--embedding-multiplier": "multiply the word embeddings by this (Gemma: sqrt(hidden size))",
    "--untie-embeddings-and-output-weights": "a separate output layer instead of the tied embeddings",
    "--mtp-num-layers": "multi-token prediction depths after the decoder (Megatron-Core's MTP "
                        "block; needs rope or no positions), on the last pipeline stage",
    "--mtp-loss-scaling-factor": "weight of the mean MTP loss in the training loss",
    "--pad-vocab-size-to": "pad the vocabulary to exactly this many rows (a multiple of TP)",
    # parallelism
    "--tensor-model-parallel-size": "ranks that split each layer (TP)",
    "--pipeline-model-parallel-size": "pipeline stages (PP); layers divisible by it unless a "
                                      "layout or uneven first/last stages say otherwise",
    "--num-layers-per-virtual-pipeline-stage": "layers per virtual stage: interleaved 1F1B",
    "--pipeline-model-parallel-layout": "every stage's layers, Megatron-LM's grammar: E "
                                        "embedding, t layer, m MTP layer, L loss, | stage "
                                        "boundary, (...)*N / X*N repetition, e.g. "
                                        "'Ett|(tt|)*2tL'; PP x VP stages (it sets VP)",
    "--decoder-first-pipeline-num-layers": "transformer layers of the first pipeline rank; "
                                           "the other ranks split the rest evenly",
    "--decoder-last-pipeline-num-layers": "transformer layers of the last pipeline rank; the "
                                          "other ranks split the rest evenly",
    "--sequence-parallel": "split layer norms and dropout along the sequence over TP",
    "--distributed-backend": "nccl or gloo (default: nccl with CUDA, else gloo)",
    "--DDP-impl": "local (bucketed all-reduce) or torch (DistributedDataParallel)",
    "--use-torch-fsdp2": "shard parameters, gradients and optimizer state over DP x CP with "
                         "torch's FSDP2 (each transformer layer one unit, MoE experts over "
                         "expert-DP)",
    "--fsdp-reshard-after-forward": "free gathered parameters after each unit's forward "
                                    "(the default, ZeRO-3-like)",
    "--no-fsdp-reshard-after-forward": "keep each unit's gathered parameters from its forward "
                                       "to its backward and across micro batches (ZeRO-2-"
                                       "like); Megatron-LM's "
                                       "--torch-fsdp2-no-reshard-after-forward is the same",
    "--use-distributed-optimizer": "shard fp32 main params and optimizer state over DP (ZeRO-1)",
    "--overlap-grad-reduce": "start each gradient bucket's all-reduce during backward",
    "--ddp-bucket-size": "elements per gradient bucket (default 40M); smaller buckets start "
                         "reducing sooner under --overlap-grad-reduce",
    "--accumulate-allreduce-grads-in-fp32": "accumulate and reduce gradients in fp32",
    "--local-rank": "set by torch.distributed.launch (torchrun uses LOCAL_RANK)",
    # training
    "--micro-batch-size": "samples per forward/backward on one rank",
    "--global-batch-size": "samples per optimizer step over all DP ranks",
    "--rampup-batch-size": "grow the global batch from START by INCR over SAMPLES samples",
    "--step-batch-size-schedule": "global batch as a step function of consumed tokens: "
                                  "\"0:16 2.4B:320\" (TOKENS may end in K, M, B, T; "
                                  "quoted or as separate words)",
    "--train-iters": "optimizer steps to train (or --train-samples)",
    "--train-samples": "samples to train on (or --train-iters)",
    "--seed": "random seed (default 1234)",
    "--eval-interval": "evaluate on the validation split every N iterations",
    "--eval-iters": "global batches per evaluation",
    "--exit-interval": "save (with --save) and stop when the iteration is a multiple of N",
    "--fp16": "fp16 model with fp32 main params and dynamic loss scaling",
    "--bf16": "bf16 model with fp32 main params",
    # optimizer
    "--optimizer": "adam (AdamW) or sgd",
    "--lr": "peak learning rate",
    "--min-lr": "learning rate at the end of the decay",
    "--lr-decay-style": "constant, linear, cosine or inverse-square-root",
    "--lr-decay-iters": "iterations of decay (default: train iters)",
    "--lr-decay-samples": "samples of decay (with --train-samples)",
    "--lr-warmup-fraction": "warm-up as a fraction of the decay length",
    "--lr-warmup-iters": "warm-up iterations",
    "--lr-warmup-samples": "warm-up samples",
    "--weight-decay": "decoupled weight decay on weight matrices (default 0.01)",
    "--clip-grad": "clip the global gradient norm to this (0: off; default 1.0)",
    "--adam-beta1": "Adam beta1 (default 0.9)",
    "--adam-beta2": "Adam beta2 (default 0.999)",
    "--adam-eps": "Adam epsilon (default 1e-8)",
    "--sgd-momentum": "SGD momentum (default 0.9)",
    "--loss-scale": "static fp16 loss scale (default: dynamic)",
    "--initial-loss-scale": "first dynamic loss scale (default 2^32)",
    "--min-loss-scale": "lower bound of the dynamic loss scale",
    "--loss-scale-window": "clean steps before the scale doubles (default 1000)",
    "--hysteresis": "overflowing steps tolerated before the scale halves (default 2)",
    # data
    "--data-path": "preprocessed prefix, or weight prefix weight prefix ... to blend",
    "--split": "train,valid,test weights over documents (default 969,30,1)",
    "--tokenizer-type": "GPT2BPETokenizer, PretrainedFromHF / HuggingFaceTokenizer, SentencePieceTokenizer, "
                        "GPTSentencePieceTokenizer, Llama2Tokenizer, Llama3Tokenizer, NullTokenizer "
                        "or ByteLevelTokenizer",
    "--tokenizer-model": "SentencePiece .model or tiktoken BPE file (Llama3Tokenizer), or the local "
                         "directory of HuggingFaceTokenizer",
    "--vocab-file": "GPT-2 vocab.json",
    "--merge-file": "GPT-2 merges.txt",
    "--tokenizer-name-or-path": "local Hugging Face tokenizer directory (PretrainedFromHF)",
    "--data-cache-path": "where sample-index caches go (default: beside the data)",
    "--vocab-size": "vocabulary size for the NullTokenizer",
    "--dataloader-type": "single (ordered, resumable) or cyclic (reshuffled epochs)",
    "--num-workers": "data loader worker processes (default 2)",
    "--eod-mask-loss": "no loss on end-of-document tokens",
    "--reset-position-ids": "restart position ids after each end-of-document token",
    "--reset-attention-mask": "no attention across end-of-document tokens",
    # checkpoints
    "--save": "checkpoint directory to write",
    "--load": "checkpoint directory to resume from",
    "--save-interval": "save every N iterations",
    "--no-save-optim": "leave the optimizer state out of checkpoints",
    "--no-save-rng": "leave the RNG states out of checkpoints",
    "--no-load-optim": "do not restore the optimizer state",
    "--no-load-rng": "do not restore the RNG states",
    "--finetune": "load weights only and start counting from zero",
    # logging
    "--log-interval": "print the training log line every N iterations",
    "--tensorboard-dir": "write TensorBoard scalars here",
    "--tensorboard-queue-size": "TensorBoard writer queue size",
    "--timing-log-level": "0: iteration time; 1: + forward/backward/optimizer; 2: + communication",
    "--log-batch-size-to-tensorboard": "also log the global batch size",
    "--log-validation-ppl-to-tensorboard": "also log the validation perplexity",
    "--log-timers-to-tensorboard": "also log the per-phase timers",
    # reliability
    "--exit-signal-handler": "on SIGTERM, finish the iteration, save (with --save) and exit 0",
    "--exit-duration-in-mins": "save and stop once the run has lasted this many minutes",
    "--kill-switch-path": "save and stop when this file appears",
    "--check-for-nan-in-loss-and-grad": "stop at the first non-finite loss or gradient, naming it",
    "--max-consecutive-nan-iterations": "stop (exit 1) after this many nan/inf iterations in a row "
                                        "(default 10; 0: never)",
    "--distributed-timeout-minutes": "collective timeout; a silent peer ends the run (default 10)",
    "--ckpt-format": "torch: one file per model-parallel rank; torch_dist: Megatron-Core's "
                     "torch.distributed.checkpoint shards, re-sharded to any layout at load; "
                     "torch_dcp: Megatron-LM's plain torch.distributed.checkpoint of the "
                     "model's state dict, re-sharded alike",
    "--auto-detect-ckpt-format": "at --load, read the format found on disk instead of --ckpt-format",
    "--async-save": "write checkpoints in the background from a CPU copy (any --ckpt-format)",
    "--no-verify-checkpoint": "do not check the checksums of a checkpoint at --load",
    # Megatron-LM / Megatron-DeepSpeed compatibility
    "--recompute-activations": "Megatron-LM's selective recompute (attention core only)",
    "--recompute-method": "with --recompute-granularity full: uniform (chunks of "
                          "--recompute-num-layers) or block (the first N layers of each stage)",
    "--recompute-num-layers": "layers per recomputed chunk (uniform) or recomputed layers (block)",
    "--no-query-key-layer-scaling": "no 1/layer-number scaling of q.k (the default here)",
    "--use-flash-attn": "fused attention: same as --attention-impl sdpa",
    "--attention-backend": "Megatron-LM's name: flash -> sdpa, fused -> fused, unfused/local -> "
                           "torch, auto -> auto (--attention-impl)",
    "--data-impl": "mmap or infer (mmap is the only format; lazy/cached need re-preprocessing)",
    "--train-weighted-split-paths": "\"NAME: W START:END PREFIX, ...\": the train split blends "
                                    "these document ranges (Megatron-DeepSpeed)",
    "--valid-weighted-split-paths": "the same for the validation split",
    "--test-weighted-split-paths": "the same for the test split",
    "--mock-data": "random tokens instead of --data-path: benchmark a layout without data",
    "--separate-last-epoch-threshold": "shuffle the last epoch apart when it is used for less "
                                       "than this fraction (0.80 Megatron-LM, 0.95 Megatron-DeepSpeed)",
    "--log-params-norm": "add the parameters' L2 norm to the log line",
    "--log-num-zeros-in-grad": "add the number of zero gradient entries to the log line",
    "--train-tokens": "stop after this many tokens (caps --train-iters / --train-samples)",
    "--skip-train-iteration-range": "START-END ...: consume and drop these iterations' batches",
    "--lr-decay-tokens": "decay the learning rate over this many tokens",
    "--override-opt_param-scheduler": "on resume, the lr schedule comes from the flags",
    "--override-lr-scheduler": "same as --override-opt_param-scheduler",
    "--use-checkpoint-opt_param-scheduler": "on resume, the lr schedule comes from the checkpoint",
    "--use-checkpoint-lr-scheduler": "same as --use-checkpoint-opt_param-scheduler",
    "--universal-checkpoint": "load a checkpoint saved at another TP/PP layout by re-sharding it",
    "--deepspeed": "accepted: DeepSpeed launch lines run on our own ZeRO-1 optimizer",
    "--deepspeed_config": "DeepSpeed JSON whose batch, clipping, precision and ZeRO keys map onto flags",
    "--zero-stage": "0: regular optimizer, 1 or 2: --use-distributed-optimizer, 3: unsupported",
    "--deepspeed-activation-checkpointing": "accepted (activation checkpointing follows the recompute flags)",
    "--partition-activations": "accepted (activation checkpointing follows the recompute flags)",
    "--log-throughput": "TFLOP/s per device, tokens/s and MFU on every log line and to TensorBoard",
    "--torch-compile": "torch.compile each transformer layer (off by default; compiles on the first step)",
    "--peak-flops": "peak TFLOP/s of one device for MFU (default: a matmul probe at start-up)",
}
