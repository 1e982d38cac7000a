"""A tiny fairseq `transformer_lm` checkpoint written by hand, with its dict.txt and GPT-2
byte-level BPE files: what tools/convert_checkpoint.py --from fairseq reads, without fairseq
and without ../shared data (a fresh clone's tests use it)."""
import json
import os

import torch

from megatron.tokenizer.gpt2_bpe import EOD_TOKEN, bytes_to_unicode

LAYERS, HIDDEN, HEADS, FFN, POSITIONS = 2, 32, 4, 64, 32
SYMBOLS = list(range(32, 127))
"""The dictionary's GPT-2 ids: printable ASCII bytes (ids 4.. of the model's rows)."""


def write_bpe(directory: str):
    """(vocab.json, merges.txt): GPT-2's 256 byte symbols and <|endoftext|>, no merges."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab[EOD_TOKEN] = 256
    paths = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return paths


def _decoder(rows: int, generator) -> dict:
    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.05
    sd = {"decoder.version": torch.tensor([3.0]), "decoder.embed_tokens.weight": rand(rows, HIDDEN)}
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        for proj in ("q", "k", "v", "out"):
            sd[f"{p}self_attn.{proj}_proj.weight"] = rand(HIDDEN, HIDDEN)
            sd[f"{p}self_attn.{proj}_proj.bias"] = rand(HIDDEN)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            sd[f"{p}{norm}.weight"] = 1 + rand(HIDDEN)
            sd[f"{p}{norm}.bias"] = rand(HIDDEN)
        sd[p + "fc1.weight"], sd[p + "fc1.bias"] = rand(FFN, HIDDEN), rand(FFN)
        sd[p + "fc2.weight"], sd[p + "fc2.bias"] = rand(HIDDEN, FFN), rand(HIDDEN)
    sd["decoder.layer_norm.weight"], sd["decoder.layer_norm.bias"] = 1 + rand(HIDDEN), rand(HIDDEN)
    sd["decoder.output_projection.weight"] = sd["decoder.embed_tokens.weight"]
    return sd


def write_checkpoint(directory: str, seed: int = 0) -> str:
    """<directory>/model.pt and <directory>/dict.txt; returns the model.pt path."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "dict.txt"), "w", encoding="utf-8") as f:
        f.writelines(f"{s} {1000 - i}\n" for i, s in enumerate(SYMBOLS))
    model = {"_name": "transformer_lm", "decoder_normalize_before": True,
             "decoder_attention_heads": HEADS, "decoder_embed_dim": HIDDEN,
             "decoder_input_dim": HIDDEN, "decoder_output_dim": HIDDEN,
             "activation_fn": "gelu", "dropout": 0.0, "attention_dropout": 0.0,
             "share_decoder_input_output_embed": True, "max_target_positions": POSITIONS}
    cfg = {"common": {"model_parallel_size": 1}, "task": {"tokens_per_sample": POSITIONS},
           "model": model}
    state = {"args": None, "cfg": cfg,
             "model": _decoder(4 + len(SYMBOLS), torch.Generator().manual_seed(seed)),
             "optimizer_history": [], "extra_state": {}, "last_optimizer_state": None}
    path = os.path.join(directory, "model.pt")
    torch.save(state, path)
    return path
