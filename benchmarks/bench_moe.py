"""Time one MoE training step (forward, backward, AdamW): ours (grouped GEMM and the
per-expert loop) against transformers' MixtralForCausalLM and a minimal plain-PyTorch
MoE (a loop over experts), interleaved, at the same size.

    python benchmarks/bench_moe.py [--runs 3] [--steps 5] [--threads 2]

Size: 8 experts, top 2, 4 layers, hidden 256 (8 heads, 4 key/value groups), expert
width 512, seq 256, micro batch 2, vocabulary 1024, fp32. Prints the median step time
of each and ours' speed-up over the others per run.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

E, K, LAYERS, H, HEADS, GROUPS, FFN, SEQ, BATCH, VOCAB = 8, 2, 4, 256, 8, 4, 512, 256, 2, 1024


def ours(grouped: bool):
    from megatron.config import ModelConfig, MoEConfig
    from megatron.model import GPTModel
    moe = MoEConfig(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FFN,
                    moe_grouped_gemm=grouped, moe_aux_loss_coeff=1e-2)
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS,
                      group_query_attention=True, num_query_groups=GROUPS, seq_length=SEQ,
                      max_position_embeddings=SEQ, padded_vocab_size=VOCAB, activation="swiglu",
                      normalization="RMSNorm", position_embedding_type="rope",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True,
                      hidden_dropout=0.0, attention_dropout=0.0, moe=moe)
    model = GPTModel(cfg)
    model.init_weights(1234)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    return model, lambda tokens: model(tokens, pos, labels=tokens).mean()


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN,
                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        num_key_value_heads=GROUPS, num_local_experts=E, num_experts_per_tok=K,
                        max_position_embeddings=SEQ, tie_word_embeddings=False,
                        output_router_logits=True, router_aux_loss_coef=1e-2)
    model = MixtralForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model, lambda tokens: model(tokens, labels=tokens).loss


class LoopMoE(torch.nn.Module):
    """The textbook MoE block: softmax router, top-k, a loop over SwiGLU experts."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.w1 = torch.nn.ModuleList(torch.nn.Linear(H, 2 * FFN, bias=False) for _ in range(E))
        self.w2 = torch.nn.ModuleList(torch.nn.Linear(FFN, H, bias=False) for _ in range(E))

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(K, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = (index == e).nonzero(as_tuple=True)
            gate, up = self.w1[e](x[token]).chunk(2, -1)
            out.index_add_(0, token, self.w2[e](F.silu(gate) * up) * weights[token, slot, None])
        return out


class LoopBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(H), torch.nn.RMSNorm(H)
        self.attn = torch.nn.MultiheadAttention(H, HEADS, batch_first=True, bias=False)
        self.moe = LoopMoE()
        self.mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        b, s, _ = x.shape
        return x + self.moe(self.norm2(x).reshape(b * s, H)).view(b, s, H)


def plain():
    layers = torch.nn.Sequential(*(LoopBlock() for _ in range(LAYERS)))
    emb, head = torch.nn.Embedding(VOCAB, H), torch.nn.Linear(H, VOCAB, bias=False)
    model = torch.nn.ModuleList([emb, layers, head])

    def loss(tokens):
        logits = head(layers(emb(tokens)))
        return F.cross_entropy(logits.view(-1, VOCAB), tokens.view(-1))
    return model, loss


def step_time(model, loss_fn, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        loss_fn(tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    candidates = {"ours (grouped GEMM)": ours(True), "ours (expert loop)": ours(False),
                  "transformers Mixtral": mixtral(), "plain loop MoE": plain()}
    for run in range(args.runs):
        times = {name: step_time(m, f, args.steps) for name, (m, f) in candidates.items()}
        best = times["ours (grouped GEMM)"]
        print(f"run {run + 1}: " + " | ".join(f"{n}: {1000 * t:.1f} ms" for n, t in times.items())
              + f" | speed-up vs Mixtral {times['transformers Mixtral'] / best:.2f}x, "
              f"vs plain {times['plain loop MoE'] / best:.2f}x", flush=True)


if __name__ == "__main__":
    main()
