"""Our training step against two peers, interleaved in one run.

    python benchmarks/bench_train_step.py [--reps 5] [--layers 4 --hidden 256 --heads 8 --seq 256
                                           --batch 8 --vocab 8064] [--device cuda --bf16] [--fusions]

- ours: the step `pretrain_gpt.py` runs, built the same way (its flags, model
  provider, forward step and `Trainer`): forward, backward, gradient handling,
  global-norm clipping (1.0) and the AdamW update of the fp32 main parameters;
- transformers: `GPT2LMHeadModel` of the same size;
- minimal: a nanoGPT-style GPT written below (SDPA attention, F.cross_entropy,
  torch.optim.AdamW, fused on GPUs, foreach on CPUs).
The peers also clip to 1.0 and use that AdamW (on CPUs torch's per-tensor fused AdamW
measured slower than foreach here, so the peers get the faster one). All run at the same size,
dtype, batch and thread count and dropout (`--dropout`, default 0); with --bf16 ours keeps bf16 weights
and fp32 main parameters, the peers run under bf16 autocast. Each repetition
times `--steps` steps of every contender in turn, so that machine noise hits all
alike; the medians over repetitions are compared. `--fusions` adds our step with
every fusion off (`--attention-impl torch`, the `--no-*-fusion` flags).
Prints ms per step, tokens/s, the ratios peer / ours (> 1: ours is faster) and
our MFU against a matmul of the MLP's shape on the same threads and dtype.
"""
import argparse
import gc
import math
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import isa_env  # noqa: E402,F401  (before torch: MEGATRON_CPU_ISA holds torch's kernels too)
import torch  # noqa: E402

import bench_json  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.fused import kernels as fused_kernels  # noqa: E402
from megatron.mpu import model_parallel_seed, single_process_state  # noqa: E402
from megatron.training.flops import matmul_rate, model_flops  # noqa: E402
from megatron.training.parallelize import build_model  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402

NO_FUSIONS = ["--attention-impl", "torch", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
              "--no-bias-dropout-fusion", "--no-layer-norm-fusion"]
TARGETS = {"transformers": 1.3, "minimal": 1.1}


# -- ours ------------------------------------------------------------------------
def our_flags(args, extra=()):
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
            "--max-position-embeddings", str(args.seq), "--micro-batch-size", str(args.batch),
            "--global-batch-size", str(args.batch), "--train-iters", "1000000", "--lr", "1e-4",
            "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
            "--clip-grad", "1.0",
            *(["--bf16"] if args.bf16 else []), *args.our_flags.split(), *extra]


def build_ours(args, text, extra=()):
    """pretrain_gpt.py's step: its flags, model provider, forward step and Trainer."""
    config, _ = parse_args(our_flags(args, extra), world_size=1, required=pretrain_gpt.REQUIRED)
    config.model.padded_vocab_size = args.vocab
    pstate, device = single_process_state(), torch.device(args.device)
    model_parallel_seed(config.training.seed, 0)
    models = build_model(config, pstate, device,
                                partial(pretrain_gpt.model_provider, config, pstate.tp_group))
    trainer = Trainer(config, pstate, device, models,
                      partial(pretrain_gpt.forward_step, config, args.vocab - 1, pstate, device))
    batches = [iter(lambda: {"text": text}, None)]
    return config, lambda: trainer.train_step(batches)


# -- peers -----------------------------------------------------------------------
class MinimalBlock(torch.nn.Module):
    def __init__(self, h, heads, dropout):
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.c_attn, self.c_proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.c_fc, self.mlp_proj = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))

    def forward(self, x):
        drop = partial(F.dropout, p=self.p, training=self.training)
        x = x + drop(self.attention(self.ln_1(x)))
        return x + drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class MinimalGPT(torch.nn.Module):
    """A whole GPT-2 in the nanoGPT style: [b, s] tokens -> mean cross entropy."""

    def __init__(self, layers, h, heads, seq, vocab, dropout=0.0):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, h), torch.nn.Embedding(seq, h)
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList(MinimalBlock(h, heads, dropout) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(h)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                torch.nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def transformers_gpt2(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                     n_layer=args.layers, n_head=args.heads, resid_pdrop=args.dropout,
                     embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(cfg)
    # GPT-2 shifts the labels itself: its labels are the input tokens.
    return lambda tokens, labels: model(input_ids=tokens, labels=tokens).loss, model


def minimal_gpt(args):
    model = MinimalGPT(args.layers, args.hidden, args.heads, args.seq, args.vocab, args.dropout)
    return model, model


def build_peer(args, text, make):
    """A plain PyTorch step: forward, backward, clip to 1.0, AdamW (weight decay on matrices)."""
    loss_fn, model = make(args)
    model.to(args.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    cuda = torch.device(args.device).type == "cuda"
    opt = torch.optim.AdamW(groups, lr=1e-4, **({"fused": True} if cuda else {"foreach": True}))
    tokens, labels = (t.contiguous().to(args.device) for t in (text[:, :-1], text[:, 1:]))
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16)

    def step():
        with autocast:
            loss = loss_fn(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# -- timing ----------------------------------------------------------------------
def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, steps, device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - start) / steps


def interleaved(steps_by_name, args):
    """Median seconds per step of each contender over `args.reps` interleaved repetitions."""
    times = {name: [] for name in steps_by_name}
    for step in steps_by_name.values():  # warm-up
        time_steps(step, args.warmup, args.device)
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.reps):
            for name, step in steps_by_name.items():
                times[name].append(time_steps(step, args.steps, args.device))
    finally:
        gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def profile(steps_by_name, rows: int, device="cpu") -> None:
    """torch.profiler's operator table (self time; on CUDA, self CUDA time) of one step of
    each contender."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, step in steps_by_name.items():
        step()
        sync(device)
        with torch_profile(activities=activities) as prof:
            step()
            sync(device)
        print(f"--- {name}")
        print(prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    p.add_argument("--steps", type=int, default=2, help="steps per repetition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8064)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout of every contender")
    p.add_argument("--peers", default="transformers,minimal",
                   help="comma list of peers to time beside ours (transformers, minimal; '' for none)")
    p.add_argument("--fusions", action="store_true", help="also time our step with every fusion off")
    p.add_argument("--our-flags", default="", help="extra pretrain_gpt.py flags for our step")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print torch.profiler's top ROWS operators of one step of each contender")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON (bench_json.py)")
    args = p.parse_args(argv)
    args.peers = [name for name in args.peers.split(",") if name]
    return args


def report(args, config, medians) -> dict:
    """Print the results; return them (ms per step, ratios peer / ours, TFLOP/s, MFU)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tokens = args.batch * args.seq
    for name, sec in medians.items():
        print(f"{name:>20}: {1000 * sec:9.2f} ms/step  {tokens / sec:10.0f} tokens/s")
    ours = medians["ours"]
    for name in args.peers:
        target = TARGETS[name]
        ratio = medians[name] / ours
        print(f"ours / {name}: {ratio:.2f}x faster (target >= {target}x: "
              f"{'met' if ratio >= target else 'NOT met'})")
    if "ours, fusions off" in medians:
        print(f"fusions on / off: {medians['ours, fusions off'] / ours:.2f}x faster")
    probe = matmul_rate(args.device, dtype, (tokens, args.hidden, 4 * args.hidden), seconds=1.0)
    achieved = model_flops(config.model, args.batch) / ours
    print(f"ours: {achieved / 1e12:.4g} TFLOP/s, matmul probe [{tokens}x{args.hidden}]x"
          f"[{args.hidden}x{4 * args.hidden}] {probe / 1e12:.4g} TFLOP/s: MFU {100 * achieved / probe:.1f}%")
    return {"ms_per_step": {name: 1000 * sec for name, sec in medians.items()},
            "ratios": {name: medians[name] / ours for name in args.peers},
            "targets": {name: TARGETS[name] for name in args.peers},
            "tflops": achieved / 1e12, "probe_tflops": probe / 1e12, "mfu": achieved / probe}


def main(argv=None):
    args = parse(argv)
    torch.manual_seed(1234)
    text = torch.randint(0, args.vocab - 1, (args.batch, args.seq + 1))
    print(f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"micro batch {args.batch}, vocab {args.vocab}, dropout {args.dropout}, "
          f"{'bf16' if args.bf16 else 'fp32'}, "
          f"{args.device}, threads {torch.get_num_threads()}, median of {args.reps} x {args.steps} steps")
    print(fused_kernels.cpu_description())
    config, ours = build_ours(args, text)
    steps = {"ours": ours}
    if args.fusions:
        steps["ours, fusions off"] = build_ours(args, text, NO_FUSIONS)[1]
    makers = {"transformers": transformers_gpt2, "minimal": minimal_gpt}
    for name in args.peers:
        steps[name] = build_peer(args, text, makers[name])
    if args.profile:
        return profile(steps, args.profile, args.device)
    results = report(args, config, interleaved(steps, args))
    size = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab",
                                          "dropout", "reps", "steps", "device", "our_flags")}
    bench_json.write(args.json, "train_step", dtype="bf16" if args.bf16 else "fp32",
                     config=size, **results)


if __name__ == "__main__":
    main()
