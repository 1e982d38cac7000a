"""Speed of the fused CPU/CUDA kernels against plain PyTorch, same run.

    python benchmarks/bench_fused.py [--threads 2] [--repeat 10] [--compile]
                                    [--only {softmax,layer_norm,rms_norm,bias_gelu,cross_entropy,
                                             attention,attention_dropout,attention_sinks,
                                             attention_window}]
                                    [--min-seq N] [--max-seq N] [--long] [--json PATH]
                                    [--attention-dtypes float32,bfloat16]

CPU (float32, torch.set_num_threads(threads) for both sides):
  - causal softmax forward+backward on [32, 512, 512]: fused kernel vs
    scale + masked_fill + softmax (target: >= 1.5x);
  - layer norm forward+backward on [8192, 1024], [4096, 512] and [2048, 256], float32 and
    bfloat16: our kernel vs F.layer_norm (target: >= 1x; where it misses, the default must
    take F.layer_norm);
  - RMSNorm forward+backward on [8192, 1024], float32 and bfloat16: fused vs the
    plain path (float32 arithmetic, as Hugging Face's LlamaRMSNorm; target: >= 1x);
  - bias_gelu forward+backward on [2048, 4096]: plain vs our kernel (target: >= 1.5x),
    and vs TorchScript (and torch.compile with --compile);
  - the GPT head (output matmul + cross entropy) forward+backward, [2048, 256] x
    [256, 8064], float32 and bfloat16: F.linear + F.cross_entropy vs linear_cross_entropy
    (target: >= 1.1x);
  - causal self-attention forward+backward (seq 256 / head_dim 32, seq 512, 1024, 2048 and
    4096 / head_dim 64; with --long also 8192 and 16384, 5 samples each), float32 and
    bfloat16: SDPA vs our kernel (target: >= 1.1x), and with attention dropout 0.1 the
    explicit path (what auto runs without our kernel) vs our kernel; in bfloat16, where the
    kernel has both, its two ways to the products: our AVX512-BF16 dot products vs oneDNN's
    microkernels (brgemm: AMX tiles on a CPU with AMX-BF16), the line auto's
    "attention_products" decision answers;
  - the same with attention sinks (gpt-oss) and with sliding windows of 128 and 1024 keys
    (gpt-oss, Gemma 3), seq 1024, 2048 and 4096 (bfloat16: 1024 only): SDPA with the
    equivalent mask (sinks as one more key with a zero value, what auto runs without our
    kernel; the window as SDPA's boolean mask, where auto's alternative is the explicit
    path) vs our kernel, which skips the key blocks before each row's window.
Every CPU line ends with the path the default takes for those inputs (`auto: fused` or
`auto: plain`) and whether it is the faster one in this run (`faster`, `SLOWER`, or `tie`
when the two are within 10% of each other, as close as repeated runs here agree). The
default is `--fused-kernels-choice`'s, from $MEGATRON_FUSED_KERNELS_CHOICE (auto unless set):
auto's own short timing of the two paths for that line's dtype and shape bucket, or its
cached answer (megatron/fused/choice.py; the header names the cache file).
CUDA (when available): fp16/bf16 causal softmax, layer norm and RMSNorm vs PyTorch,
with the achieved bandwidth against a device-to-device copy.
Timings interleave the two sides and take medians, so both see the same load; each sample
repeats a short step until it lasts 5 ms.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import bench_json
import isa_env  # noqa: F401  (before torch: MEGATRON_CPU_ISA holds torch's kernels too)
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron import fused  # noqa: E402
from megatron.fused import choice  # noqa: E402
from megatron.fused import kernels as fused_kernels  # noqa: E402
from megatron.fused.attention import bf16_brgemm, brgemm_preferred  # noqa: E402
from megatron.fused.norms import norm_decision  # noqa: E402
from megatron.mpu import model_parallel_seed  # noqa: E402


def timeit(fn, repeat: int, warmup: int = 2, sync=None) -> float:
    """Median seconds per call of fn() over `repeat` samples."""
    return compare([fn], repeat, warmup, sync)[0]


# Each sample runs a step often enough to take at least this long: a single 0.3 ms step
# varied by 20% from one call to the next here, more than the gap between two paths.
MIN_SAMPLE_S = 0.005


def compare(fns, repeat: int, warmup: int = 2, sync=None) -> list[float]:
    """Median seconds per call of each fn over `repeat` samples, running them in turn so that
    both see the same load; a sample is as many calls as fill MIN_SAMPLE_S."""
    def sample(fn, calls):
        if sync:
            sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        return (time.perf_counter() - start) / calls

    for _ in range(warmup - 1):
        for fn in fns:
            fn()
    calls = max(1, math.ceil(MIN_SAMPLE_S / min(sample(fn, 1) for fn in fns)))
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, bucket in zip(fns, times):
            bucket.append(sample(fn, calls))
    return [statistics.median(t) for t in times]


def softmax_step(x, grad, fusion: bool):
    def run():
        xr = x.detach().requires_grad_()
        y = fused.attention_softmax(xr, scale=0.125, causal=True, fusion=fusion)
        y.backward(grad)
    return run


def layer_norm_step(x, w, b, grad, fusion):
    """fusion: False (F.layer_norm), True (what fused.layer_norm picks) or "kernel"."""
    def run():
        xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
        if fusion == "kernel":
            y = fused.fused_layer_norm(xr, wr, br, 1e-5)
        else:
            y = fused.layer_norm(xr, wr, br, 1e-5, fusion=fusion)
        y.backward(grad)
    return run


def rms_norm_step(x, w, grad, fusion: bool):
    def run():
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = fused.rms_norm(xr, wr, 1e-5, fusion=fusion)
        y.backward(grad)
    return run


# [tokens, hidden] of the layer norm lines: the benchmark's own shape, hidden 512 at 4096 tokens,
# and bench_train_step's default (seq 256 x batch 8 tokens, hidden 256).
LAYER_NORM_SHAPES = ((8192, 1024), (4096, 512), (2048, 256))

# Two paths within this factor of each other are a tie: runs on this shared machine drift more.
TIE = 1.10


# Every line report() printed, for --json: its name, labels, times, speed-up, target, auto's
# path and verdict, and the `fields` its caller gave (attention: seq, batch, heads, ...).
ROWS: list[dict] = []


def report(name: str, times: list[float], target: float | None = None,
           auto_fused: bool | None = None, labels=("plain", "fused"), **fields) -> None:
    """One line: both times (named `labels`), the speed-up against the target, and
    (auto_fused given) which path the default (`fusion=True` / `--attention-impl auto`) takes
    for these inputs and whether that is the faster one in this run."""
    t_plain, t_fused = times
    ratio = t_plain / t_fused
    goal = f" (target >= {target:.1f}x: {'ok' if ratio >= target else 'MISSED'})" if target else ""
    auto, verdict = "", None
    if auto_fused is not None:
        faster = (t_fused <= t_plain) == auto_fused
        verdict = ("faster" if faster else
                   "tie" if max(ratio, 1 / ratio) < TIE else "SLOWER")
        auto = f"  auto: {'fused' if auto_fused else 'plain'} ({verdict})"
    ROWS.append({"name": name, "labels": list(labels), "ms": [1e3 * t_plain, 1e3 * t_fused],
                 "speedup": ratio, "target": target, "verdict": verdict,
                 "auto": None if auto_fused is None else "fused" if auto_fused else "plain",
                 **fields})
    print(f"{name:<44} {labels[0]} {t_plain * 1e3:8.2f} ms  {labels[1]} {t_fused * 1e3:8.2f} ms  "
          f"speed-up {ratio:5.2f}x{goal}{auto}")


def bench_cpu(repeat: int, only: str | None) -> None:
    torch.manual_seed(0)
    if only in (None, "softmax"):
        x = torch.randn(32, 1, 512, 512)
        g = torch.randn_like(x)
        report("CPU causal softmax fwd+bwd [32,512,512] f32",
               compare([softmax_step(x, g, False), softmax_step(x, g, True)], repeat), 1.5,
               fused.softmax_kernel_for(x, True) is not None)
    for rows, cols in LAYER_NORM_SHAPES if only in (None, "layer_norm") else ():
        x, w, b, g = torch.randn(rows, cols), torch.randn(cols), torch.randn(cols), torch.randn(
            rows, cols)
        for dtype in (torch.float32, torch.bfloat16):  # the kernel itself against F.layer_norm
            xs, ws, bs, gs = (t.to(dtype) for t in (x, w, b, g))
            report(f"CPU layer norm fwd+bwd [{rows},{cols}] {str(dtype)[6:]}",
                   compare([layer_norm_step(xs, ws, bs, gs, False),
                            layer_norm_step(xs, ws, bs, gs, "kernel")], repeat), 1.0,
                   fused.layer_norm_preferred(xs, ws, bs))
    x = torch.randn(8192, 1024)
    w, g = torch.randn(1024), torch.randn(8192, 1024)
    for dtype in (torch.float32, torch.bfloat16):
        xs, ws, gs = (t.to(dtype) for t in (x, w, g))
        if only in (None, "rms_norm"):
            report(f"CPU RMSNorm fwd+bwd [8192,1024] {str(dtype)[6:]}",
                   compare([rms_norm_step(xs, ws, gs, False), rms_norm_step(xs, ws, gs, True)],
                           repeat), 1.0, fused.rms_norm_fusable(xs, ws)
                   and choice.prefer_ours(norm_decision("rms_norm", xs)))


def _bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.gelu(y + bias, approximate="tanh")


def bench_bias_gelu(repeat: int, with_compile: bool) -> None:
    y = torch.randn(2048, 4096)
    bias = torch.randn(4096)
    g = torch.randn_like(y)

    def step(fn):
        def run():
            yr, br = y.detach().requires_grad_(), bias.detach().requires_grad_()
            fn(br, yr).backward(g)
        return run

    report("CPU bias_gelu fwd+bwd [2048,4096] f32",
           compare([step(_bias_gelu), step(fused.bias_gelu)], repeat, warmup=3), 1.5,
           fused.bias_gelu_fusable(y, bias))
    # peers of the plain path, not our kernel: eager PyTorch against TorchScript / torch.compile
    report("CPU bias_gelu fwd+bwd [2048,4096]: TorchScript",
           compare([step(_bias_gelu), step(torch.jit.script(_bias_gelu))], repeat, warmup=3),
           labels=("eager", "TorchScript"))
    if with_compile:
        report("CPU bias_gelu fwd+bwd [2048,4096]: torch.compile",
               compare([step(_bias_gelu), step(torch.compile(_bias_gelu))], repeat, warmup=3),
               labels=("eager", "compiled"))


def bench_cross_entropy(repeat: int) -> None:
    """The GPT head: output matmul + cross entropy, fused in place (pooled logits buffer)
    vs F.linear + F.cross_entropy (float32 loss, as Megatron takes bfloat16 logits),
    forward+backward, in float32 and bfloat16."""
    from megatron.mpu.cross_entropy import LogitsBuffers, linear_cross_entropy
    target = torch.randint(0, 8064, (2048,))
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(2048, 256).to(dtype)
        weight = (torch.randn(8064, 256) * 0.02).to(dtype)
        buffers = LogitsBuffers()

        def step(fused_head):
            def run():
                h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
                if fused_head:
                    loss = linear_cross_entropy(h, w, target, buffers=buffers)
                else:
                    loss = F.cross_entropy(F.linear(h, w).float(), target, reduction="none")
                loss.mean().backward()
            return run

        report("CPU head matmul + cross entropy fwd+bwd [2048,256]x[256,8064] "
               + ("f32" if dtype == torch.float32 else "bf16"),
               compare([step(False), step(True)], repeat), 1.1, True)


ATTENTION_SHAPES = ((256, 8, 8, 32), (512, 4, 8, 64), (1024, 2, 16, 64), (2048, 1, 16, 64),
                    (4096, 1, 8, 64))
# With --long: minutes on two cores (each step is seconds), so fewer samples (LONG_REPEAT).
LONG_ATTENTION_SHAPES = ((8192, 1, 4, 64), (16384, 1, 2, 64))
LONG_REPEAT = 5


def bench_attention(repeat: int, dropout: float, max_seq: int = None, long: bool = False,
                    min_seq: int = None, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Causal self-attention forward+backward from the views of a fused QKV projection: our
    CPU kernel against what auto runs otherwise, SDPA without dropout, and with dropout
    the explicit path (fused softmax and dropout; SDPA with dropout on a CPU is unfused
    math with Bernoulli sampling)."""
    from megatron.config import ModelConfig
    from megatron.model.attention import CoreAttention
    shapes = ATTENTION_SHAPES + (LONG_ATTENTION_SHAPES if long else ())
    for dtype, (s, b, heads, dim) in ((d, shape) for d in dtypes for shape in shapes):
        if (max_seq is not None and s > max_seq) or (min_seq is not None and s < min_seq):
            continue
        qkv = torch.randn(s, b, heads, 3 * dim, dtype=dtype)
        grad = torch.randn(s, b, heads * dim, dtype=dtype)
        cfg = ModelConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                          seq_length=s, max_position_embeddings=s, padded_vocab_size=64,
                          attention_dropout=dropout, attention_impl="fused")
        explicit = CoreAttention(cfg, 1).train()

        def step(kernel, brgemm=None):
            def run():
                x = qkv.detach().requires_grad_()
                q, k, v = x.split(dim, dim=-1)
                if kernel:
                    out = fused.causal_attention(q, k, v, dim ** -0.5, dropout, 1234,
                                                 brgemm=brgemm)
                elif dropout:  # its dropout runs in the tracker's fork
                    out = explicit._explicit(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                             None, None)
                    out = out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)
                else:
                    out = F.scaled_dot_product_attention(
                        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
                    out = out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)
                out.backward(grad)
            return run

        q = qkv[..., :dim]
        other = "explicit" if dropout else "SDPA"
        samples = min(repeat, LONG_REPEAT) if s > ATTENTION_SHAPES[-1][0] else repeat
        report(f"CPU causal attention fwd+bwd {str(dtype)[6:]} s{s} b{b} h{heads} d{dim} "
               f"dropout {dropout}: "
               f"{other} vs ours", compare([step(False), step(True)], samples), 1.1,
               fused.causal_attention_preferred(q, q, q, dropout), kernel="attention", seq=s,
               batch=b, heads=heads, head_dim=dim, dropout=dropout, dtype=str(dtype)[6:])
        if dtype == torch.bfloat16 and bf16_brgemm():  # the kernel's two ways to its products
            report(f"CPU attention products fwd+bwd bfloat16 s{s} b{b} h{heads} d{dim} "
                   f"dropout {dropout}: dot vs brgemm",
                   compare([step(True, False), step(True, True)], samples), None,
                   brgemm_preferred(q, dropout), labels=("dot", "brgemm"),
                   kernel="attention_products", seq=s, batch=b, heads=heads, head_dim=dim,
                   dropout=dropout, dtype="bfloat16")


def sdpa_masked(q, k, v, window=None, sinks=None):
    """SDPA of q, k, v [s, b, heads, d] -> [s, b, heads * d] with the mask equivalent to a
    sliding window (boolean) or with sinks (one more key with a zero value, its score the sink:
    what auto runs without our kernel there; a window it gives the explicit path)."""
    from megatron.fused.attention import future_keys, outside_window
    from megatron.fused.sinks import sdpa_with_sinks
    s, b, heads, d = q.shape
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    hidden = future_keys(s, s, q.device) if window is None else outside_window(s, s, window,
                                                                                 q.device)
    if sinks is not None:
        out = sdpa_with_sinks(qh, kh, vh, hidden, sinks)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=~hidden)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


VARIANT_SHAPES = ((1024, 2, 16, 64), (2048, 1, 16, 64), (4096, 1, 8, 64))
WINDOWS = (128, 1024)


def bench_attention_variants(repeat: int, sinks: bool, max_seq: int = None,
                             dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Attention sinks (sinks) or sliding windows (else), forward+backward from the views of
    a fused QKV projection: our kernel against SDPA with the equivalent mask (`sdpa_masked`)."""
    variants = [(None, True)] if sinks else [(w, False) for w in WINDOWS]
    for dtype, (s, b, heads, dim), (window, with_sinks) in (
            (d, shape, v) for d in dtypes for shape in VARIANT_SHAPES for v in variants):
        if (max_seq is not None and s > max_seq) or (dtype == torch.bfloat16 and s > 1024):
            continue  # bfloat16 SDPA with a mask is unfused math: 26 s a step at s1024 here
        if window is not None and window >= s:
            continue  # hides no key: plain causal attention (--only attention)
        qkv = torch.randn(s, b, heads, 3 * dim, dtype=dtype)
        grad = torch.randn(s, b, heads * dim, dtype=dtype)
        logits = torch.randn(heads, dtype=dtype) if with_sinks else None

        def step(kernel):
            def run():
                x = qkv.detach().requires_grad_()
                q, k, v = x.split(dim, dim=-1)
                w = None if logits is None else logits.detach().requires_grad_()
                out = (fused.causal_attention(q, k, v, dim ** -0.5, 0.0, None, w, window)
                       if kernel else sdpa_masked(q, k, v, window, w))
                out.backward(grad)
            return run

        q = qkv[..., :dim]
        what = "sinks" if with_sinks else f"window {window}"
        other = "SDPA+sinks" if with_sinks else "SDPA+mask"
        report(f"CPU attention {what} fwd+bwd {str(dtype)[6:]} s{s} b{b} h{heads} d{dim}: "
               f"{other} vs ours", compare([step(False), step(True)], repeat), 1.0,
               fused.causal_attention_preferred(q, q, q, 0.0, window, with_sinks),
               kernel="attention", seq=s, batch=b, heads=heads, head_dim=dim, dropout=0.0,
               dtype=str(dtype)[6:], window=window, sinks=with_sinks)


def bench_cuda(repeat: int) -> None:
    sync = torch.cuda.synchronize
    x = torch.randn(64, 1, 2048, 2048, device="cuda")
    t_copy = timeit(lambda: torch.empty_like(x).copy_(x), repeat, sync=sync)
    copy_bw = 2 * x.numel() * x.element_size() / t_copy
    print(f"CUDA device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    for dtype in (torch.float16, torch.bfloat16):
        xs = x.to(dtype)
        g = torch.randn_like(xs)
        fwd = [lambda f=f: fused.attention_softmax(xs, scale=0.125, causal=True, fusion=f)
               for f in (False, True)]
        times = compare(fwd, repeat, sync=sync)
        report(f"CUDA causal softmax fwd {dtype}", times)
        bw = 2 * xs.numel() * xs.element_size() / times[1]  # read scores, write probs
        print(f"    fused forward {bw / 1e9:.0f} GB/s = {bw / copy_bw:.0%} of copy")
        report(f"CUDA causal softmax fwd+bwd {dtype}",
               compare([softmax_step(xs, g, False), softmax_step(xs, g, True)], repeat,
                       sync=sync))
        xl = torch.randn(32768, 4096, device="cuda", dtype=dtype)
        w, b = torch.randn(4096, device="cuda", dtype=dtype), torch.zeros(4096, device="cuda",
                                                                         dtype=dtype)
        gl = torch.randn_like(xl)
        report(f"CUDA layer norm fwd+bwd [32768,4096] {dtype}",
               compare([layer_norm_step(xl, w, b, gl, False),
                        layer_norm_step(xl, w, b, gl, "kernel")], repeat, sync=sync), None,
               fused.layer_norm_preferred(xl, w, b))
        report(f"CUDA RMSNorm fwd+bwd [32768,4096] {dtype}",
               compare([rms_norm_step(xl, w, gl, False), rms_norm_step(xl, w, gl, True)],
                       repeat, sync=sync))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--only", choices=("softmax", "layer_norm", "rms_norm", "bias_gelu",
                                           "cross_entropy", "attention", "attention_dropout",
                                           "attention_sinks", "attention_window", "cuda"),
                        help="time one CPU benchmark only (CUDA ones run in full); cuda: the "
                             "CUDA ones alone")
    parser.add_argument("--attention-dtypes", default="float32,bfloat16",
                        help="the dtypes attention is timed in, comma-separated")
    parser.add_argument("--min-seq", type=int, default=None,
                        help="time attention from this sequence length on only (with --long: "
                             "the long lengths alone)")
    parser.add_argument("--max-seq", type=int, default=None,
                        help="time attention up to this sequence length only (a smoke test)")
    parser.add_argument("--long", action="store_true",
                        help="time attention at s8192 and s16384 too (minutes on two cores)")
    parser.add_argument("--json", metavar="PATH", help="also write every line as JSON "
                        "(bench_json.py)")
    args = parser.parse_args()
    names = args.attention_dtypes.split(",")
    if not set(names) <= {"float32", "bfloat16"}:
        parser.error(f"--attention-dtypes {args.attention_dtypes}: choose from float32, bfloat16")
    dtypes = [getattr(torch, name) for name in names]
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if not fused_kernels.load_fused_kernels(verbose=False):
        print("fused kernels unavailable; nothing to compare")
    print(f"kernels loaded in {time.perf_counter() - start:.2f} s, threads={args.threads}")
    print(fused_kernels.cpu_description())
    print(f"kernel choice: {choice.mode()} (megatron/fused/choice.py), cache {choice.cache_path()}")
    if args.only != "cuda":
        bench_cpu(args.repeat, args.only)
    if args.only in (None, "bias_gelu"):
        bench_bias_gelu(args.repeat, args.compile)
    if args.only in (None, "cross_entropy"):
        bench_cross_entropy(args.repeat)
    if args.only in (None, "attention"):
        bench_attention(args.repeat, 0.0, args.max_seq, args.long, args.min_seq, dtypes)
    if args.only in (None, "attention_dropout"):
        model_parallel_seed(1234, 0)
        bench_attention(args.repeat, 0.1, args.max_seq, args.long, args.min_seq, dtypes)
    if args.only in (None, "attention_sinks"):
        bench_attention_variants(args.repeat, True, args.max_seq, dtypes)
    if args.only in (None, "attention_window"):
        bench_attention_variants(args.repeat, False, args.max_seq, dtypes)
    if torch.cuda.is_available() and fused_kernels.fused_kernels_available("cuda"):
        bench_cuda(args.repeat)
    elif args.only == "cuda":
        print("--only cuda: no CUDA device, or the CUDA kernels are not built; nothing timed")
    bench_json.write(args.json, "fused", repeat=args.repeat, rows=ROWS)


if __name__ == "__main__":
    main()
