"""GPT: embeddings -> transformer layers -> final norm -> head (tied or untied).

One `GPTModel` is one pipeline chunk: `pre_process` chunks own the embeddings,
`post_process` chunks the final layer norm and the head. With tied embeddings
a last stage that is not also the first keeps its own copy of the word
embeddings (`word_embeddings_for_head`), initialised equal to the first stage's
and kept equal by all-reducing its gradient over the embedding group. With
--untie-embeddings-and-output-weights the head is its own vocab-parallel
`language_model.output_layer` and nothing is shared between stages.

Parameter names follow Megatron-LM's GPT checkpoints
(language_model.embedding.word_embeddings.weight, language_model.encoder.layers.N...).
"""
import re
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.mpu.sharding import parameter_meta
from megatron.model.mtp import MTPBlock
from megatron.model.positions import sinusoidal_table
from megatron.model.spec import make_norm
from megatron.model.transformer import ParallelTransformer, dropout_rng_context
from megatron.mpu.cross_entropy import LogitsBuffers, linear_cross_entropy
from megatron.mpu.layers import (ColumnParallelLinear, VocabParallelEmbedding, init_normal,
                                 init_parameters, set_parallel_attributes)
from megatron.mpu.mappings import (copy_to_tensor_model_parallel_region,
                                   gather_from_sequence_parallel_region,
                                   gather_from_tensor_model_parallel_region, group_rank,
                                   scatter_to_sequence_parallel_region)

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"


class Embedding(torch.nn.Module):
    """Word (vocab-parallel) embeddings, normalised with --embed-layernorm (BLOOM; the
    norm is `word_embeddings.norm`, Megatron-DeepSpeed's name) or scaled by sqrt(h) with
    --scale-embeddings (fairseq), plus position embeddings: learned absolute, or fairseq's
    fixed sinusoids (a buffer, not saved); then dropout."""

    def __init__(self, cfg: ModelConfig, tp_group, device, dtype):
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        init = init_normal(cfg.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, tp_group=tp_group, init_method=init,
            device=device, dtype=dtype)
        if cfg.embed_layernorm:  # sees the whole sequence on every rank: not sequence parallel
            self.word_embeddings.norm = make_norm(cfg, device, dtype, sequence_parallel=False)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                cfg.max_position_embeddings, cfg.hidden_size, device=device, dtype=dtype)
            set_parallel_attributes(self.position_embeddings.weight, False, init_method=init)
        if cfg.position_embedding_type == "sinusoidal":
            table = sinusoidal_table(cfg.max_position_embeddings, cfg.hidden_size)
            self.register_buffer("sinusoids", table.to(device=device, dtype=dtype),
                                 persistent=False)

    def forward(self, input_ids, position_ids):
        x = self.word_embeddings(input_ids)
        scale = self.cfg.embedding_scale
        if scale != 1.0:  # Gemma's / fairseq's sqrt(hidden), in the activations' dtype
            x = x * torch.tensor(scale, dtype=x.dtype)
        if self.cfg.embed_layernorm:
            x = self.word_embeddings.norm(x)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        elif self.cfg.position_embedding_type == "sinusoidal":
            x = x + self.sinusoids[position_ids]
        x = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.cfg.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        with dropout_rng_context(self.cfg.sequence_parallel):
            return F.dropout(x, p=self.cfg.hidden_dropout, training=self.training)


class LanguageModel(torch.nn.Module):
    def __init__(self, cfg, tp_group, pre_process, post_process, layer_offset, num_layers,
                 device, dtype, expert_groups=None):
        super().__init__()
        self.embedding = Embedding(cfg, tp_group, device, dtype) if pre_process else None
        self.encoder = ParallelTransformer(cfg, tp_group, layer_offset, num_layers, post_process,
                                           device, dtype, expert_groups)
        if post_process and cfg.untie_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size, cfg.padded_vocab_size, tp_group=tp_group, bias=False,
                init_method=init_normal(cfg.init_method_std), device=device, dtype=dtype)


class GPTModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group=None, pre_process: bool = True,
                 post_process: bool = True, layer_offset: int = 0,
                 num_layers: Optional[int] = None, parallel_output: bool = True,
                 device=None, dtype=torch.float32, vocab_limit: Optional[int] = None,
                 expert_groups=None):
        """`vocab_limit`: the tokenizer's vocabulary size for inference; the logits of the
        padding ids at or beyond it are -inf, so that padding rows never count (in losses,
        log-probabilities or predictions). `expert_groups`: the expert-parallel layout of
        MoE layers (megatron.mpu.parallel_state.ExpertGroups; None: all experts here)."""
        super().__init__()
        if cfg.padded_vocab_size <= 0:
            raise ValueError("ModelConfig.padded_vocab_size is not set: build the tokenizer first")
        self.cfg = cfg
        self.tp_group = tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.vocab_limit = vocab_limit
        num_layers = cfg.num_layers if num_layers is None else num_layers
        self.language_model = LanguageModel(cfg, tp_group, pre_process, post_process,
                                            layer_offset, num_layers, device, dtype,
                                            expert_groups)
        self.mtp = None
        if post_process and cfg.mtp_depths:  # MTP on the loss stage, with its own embedding
            self.mtp = MTPBlock(cfg, tp_group, device, dtype, expert_groups)
            if not pre_process:
                self.language_model.embedding = Embedding(cfg, tp_group, device, dtype)
                self.language_model.embedding.word_embeddings.weight.shared_embedding = True
        self.word_embeddings_for_head = None
        if post_process and not pre_process and not cfg.untie_embeddings_and_output_weights \
                and self.mtp is None:
            self.word_embeddings_for_head = VocabParallelEmbedding(
                cfg.padded_vocab_size, cfg.hidden_size, tp_group=tp_group,
                init_method=init_normal(cfg.init_method_std), device=device, dtype=dtype)
            self.word_embeddings_for_head.weight.shared_embedding = True
        self.input_tensor = None
        self._logits_buffers = LogitsBuffers()

    # -- pipeline plumbing -------------------------------------------------
    def set_input_tensor(self, tensor):
        """Activation received from the previous pipeline stage."""
        self.input_tensor = tensor

    def head_weight(self) -> torch.Tensor:
        if self.cfg.untie_embeddings_and_output_weights:
            return self.language_model.output_layer.weight
        if self.word_embeddings_for_head is None:
            return self.language_model.embedding.word_embeddings.weight
        return self.word_embeddings_for_head.weight

    def shared_embedding_weight(self) -> Optional[torch.Tensor]:
        """The word embeddings whose gradient the first and last pipeline stages sum: the
        tied head's, or with MTP (which embeds on the last stage) the embedding's; None
        when this stage has neither."""
        if not self.cfg.untie_embeddings_and_output_weights:
            return self.head_weight() if self.pre_process or self.post_process else None
        if self.cfg.mtp_depths and self.language_model.embedding is not None:
            return self.language_model.embedding.word_embeddings.weight
        return None

    # -- initialisation ----------------------------------------------------
    def global_name(self, name: str) -> str:
        """The layout-independent name of the state-dict entry `name` (global layer
        numbers, the head copy named as the embedding it mirrors)."""
        if name.startswith("word_embeddings_for_head."):
            return WORD_EMBEDDINGS
        if name.startswith("mtp."):  # numbered by depth, on every layout
            return name
        offset = self.language_model.encoder.layer_offset
        return re.sub(r"\.layers\.(\d+)\.", lambda m: f".layers.{int(m.group(1)) + offset}.", name)

    def global_parameter_names(self) -> Dict[str, torch.nn.Parameter]:
        """Parameters keyed by their global names (`global_name`)."""
        return {self.global_name(name): p for name, p in self.named_parameters()}

    def checkpoint_tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor a checkpoint holds, by state-dict name: the parameters, then the
        persistent buffers (the routers' expert bias). Non-persistent buffers (position
        tables, ALiBi slopes, token counts) are rebuilt, never saved."""
        persistent = self.state_dict(keep_vars=True)
        tensors: Dict[str, torch.Tensor] = dict(self.named_parameters())
        tensors.update((name, b) for name, b in self.named_buffers() if name in persistent)
        return tensors

    def sharding_metadata(self) -> Dict[str, dict]:
        """{state-dict name: how it is split over TP} (megatron.mpu.sharding) of every
        checkpoint tensor; buffers are replicated."""
        return {name: parameter_meta(t) for name, t in self.checkpoint_tensors().items()}

    def init_weights(self, seed: int) -> None:
        init_parameters(self.global_parameter_names(), seed, self.tp_group,
                        self.cfg.use_cpu_initialization)

    # -- forward -------------------------------------------------------------
    def forward(self, input_ids, position_ids, attention_mask=None, labels=None,
                inference_params=None, loss_mask=None):
        """Per-token losses [b, s] when `labels` is given, else logits [b, s, V(/TP)]; in
        training the MTP depths (megatron/model/mtp.py) add their losses, over `loss_mask`
        (None: every token), to the backward. Logits and evaluation skip them.

        attention_mask: None for plain causal attention, else bool [b, 1, s, s]
        with True where attention is not allowed. inference_params: a KV cache
        (megatron.text_generation.KVCache); input_ids then follow its positions.
        """
        if self.pre_process:
            hidden = self.language_model.embedding(input_ids, position_ids)
        else:
            hidden = self.input_tensor
        hidden = self.language_model.encoder(hidden, attention_mask, inference_params)
        if not self.post_process:
            return hidden
        if self.mtp is not None and labels is not None and self.training:
            hidden = self.mtp(hidden, input_ids, position_ids, labels, loss_mask,
                              self.language_model.embedding, self._head, attention_mask)
        return self._head(hidden, labels)

    def _mask_padding(self, logits):
        if self.vocab_limit is None or self.vocab_limit >= self.cfg.padded_vocab_size:
            return logits
        local = logits.shape[-1]
        start = group_rank(self.tp_group) * local
        ids = torch.arange(start, start + local, device=logits.device)
        return logits.masked_fill(ids >= self.vocab_limit, float("-inf"))

    def _head(self, hidden, labels):
        if self.cfg.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, self.tp_group)
        if labels is None:
            logits = self._mask_padding(F.linear(hidden, self.head_weight()))  # [s, b, V / TP]
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
            return logits.transpose(0, 1).contiguous()
        limit = self.vocab_limit
        if limit is not None and limit >= self.cfg.padded_vocab_size:
            limit = None
        losses = linear_cross_entropy(hidden, self.head_weight(), labels.transpose(0, 1),
                                      self.tp_group, self._logits_buffers, limit,
                                      float_loss=not self.cfg.fp16_lm_cross_entropy)
        return losses.transpose(0, 1).contiguous()
