"""Our per-rank files merged into a whole model, and a whole model cut for another layout.

The source layout (TP, PP, EP and virtual pipeline chunks) is read from the checkpoint's
directory names and files (`read_source`). Every tensor-parallel shard set is merged into
full tensors by the sharding metadata saved in the checkpoint ("sharding": each
parameter's split dimension and row grouping, including the gated MLP's [gate; up] rows
and grouped-query QKV layouts; see megatron/mpu/sharding.py) (`full_model`). Checkpoints
saved before the metadata existed are read with the split rule of GPT-2's parameters:

    word embeddings (and the last stage's head copy)   rows (dim 0, vocabulary)
    attention query_key_value, mlp dense_h_to_4h       rows (dim 0), weight and bias
    attention dense, mlp dense_4h_to_h                 columns (dim 1), weight only
    everything else (layer norms, biases of row-parallel layers, positions)  replicated

`cut` splits full tensors again for a target TP (and expert TP) and redistributes the layers
over the target pipeline stages with local indices (embeddings on the first stage, final
layer norm, output layer and head copy on the last). The padded vocabulary is kept, so it
must divide by the target TP. `write_sharded` writes the result as our torch format, model
only (no optimizer or RNG state) with the iteration, consumed samples and the updated
config, under a temporary directory renamed when complete, then the tracker; the input is
only read. The torch format's `read_model` / `write_model` are these functions, and so the
front door's conversions and --universal-checkpoint are too.
"""
import os
import re
import shutil
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import torch

from megatron.checkpointing import experts as ep_files
from megatron.checkpointing.io import save_file
from megatron.checkpointing.model_file import (MODEL_FILE, from_megatron_layout, is_chunk_key,
                                               read_model_file, to_megatron_layout)
from megatron.checkpointing.tracker import CHECKPOINT_VERSION, iteration_dir, write_tracker
from megatron.files import publish
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu.sharding import check_shardable, merge_shards, shard_tensor
from megatron.pipeline.layout import PipelineLayout, layout_of_counts, pipeline_layout

WORD = "language_model.embedding.word_embeddings.weight"
HEAD = "word_embeddings_for_head.weight"
MTP = "mtp.layers."
OUTPUT = "language_model.output_layer."
FINAL_NORM = "language_model.encoder.final_layernorm."
LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
SPLIT_BY_ROWS = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                 "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
SPLIT_BY_COLUMNS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")

Flat = Dict[str, torch.Tensor]
EVEN_SPLIT = {"num_layers_per_virtual_pipeline_stage": None, "pipeline_model_parallel_layout": None,
              "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None}
"""The parallel config fields of a re-sharded checkpoint's even, one-chunk split."""


class ReshardError(RuntimeError):
    """The checkpoint or target layout cannot be re-sharded; the message says why."""


def legacy_partition_dim(name: str) -> Optional[int]:
    """The split dimension of a GPT-2 parameter `name` in a checkpoint saved without
    sharding metadata (None: replicated)."""
    if name in (WORD, HEAD):
        return 0
    match = LAYER.match(name)
    if match:
        if match.group(2) in SPLIT_BY_ROWS:
            return 0
        if match.group(2) in SPLIT_BY_COLUMNS:
            return 1
    return None


def _meta_key(name: str) -> str:
    """Layers share their metadata: key it by the name inside the layer."""
    match = LAYER.match(name)
    return f"layers.{match.group(2)}" if match else name


class Sharding:
    """Each parameter's sharding metadata, from the checkpoint (or the legacy table)."""

    def __init__(self, saved: Dict[str, dict]):
        self.saved = {_meta_key(name): meta for name, meta in saved.items()}

    def __call__(self, name: str) -> dict:
        meta = self.saved.get(_meta_key(name))
        if meta is not None:
            return meta
        return {"dim": legacy_partition_dim(name), "groups": 1}

    def to_dict(self, names) -> Dict[str, dict]:
        return {name: self(name) for name in names}


# -- reading the source -----------------------------------------------------------
@dataclass
class Source:
    """All rank files of one checkpoint, keyed by (tp_rank, pp_rank)."""

    iteration: int
    release: bool
    tp: int
    pp: int
    states: Dict[Tuple[int, int], dict]
    """With expert parallelism, each state holds the experts of all EP ranks (experts.py),
    cut over TP like the dense tensors (whatever the saved expert TP)."""
    ep: int = 1
    etp: Optional[int] = None
    """The expert TP the checkpoint was saved with (None: TP)."""

    @cached_property
    def sharding(self) -> Sharding:
        """Every rank file's saved metadata (read once; the states do not change)."""
        saved: Dict[str, dict] = {}
        for state in self.states.values():
            saved.update(state.get("sharding") or {})
        return Sharding(saved)


def find_rank_dirs(directory: str) -> Dict[Tuple[int, int], str]:
    found = {}
    for name in sorted(os.listdir(directory)):
        match = RANK_DIR.match(name)
        if match and os.path.isfile(os.path.join(directory, name, MODEL_FILE)):
            found[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(
                directory, name, MODEL_FILE)
    return found


def _expert_files(directory: str) -> Tuple[int, Dict[Tuple[int, int, int], str]]:
    """(EP size, {(tp, pp, ep rank): file}) when the checkpoint was saved with EP > 1."""
    names = sorted(n for n in os.listdir(directory) if ep_files.RANK_DIR.match(n)
                   and os.path.isfile(os.path.join(directory, n, MODEL_FILE)))
    if not names:
        return 1, {}
    saved = read_model_file(os.path.join(directory, names[0], MODEL_FILE),
                            mmap=True).get("parallel", {})
    ep, pp = saved.get("expert_model_parallel_size", 1), saved.get("pipeline_model_parallel_size", 1)
    if ep == 1:
        return 1, {}
    ranks = {ep_files.rank_of_dir(n, pp, ep): os.path.join(directory, n, MODEL_FILE)
             for n in names}
    return ep, {rank: path for rank, path in ranks.items() if rank is not None}


def _expert_cell(files, t: int, p: int, e: int, etp: int, tp: int):
    """The file holding EP rank e's experts at expert-TP rank t mod ETP (TP rank t's own
    when it was saved; with ETP < TP any TP rank of the same expert-TP rank)."""
    for u in [t] + list(range(t % etp, tp, etp)):
        if (u, p, e) in files:
            return files[(u, p, e)]
    return None


def _merge_expert_states(files: Dict[Tuple[int, int, int], str], ep: int, directory: str,
                         etp: int, tp: int):
    """{(tp, pp): state} with every EP rank's experts (cut at expert-TP rank tp mod ETP)
    and the dense shard of its TP rank."""
    states, read = {}, {}

    def load(path):
        if path not in read:
            read[path] = read_model_file(path, mmap=True)
        return read[path]

    for t, p in sorted({(t, p) for t, p, _ in files}):
        paths = [_expert_cell(files, t, p, e, etp, tp) for e in range(ep)]
        missing = [e for e, path in enumerate(paths) if path is None]
        if missing:
            raise ReshardError(f"{directory} lacks the files of EP ranks {missing} of TP rank {t}, "
                               f"PP rank {p} (EP={ep}); the checkpoint is incomplete")
        parts = [load(path) for path in paths]
        own = load(files[min((k for k in files if k[:2] == (t, p)), key=lambda k: k[2])])
        sharding = Sharding(own.get("sharding") or {})
        state = dict(own)
        for key in [k for k in state if k == "model" or is_chunk_key(k)]:
            experts = ep_files.merge_experts([from_megatron_layout(part[key]) for part in parts],
                                             sharding)
            dense = from_megatron_layout(own[key])
            state[key] = to_megatron_layout(
                {name: experts[name] if sharding(name).get("expert_dim") is not None else tensor
                 for name, tensor in dense.items()})
        states[(t, p)] = state
    return states


def _recut_states(states: Dict[Tuple[int, int], dict], tp: int, etp: int) -> None:
    """Re-cut the experts of every state from expert TP `etp` to TP (in place)."""
    sharding = Sharding({k: v for state in states.values()
                         for k, v in (state.get("sharding") or {}).items()})
    keys = [k for k in states[min(states)] if k == "model" or is_chunk_key(k)]
    for key in keys:
        flats = {tp_pp: from_megatron_layout(state[key]) for tp_pp, state in states.items()}
        for tp_pp, flat in ep_files.recut_expert_tp(flats, tp, etp, tp, sharding).items():
            states[tp_pp] = dict(states[tp_pp], **{key: to_megatron_layout(flat)})


def read_source(found) -> Source:
    """Every rank file of the iteration `found` (formats.Found), experts merged over EP."""
    iteration, release, directory = found.iteration, found.release, found.directory
    ep, expert_files = _expert_files(directory) if os.path.isdir(directory) else (1, {})
    files = find_rank_dirs(directory) if os.path.isdir(directory) and ep == 1 else {}
    if not files and not expert_files:
        raise ReshardError(f"no mp_rank_*/model_optim_rng.pt under {directory}")
    first = read_model_file(expert_files[min(expert_files)] if ep > 1 else files[min(files)],
                            mmap=True).get("parallel", {})
    etp = first.get("expert_tensor_parallel_size", first.get("tensor_model_parallel_size", 1))
    if ep > 1 or etp != first.get("tensor_model_parallel_size", 1):
        cells = expert_files or {(t, p, 0): path for (t, p), path in files.items()}
        states = _merge_expert_states(cells, ep, directory, etp,
                                      first.get("tensor_model_parallel_size", 1))
        files = dict.fromkeys(states)
    else:
        states = {key: read_model_file(path, mmap=True)
                  for key, path in files.items()}
    saved = states[min(states)].get("parallel", {})
    tp = max(saved.get("tensor_model_parallel_size", 1), max(t for t, _ in files) + 1)
    pp = max(saved.get("pipeline_model_parallel_size", 1), max(p for _, p in files) + 1)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing:
        raise ReshardError(f"{directory} lacks the files of (tp rank, pp rank) {missing} of its "
                           f"TP={tp} x PP={pp} layout; the checkpoint is incomplete")
    if etp != tp:
        _recut_states(states, tp, etp)
    return Source(iteration, release, tp, pp, states, ep, etp)


def model_chunks(state: dict) -> List[dict]:
    """The model state of each virtual pipeline chunk of one rank file, in order."""
    if "model" in state:
        return [state["model"]]
    keys = sorted((k for k in state if is_chunk_key(k)), key=lambda k: int(k[5:]))
    if not keys:
        raise ReshardError("a checkpoint file has no 'model' state")
    return [state[k] for k in keys]


def _layer_count(flat: Flat) -> int:
    indices = {int(m.group(1)) for m in map(LAYER.match, flat) if m}
    return max(indices) + 1 if indices else 0


def _renumber(flat: Flat, offset: int) -> Flat:
    def rename(name):
        match = LAYER.match(name)
        if not match:
            return name
        return f"language_model.encoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
    return {rename(name): tensor for name, tensor in flat.items()}


def global_shard(source: Source, tp_rank: int) -> Tuple[Flat, int]:
    """One TP rank's parameters over all stages and chunks, with global layer numbers: the
    layers each chunk holds, numbered in the pipeline layout's stage order (any split:
    even, uneven first / last, a --pipeline-model-parallel-layout)."""
    chunks = {p: [from_megatron_layout(m) for m in model_chunks(source.states[(tp_rank, p)])]
              for p in range(source.pp)}
    vpp = len(chunks[0])
    for p in range(source.pp):
        if len(chunks[p]) != vpp:
            raise ReshardError(f"pipeline stage {p} has {len(chunks[p])} model chunks, stage 0 "
                               f"has {vpp}")
    layout = layout_of_counts([[_layer_count(flat) for flat in chunks[p]]
                               for p in range(source.pp)])
    merged: Flat = {}
    for p in range(source.pp):
        for chunk, flat in zip(layout.chunks(p), chunks[p]):
            merged.update(_renumber(flat, chunk.layer_offset))
    return merged, layout.num_layers


def merge_tensor_parallel(shards: List[Flat], sharding: Sharding) -> Flat:
    """Full tensors from the shards of every TP rank."""
    names = list(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            odd = sorted(set(shard) ^ set(names))[:3]
            raise ReshardError(f"TP ranks 0 and {rank} hold different parameters (e.g. {odd}); "
                               f"the checkpoint is inconsistent")
    return {name: merge_shards([s[name] for s in shards], sharding(name)) for name in names}


# -- writing the target -------------------------------------------------------------
def check_shapes(full: Flat, config: dict) -> None:
    """Every merged tensor has the shape of the model the stored config describes
    (built on the meta device); a checkpoint without a stored model config is not checked."""
    model = config.get("model") or {}
    if not model.get("padded_vocab_size"):
        return
    known = {f.name for f in fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in known})
    expected = {name: tuple(t.shape) for name, t in GPTModel(cfg, device="meta").state_dict().items()}
    if HEAD in full:
        expected[HEAD] = expected[WORD]
    names = set(full) | set(expected)
    for name in sorted(names):
        got = tuple(full[name].shape) if name in full else None
        if got != expected.get(name):
            raise ReshardError(f"{name}: the merged checkpoint has shape {got}, the model of its "
                               f"config (hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab "
                               f"{cfg.padded_vocab_size}) needs {expected.get(name)}; the checkpoint "
                               f"is inconsistent")


def check_target(full: Flat, config: dict, num_layers: int, tp: int, pp: int,
                 sharding: Sharding, even: bool = True) -> None:
    """The target TP x PP fits the model (`even`: its layers split evenly over PP)."""
    if tp < 1 or pp < 1:
        raise ReshardError(f"target sizes must be >= 1, got TP {tp} and PP {pp}")
    if even and num_layers % pp:
        raise ReshardError(f"the model has {num_layers} layers, not divisible by "
                           f"--target-pipeline-model-parallel-size {pp}")
    heads = config.get("model", {}).get("num_attention_heads")
    if heads is not None and heads % tp:
        raise ReshardError(f"--num-attention-heads ({heads}) is not divisible by "
                           f"--target-tensor-model-parallel-size {tp}")
    vocab = full[WORD].shape[0]
    if vocab % tp:
        raise ReshardError(f"the padded vocabulary ({vocab} rows) is not divisible by "
                           f"--target-tensor-model-parallel-size {tp}; pick a TP size that "
                           f"divides {vocab}")
    for name, tensor in full.items():
        problem = check_shardable(tensor.shape, sharding(name), tp)
        if problem:
            raise ReshardError(f"{name}: {problem} (--target-tensor-model-parallel-size {tp})")


def target_stages(name: str, layout: PipelineLayout) -> Tuple[int, str]:
    """(target pipeline stage, local name) of a full-model parameter in a one-chunk-per-rank
    `layout`."""
    match = LAYER.match(name)
    if match:
        stage, _, local = layout.place(int(match.group(1)))
        return stage, f"language_model.encoder.layers.{local}.{match.group(2)}"
    if name.startswith(FINAL_NORM) or name.startswith(OUTPUT) or name == HEAD or \
            name.startswith(MTP):
        return layout.pp_size - 1, name
    return 0, name


def split_for_target(full: Flat, layout: PipelineLayout, tp: int,
                     sharding: Sharding) -> Dict[Tuple[int, int], Flat]:
    """Parameters of each target (tp_rank, pp_rank), each tensor its own copy."""
    full, pp = dict(full), layout.pp_size
    untied = any(name.startswith(OUTPUT) for name in full)
    mtp = any(name.startswith(MTP) for name in full)
    if pp == 1 or mtp:
        full.pop(HEAD, None)  # one stage: the head is the embedding itself
    elif HEAD not in full and not untied:
        full[HEAD] = full[WORD]
    out: Dict[Tuple[int, int], Flat] = {(t, p): {} for t in range(tp) for p in range(pp)}
    if mtp and pp > 1:  # the MTP stage embeds: its own copy of the word embeddings
        for t in range(tp):
            out[(t, pp - 1)][WORD] = shard_tensor(full[WORD], sharding(WORD), t, tp).clone()
    for name, tensor in full.items():
        stage, local = target_stages(name, layout)
        meta = sharding(name)
        for t in range(tp):
            out[(t, stage)][local] = shard_tensor(tensor, meta, t, tp).clone()
    return out


def target_state(stored: dict, flat: Flat, tp: int, pp: int, sharding: Sharding,
                 ep: int = 1, etp: Optional[int] = None) -> dict:
    """One target rank file: `flat` with the stored counters and config at the new layout.
    `etp`: the expert TP the experts of `flat` are cut for (None: TP)."""
    etp = None if etp == tp else etp
    config = dict(stored.get("config") or {})
    if config:
        parallel = dict(config.get("parallel", {}))
        parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                        **EVEN_SPLIT)
        if ep > 1 or "expert_model_parallel_size" in parallel:
            parallel["expert_model_parallel_size"] = ep
        if etp is not None or "expert_tensor_parallel_size" in parallel:
            parallel["expert_tensor_parallel_size"] = etp
        if tp == 1:
            parallel["sequence_parallel"] = False
        config["parallel"] = parallel
    layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
              "virtual_pipeline_model_parallel_size": 1}
    if ep > 1:
        layout["expert_model_parallel_size"] = ep
    if etp is not None:
        layout["expert_tensor_parallel_size"] = etp
    return {"model": to_megatron_layout(flat), "sharding": sharding.to_dict(flat),
            "iteration": stored.get("iteration", 0),
            "checkpoint_version": stored.get("checkpoint_version", CHECKPOINT_VERSION),
            "config": config,
            "consumed_train_samples": stored.get("consumed_train_samples", 0),
            "consumed_valid_samples": stored.get("consumed_valid_samples", 0),
            "parallel": layout}


def check_expert_tp(etp: int, tp: int) -> None:
    if etp < 1 or tp % etp:
        raise ReshardError(f"--target-expert-tensor-parallel-size {etp} must divide "
                           f"--target-tensor-model-parallel-size {tp}; use a divisor of {tp}")


def full_model(source: Source) -> Flat:
    """The whole model of a source checkpoint: full (TP 1) tensors with global layer numbers;
    the last stage's copy of tied embeddings is dropped (`cut` puts it back where a target
    needs it)."""
    shards = [global_shard(source, t)[0] for t in range(source.tp)]
    full = merge_tensor_parallel(shards, source.sharding)
    full.pop(HEAD, None)
    return full


def cut(full: Flat, stored: dict, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None,
        layout: Optional[PipelineLayout] = None) -> Dict[Tuple[int, int], Flat]:
    """The whole model cut for TP `tp` x PP `pp`, by (tp rank, pp rank), each holding all
    experts cut at expert TP `etp` (None: TP), checked to split over `ep` EP ranks, after
    checking that it is the model its stored config describes. The layers go where `layout`
    (one chunk per rank; None: the even split) places them."""
    if ep < 1:
        raise ReshardError(f"--target-expert-model-parallel-size must be >= 1, got {ep}")
    etp = tp if etp is None else etp
    check_expert_tp(etp, tp)
    sharding = Sharding(stored.get("sharding") or {})
    num_layers = _layer_count(full)
    check_shapes(full, stored.get("config") or {})
    check_target(full, stored.get("config") or {}, num_layers, tp, pp, sharding,
                 even=layout is None)
    layout = layout or pipeline_layout(num_layers, pp)
    if (layout.pp_size, layout.vp_size, layout.num_layers) != (pp, 1, num_layers):
        raise ReshardError(f"the pipeline layout {str(layout)!r} does not place the model's "
                           f"{num_layers} layers on {pp} stages of one chunk each")
    shards = split_for_target(full, layout, tp, sharding)
    for flat in shards.values():
        problem = ep_files.check_split(flat, ep, sharding)
        if problem:
            raise ReshardError(problem)
    return ep_files.recut_expert_tp(shards, tp, tp, etp, sharding)


def write_sharded(save: str, full: Flat, stored: dict, target) -> str:
    """Write a whole model as our torch format at `target` (formats.Target): every rank file
    under a temporary directory, renamed, then the tracker. Every (TP, EP) cell is written,
    so any world size of the layout finds its files."""
    tp, pp, ep = target.tp, target.pp, target.ep
    shards = cut(full, stored, tp, pp, ep, target.etp)
    release = bool(stored.get("release"))
    iteration = int(stored.get("iteration", 0))
    final = iteration_dir(save, iteration, release)
    if os.path.exists(final):
        raise ReshardError(f"{final} already exists; choose another --save directory or "
                           f"remove it")
    os.makedirs(save, exist_ok=True)
    tmp = os.path.join(save, f".{os.path.basename(final)}.tmp.{os.getpid()}")  # a directory
    sharding = Sharding(stored.get("sharding") or {})
    try:
        for (t, p), flat in shards.items():
            for e, part in enumerate(ep_files.split_experts(flat, ep, sharding)):
                rank_dir = ep_files.rank_dir_name(t, p, pp, e if ep > 1 else None)
                os.makedirs(os.path.join(tmp, rank_dir))
                save_file(target_state(stored, part, tp, pp, sharding, ep, target.etp),
                          os.path.join(tmp, rank_dir, MODEL_FILE))
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_tracker(save, iteration, release)
    return final
