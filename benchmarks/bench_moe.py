"""Our MoE training step against transformers' MixtralForCausalLM and a minimal plain-PyTorch
MoE (a loop over experts), interleaved in one run, at the same size.

    python benchmarks/bench_moe.py [--reps 5] [--steps 2] [--threads 2] [--loop] [--profile ROWS]
    python benchmarks/bench_moe.py --gemm   # one layer's expert matmuls by each grouped-GEMM path
    python benchmarks/bench_moe.py --deepseek [--mtp]   # DeepSeek-style, against DeepseekV3

Size: 8 experts, top 2 (a softmax over the two best logits), 4 layers, hidden 256 (8 heads,
4 key/value groups, RoPE, RMSNorm), SwiGLU experts of width 512, seq 256, micro batch 2,
vocabulary 1024, fp32, a load-balancing loss (coefficient 1e-2), no dropout. Every
contender does the same step: forward, backward, clipping to 1.0 and AdamW (weight decay
0.01 on matrices).

- ours: the step `pretrain_gpt.py` runs with these flags (bench_train_step's `build_ours`:
  its model provider, forward step and `Trainer`), `--moe-grouped-gemm` on;
- ours, expert loop (`--loop`): the same without `--moe-grouped-gemm` (the reference loop);
- transformers: `MixtralForCausalLM` (SDPA attention, its router loss on);
- minimal: the MoE below, written the plain way (one nn.Linear per projection, SDPA,
  a Python loop over experts with index_add), and torch's foreach AdamW.
Prints the median ms per step over `--reps` interleaved repetitions of `--steps` steps and
the ratios peer / ours (> 1: ours is faster). `--gemm` times, interleaved, the forward and
backward of one layer's SwiGLU experts (the rows a random router sends them) by the
reference loop, one `torch.bmm` over rows padded to the largest expert, `torch._grouped_mm`,
our `GroupedLinear` around the activation (what `--moe-grouped-gemm` runs with biases or
other activations) and our SwiGLU experts kernel (csrc/fused/moe_cpu.cpp: each expert's
whole chain on one thread, experts over threads), which is what `--moe-grouped-gemm` runs
here.

`--deepseek` times a DeepSeek-V3-style model of the same size instead, against transformers'
`DeepseekV3ForCausalLM` with the same shape (SDPA attention, its default): multi-latent attention (query rank 128, KV rank 64, qk
head 32 + 16 RoPE channels, value head 32), the first layer dense (SwiGLU 512), then 8
experts of width 256 + 1 shared, sigmoid top 2 over 4 groups keeping 1 with an expert bias
and routed scaling 2.5, no auxiliary loss (DeepSeek-V3 balances with the bias). transformers
has no MTP in its training forward; `--mtp` adds ours as well (one depth), timed beside.
"""
import argparse
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train_step as bts  # noqa: E402  (imports isa_env before torch)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench_json  # noqa: E402

E, K, LAYERS, H, HEADS, GROUPS, FFN, SEQ, BATCH, VOCAB = 8, 2, 4, 256, 8, 4, 512, 256, 2, 1024
AUX, ROPE_BASE = 1e-2, 10000.0
TARGETS = {"transformers": 1.3, "minimal": 1.3}

OUR_FLAGS = (f"--num-experts {E} --moe-router-topk {K} --moe-ffn-hidden-size {FFN} "
             f"--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff {AUX} "
             f"--group-query-attention --num-query-groups {GROUPS} --swiglu "
             f"--normalization RMSNorm --position-embedding-type rope --no-position-embedding "
             f"--rotary-base {int(ROPE_BASE)} --disable-bias-linear "
             f"--untie-embeddings-and-output-weights")


DEEPSEEK = dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=32, n_group=4, topk_group=1, scaling=2.5, shared=1)
DEEPSEEK_FLAGS = (
    f"--multi-latent-attention --q-lora-rank {DEEPSEEK['q_lora_rank']} "
    f"--kv-lora-rank {DEEPSEEK['kv_lora_rank']} --qk-head-dim {DEEPSEEK['qk_nope_head_dim']} "
    f"--qk-pos-emb-head-dim {DEEPSEEK['qk_rope_head_dim']} --v-head-dim {DEEPSEEK['v_head_dim']} "
    f"--num-experts {E} --moe-router-topk {K} --moe-ffn-hidden-size {FFN // 2} "
    f"--ffn-hidden-size {FFN} --moe-layer-freq [0]+[1]*{LAYERS - 1} "
    f"--moe-shared-expert-intermediate-size {DEEPSEEK['shared'] * FFN // 2} "
    f"--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    f"--moe-router-num-groups {DEEPSEEK['n_group']} "
    f"--moe-router-group-topk {DEEPSEEK['topk_group']} "
    f"--moe-router-topk-scaling-factor {DEEPSEEK['scaling']} "
    f"--moe-router-load-balancing-type none --moe-grouped-gemm --swiglu "
    f"--normalization RMSNorm --position-embedding-type rope --no-position-embedding "
    f"--rotary-base {int(ROPE_BASE)} --disable-bias-linear --untie-embeddings-and-output-weights")


def bench_args(extra: str = "") -> SimpleNamespace:
    """The arguments bench_train_step's builders take, at this benchmark's size."""
    return SimpleNamespace(layers=LAYERS, hidden=H, heads=HEADS, seq=SEQ, batch=BATCH,
                           vocab=VOCAB, dropout=0.0, bf16=False, device="cpu",
                           our_flags=f"{OUR_FLAGS} {extra}")


# -- peers -----------------------------------------------------------------------
def mixtral(args):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN,
                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        num_key_value_heads=GROUPS, num_local_experts=E, num_experts_per_tok=K,
                        max_position_embeddings=SEQ, rope_theta=ROPE_BASE,
                        tie_word_embeddings=False, output_router_logits=True,
                        router_aux_loss_coef=AUX)
    model = MixtralForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    # Mixtral shifts the labels itself: its labels are the input tokens.
    return lambda tokens, labels: model(input_ids=tokens, labels=tokens).loss, model


def deepseek_v3(args):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    d = DEEPSEEK
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, moe_intermediate_size=FFN // 2,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        n_shared_experts=d["shared"], n_routed_experts=E, num_experts_per_tok=K,
        n_group=d["n_group"], topk_group=d["topk_group"], routed_scaling_factor=d["scaling"],
        first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        max_position_embeddings=SEQ, rope_theta=ROPE_BASE, tie_word_embeddings=False,
        attention_dropout=0.0)
    model = DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                               dtype=torch.float32)
    return lambda tokens, labels: model(input_ids=tokens, labels=tokens).loss, model


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class MinimalMoE(torch.nn.Module):
    """Softmax router, top-k renormalised, a loop over SwiGLU experts; the Switch loss."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.gate_up = torch.nn.ModuleList(torch.nn.Linear(H, 2 * FFN, bias=False) for _ in range(E))
        self.down = torch.nn.ModuleList(torch.nn.Linear(FFN, H, bias=False) for _ in range(E))

    def forward(self, x):
        probs = torch.softmax(self.router(x), -1)
        weights, index = probs.topk(K, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = (index == e).nonzero(as_tuple=True)
            gate, up = self.gate_up[e](x[token]).chunk(2, -1)
            out.index_add_(0, token, self.down[e](F.silu(gate) * up) * weights[token, slot, None])
        load = F.one_hot(index, E).sum((0, 1)).float() / (x.shape[0] * K)
        return out, E * (load * probs.mean(0)).sum()


class MinimalBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(H, eps=1e-5), torch.nn.RMSNorm(H, eps=1e-5)
        self.qkv = torch.nn.Linear(H, H + 2 * GROUPS * (H // HEADS), bias=False)
        self.proj = torch.nn.Linear(H, H, bias=False)
        self.moe = MinimalMoE()

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        d = H // HEADS
        q, k, v = self.qkv(self.norm1(x)).split([H, GROUPS * d, GROUPS * d], -1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                           is_causal=True, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, H))
        out, aux = self.moe(self.norm2(x).view(b * s, H))
        return x + out.view(b, s, H), aux


class MinimalMoEGPT(torch.nn.Module):
    """[b, s] tokens -> mean cross entropy + the load-balancing loss of every layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, H)
        self.blocks = torch.nn.ModuleList(MinimalBlock() for _ in range(LAYERS))
        self.norm = torch.nn.RMSNorm(H, eps=1e-5)
        self.head = torch.nn.Linear(H, VOCAB, bias=False)
        d = H // HEADS
        freq = ROPE_BASE ** (-torch.arange(0, d, 2).float() / d)
        angle = torch.outer(torch.arange(SEQ).float(), freq).repeat(1, 2)
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)

    def forward(self, tokens, labels):
        x, aux = self.embed(tokens), 0.0
        for block in self.blocks:
            x, layer_aux = block(x, self.cos, self.sin)
            aux = aux + layer_aux
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1)) + AUX * aux


def minimal(args):
    model = MinimalMoEGPT()
    return model, model


# -- the experts' matmuls alone ------------------------------------------------------
def gemm_paths():
    """f(rows, w1, w2, counts) of the ways to run the experts' two projections."""
    from megatron.model.moe.experts import GroupedLinear, SwiGLUExperts, swiglu_kernel

    def act(h):
        gate, up = h.chunk(2, -1)
        return F.silu(gate) * up

    def padded_bmm(x, w1, w2, counts):
        width = max(counts)
        padded = torch.stack([F.pad(r, (0, 0, 0, width - r.shape[0])) for r in x.split(counts)])
        y = torch.bmm(act(torch.bmm(padded, w1.transpose(1, 2))), w2.transpose(1, 2))
        return torch.cat([y[e, :c] for e, c in enumerate(counts)])

    def grouped_mm(x, w1, w2, counts):
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
        return torch._grouped_mm(act(h), w2.transpose(1, 2), offs=offs)

    def grouped_linear(x, w1, w2, counts):
        return GroupedLinear.apply(act(GroupedLinear.apply(x, w1, counts)), w2, counts)

    def loop(x, w1, w2, counts):
        return torch.cat([F.linear(act(F.linear(r, w1[e])), w2[e])
                          for e, r in enumerate(x.split(counts))])
    paths = {"expert loop": loop, "padded torch.bmm": padded_bmm,
             "GroupedLinear": grouped_linear}
    if hasattr(torch, "_grouped_mm"):
        paths["torch._grouped_mm"] = grouped_mm
    if swiglu_kernel(torch.zeros(1)) is not None:
        paths["SwiGLU kernel (ours)"] = lambda x, w1, w2, counts: SwiGLUExperts.apply(
            x, w1, w2, counts)
    return paths


def time_gemm(args) -> None:
    """Forward + backward of one layer's experts (the rows a random router sends them,
    tokens of one micro batch x top 2), each path interleaved; weight gradients land in a
    gradient buffer as in training (ours adds them there itself; the others' are added)."""
    import statistics
    import time
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * SEQ, H, generator=gen)
    index = (x @ torch.randn(H, E, generator=gen) * 0.02).topk(K, -1).indices
    counts = torch.bincount(index.flatten(), minlength=E).tolist()
    rows = x[index.flatten().argsort(stable=True) // K]  # sorted by expert
    w1 = torch.nn.Parameter(torch.randn(E, 2 * FFN, H, generator=gen) * 0.02)
    w2 = torch.nn.Parameter(torch.randn(E, H, FFN, generator=gen) * 0.02)

    def into_buffer(param):  # what the data-parallel reducer's hook does
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None
    for w in (w1, w2):
        w.main_grad = torch.zeros_like(w)
        w.register_post_accumulate_grad_hook(into_buffer)
    grad_out = torch.randn(rows.shape[0], H, generator=gen)
    times = {name: [] for name in gemm_paths()}
    for rep in range(args.reps + 1):
        for name, fn in gemm_paths().items():
            leaf = rows.clone().requires_grad_()
            start = time.perf_counter()
            for _ in range(args.steps):
                fn(leaf, w1, w2, counts).backward(grad_out)
            if rep:
                times[name].append((time.perf_counter() - start) / args.steps)
    print(f"one layer's experts, forward + backward: {rows.shape[0]} rows, counts {counts}")
    for name, t in times.items():
        print(f"{name:>22}: {1000 * statistics.median(t):7.2f} ms")


def time_deepseek(args, text) -> None:
    """--deepseek: ours (and with --mtp one MTP depth) against DeepseekV3ForCausalLM."""
    print(f"DeepSeek-V3-style: {LAYERS} layers (the first dense), hidden {H}, {HEADS} MLA heads, "
          f"{E} experts top {K} + 1 shared, seq {SEQ}, micro batch {BATCH}, fp32, threads "
          f"{torch.get_num_threads()}, median of {args.reps} x {args.steps} steps; "
          f"{bench_json.machine()}")
    base = SimpleNamespace(**{**vars(bench_args()), "our_flags": DEEPSEEK_FLAGS})
    print("ours: pretrain_gpt.py " + " ".join(bts.our_flags(base)))
    steps = {"ours": bts.build_ours(base, text)[1]}
    if args.mtp:
        steps["ours + MTP"] = bts.build_ours(base, text, ("--mtp-num-layers", "1"))[1]
    steps["transformers"] = bts.build_peer(base, text, deepseek_v3)
    if args.profile:
        return bts.profile(steps, args.profile)
    medians = bts.interleaved(steps, SimpleNamespace(reps=args.reps, steps=args.steps,
                                                     warmup=args.warmup, device="cpu"))
    for name, sec in medians.items():
        print(f"{name:>20}: {1000 * sec:8.1f} ms/step")
    ratio = medians["transformers"] / medians["ours"]
    print(f"ours / transformers DeepseekV3: {ratio:.2f}x faster (target >= 1.3x: "
          f"{'met' if ratio >= 1.3 else 'NOT met'})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def report(args, medians) -> None:
    """Print ms per step and the ratios peer / ours; with --json, write them too."""
    for name, sec in medians.items():
        print(f"{name:>20}: {1000 * sec:8.1f} ms/step")
    for name, target in TARGETS.items():
        ratio = medians[name] / medians["ours"]
        print(f"ours / {name}: {ratio:.2f}x faster (target >= {target}x: "
              f"{'met' if ratio >= target else 'NOT met'})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    bench_json.write(args.json, "moe", dtype="fp32",
                     config={"experts": E, "topk": K, "layers": LAYERS, "hidden": H, "seq": SEQ,
                             "batch": BATCH, "reps": args.reps, "steps": args.steps},
                     ms_per_step={name: 1000 * sec for name, sec in medians.items()},
                     ratios={name: medians[name] / medians["ours"] for name in TARGETS},
                     targets=TARGETS)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    p.add_argument("--steps", type=int, default=2, help="steps per repetition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--loop", action="store_true", help="also time ours without --moe-grouped-gemm")
    p.add_argument("--gemm", action="store_true",
                   help="time only the experts' matmuls of one layer, by each grouped-GEMM path")
    p.add_argument("--deepseek", action="store_true",
                   help="a DeepSeek-V3-style model against transformers' DeepseekV3ForCausalLM")
    p.add_argument("--mtp", action="store_true", help="with --deepseek: ours with one MTP depth too")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print torch.profiler's top ROWS operators of one step of each contender")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON (bench_json.py)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gemm:
        return time_gemm(args)
    torch.manual_seed(1234)
    text = torch.randint(0, VOCAB - 1, (BATCH, SEQ + 1))
    if args.deepseek:
        return time_deepseek(args, text)
    print(f"{E} experts, top {K}, {LAYERS} layers, hidden {H}, expert width {FFN}, seq {SEQ}, "
          f"micro batch {BATCH}, vocab {VOCAB}, fp32, threads {torch.get_num_threads()}, "
          f"median of {args.reps} x {args.steps} steps; load {os.getloadavg()[0]:.2f}")
    ours = bench_args("--moe-grouped-gemm")
    print("ours: pretrain_gpt.py " + " ".join(bts.our_flags(ours)))
    steps = {"ours": bts.build_ours(ours, text)[1]}
    if args.loop:
        steps["ours, expert loop"] = bts.build_ours(bench_args(), text)[1]
    for name, make in (("transformers", mixtral), ("minimal", minimal)):
        steps[name] = bts.build_peer(bench_args(), text, make)
    if args.profile:
        return bts.profile(steps, args.profile)
    medians = bts.interleaved(steps, SimpleNamespace(reps=args.reps, steps=args.steps,
                                                     warmup=args.warmup, device="cpu"))
    report(args, medians)


if __name__ == "__main__":
    main()
