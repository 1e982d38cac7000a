"""A training step with all fusions on vs all off, measured in the same run.

    python benchmarks/bench_train_step.py [--iters 20] [--layers 4 --hidden 128 --seq 128 --batch 8]

"On": fused layer norm, `--attention-impl auto` (scaled_dot_product_attention for
causal attention), fused bias-GeLU / bias-dropout-add paths. "Off": the plain
PyTorch composition (`--attention-impl torch`, every `--no-*-fusion` flag).
Forward, backward and the optimizer step are timed; the two settings alternate
so that machine noise hits both alike. Prints the ratio off / on (> 1: fusions pay).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.config import ModelConfig  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.model.fused_kernels import load_fused_kernels  # noqa: E402
from megatron.mpu import model_parallel_seed  # noqa: E402


def build(args, fused: bool):
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, max_position_embeddings=args.seq, padded_vocab_size=args.vocab,
                      hidden_dropout=0.1, attention_dropout=0.1,
                      attention_impl="auto" if fused else "torch", masked_softmax_fusion=fused,
                      bias_gelu_fusion=fused, bias_dropout_fusion=fused, layer_norm_fusion=fused)
    model = GPTModel(cfg)
    model.init_weights(1234)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, tokens, positions):
    opt.zero_grad(set_to_none=True)
    model(tokens, positions, labels=tokens).mean().backward()
    opt.step()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8064)
    args = p.parse_args()
    model_parallel_seed(1234, 0)
    print(f"fused kernels built: {load_fused_kernels()} | threads: {torch.get_num_threads()}")
    runs = {True: build(args, True), False: build(args, False)}
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    positions = torch.arange(args.seq).expand(args.batch, args.seq)
    times = {True: [], False: []}
    for i in range(args.iters + 2):
        for fused in (True, False):
            start = time.perf_counter()
            step(*runs[fused], tokens, positions)
            if i >= 2:  # warm-up
                times[fused].append(time.perf_counter() - start)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"train step, fusions on : {1000 * on:8.2f} ms (median of {args.iters})")
    print(f"train step, fusions off: {1000 * off:8.2f} ms")
    print(f"ratio off/on: {off / on:.2f}x (target > 1.0)")


if __name__ == "__main__":
    main()
