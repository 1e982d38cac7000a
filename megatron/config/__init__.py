"""Configuration as data: one dataclass per component, validated on creation.

`Config.check_layout(world_size)` applies the rules that need the number of
processes; it runs before any process group is created or file written.
"""
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from megatron.config.batch_schedule import parse_step_schedule
from megatron.config.data import CheckpointConfig, DataConfig
from megatron.config.errors import ConfigError, require
from megatron.config.fsdp import check_fsdp
from megatron.config.model import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.training import LoggingConfig, OptimizerConfig, TrainingConfig
from megatron.mpu.topology import ParallelDims
from megatron.pipeline.layout import LOSS as LOSS_LAYER, MTP as MTP_LAYER
from megatron.pipeline.layout import LayoutError, PipelineLayout, parse_layout, pipeline_layout

__all__ = ["Config", "SECTIONS", "ConfigError", "ModelConfig", "ParallelConfig",
           "TrainingConfig", "OptimizerConfig", "MoEConfig", "DataConfig", "CheckpointConfig", "LoggingConfig"]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=lambda: TrainingConfig(train_iters=1))
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4))
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hf: Optional[dict] = None
    """The Hugging Face origin of a converted model (architecture, HF config, vocabulary
    rows, tokenizer files, generation config), carried through training so that an
    export gives back what was converted. (The MoE section is the model spec's: model.moe.)"""
    fairseq: Optional[dict] = None
    """The fairseq origin of a converted model (its args / cfg, optimizer history, dictionary
    and vocabulary rows), carried through training so that `--to fairseq` exports it."""

    def check_layout(self, world_size: int) -> None:
        """Rules that involve the world size and several components."""
        m, p, t = self.model, self.parallel, self.training
        tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size)
        self._check_layout_stages(pp)
        self.dims(world_size)
        require(m.num_attention_heads % tp == 0,
                f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
        groups = m.num_query_groups
        require(groups % tp == 0 or tp % groups == 0,
                f"--num-query-groups ({groups}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}), or divide it")
        require(m.ffn_hidden_size % tp == 0,
                f"--ffn-hidden-size ({m.ffn_hidden_size}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
        if p.sequence_parallel:
            require(m.seq_length % tp == 0,
                    f"--seq-length ({m.seq_length}) must be divisible by "
                    f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")
        self._check_context_parallel(tp, cp)
        dp = world_size // (tp * cp * pp)
        self._check_step_schedule(dp)
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
                f"--global-batch-size ({t.global_batch_size}) must be divisible by "
                f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})")
        if t.rampup_batch_size is not None:
            start, incr, _ = t.rampup_batch_size
            step = t.micro_batch_size * dp
            require(start % step == 0 and incr % step == 0,
                    f"--rampup-batch-size START ({start}) and INCR ({incr}) must be multiples of "
                    f"--micro-batch-size x data-parallel size ({step})")
        self._check_virtual_pipeline(pp, dp)
        self.pipeline_layout()
        self._check_experts()
        check_fsdp(self, dp)

    def dims(self, world_size: int) -> ParallelDims:
        """The parallel degrees of this run on `world_size` processes (ParallelDims checks
        them, naming the flags)."""
        p = self.parallel
        try:
            return ParallelDims(world_size, p.tensor_model_parallel_size,
                                p.pipeline_model_parallel_size, self.virtual_pipeline_size,
                                p.context_parallel_size, p.expert_model_parallel_size, p.expert_tp)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def _check_experts(self) -> None:
        ep, p, moe = self.parallel.expert_model_parallel_size, self.parallel, self.model.moe
        tp, etp = p.tensor_model_parallel_size, p.expert_tp
        if ep == 1 and etp == tp and (moe is None or not moe.enabled):
            return
        require(moe is not None and moe.enabled,
                f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp} "
                f"needs --num-experts")
        require(moe.num_experts % ep == 0,
                f"--num-experts ({moe.num_experts}) must be divisible by "
                f"--expert-model-parallel-size ({ep})")
        require(p.DDP_impl == "local", "MoE needs --DDP-impl local (expert gradients are "
                                       "reduced over their own group); drop --DDP-impl torch")
        ffn = moe.moe_ffn_hidden_size or self.model.ffn_hidden_size
        require(ffn % etp == 0, f"--moe-ffn-hidden-size ({ffn}) must be divisible by "
                                f"--expert-tensor-parallel-size ({etp})")
        # Expert biases at ETP > 1 (which Megatron-Core refuses): fc1's split with its rows,
        # fc2's added once after the ETP reduction (megatron/model/moe/experts.py).

    def _check_step_schedule(self, dp: int) -> None:
        """Each scheduled batch is whole micro batches x DP; the largest is the global batch
        size (the default of --global-batch-size)."""
        t = self.training
        if t.step_batch_size_schedule is None:
            return
        batches = [b for _, b in parse_step_schedule(t.step_batch_size_schedule)]
        step = t.micro_batch_size * dp
        for batch in batches:
            require(batch % step == 0, f"--step-batch-size-schedule batch {batch} must be "
                    f"divisible by --micro-batch-size ({t.micro_batch_size}) x data-parallel "
                    f"size ({dp})")
        if t.global_batch_size is None:
            t.global_batch_size = max(batches)
        require(t.global_batch_size >= max(batches), f"--global-batch-size "
                f"({t.global_batch_size}) is smaller than the --step-batch-size-schedule's "
                f"largest batch ({max(batches)})")

    def _check_context_parallel(self, tp: int, cp: int) -> None:
        if cp == 1:
            return
        m, kind = self.model, self.parallel.cp_comm_type
        require(m.seq_length % (2 * cp) == 0,
                f"--seq-length ({m.seq_length}) must be divisible by 2 x --context-parallel-size "
                f"({2 * cp}): each CP rank holds two of 2·CP equal chunks")
        if self.parallel.sequence_parallel:
            require(m.seq_length // cp % tp == 0,
                    f"--seq-length / --context-parallel-size ({m.seq_length // cp}) must be "
                    f"divisible by --tensor-model-parallel-size ({tp}) with --sequence-parallel")
        require(kind != "a2a" or m.num_attention_heads // tp % cp == 0,
                f"--cp-comm-type a2a needs the heads per TP rank ({m.num_attention_heads // tp}) "
                f"divisible by --context-parallel-size ({cp}); use --cp-comm-type p2p")
        require(not self.data.reset_attention_mask,
                f"--reset-attention-mask is not supported with --context-parallel-size {cp}; "
                f"drop one of them")
        require(m.position_embedding_type != "alibi",
                f"ALiBi (--position-embedding-type alibi) is not supported with "
                f"--context-parallel-size {cp}; use rope")
        require(kind != "p2p" or m.window_size is None,
                "--window-size with --cp-comm-type p2p is not supported; use --cp-comm-type a2a")
        require(kind != "p2p" or m.attention_chunk_size is None,
                f"--attention-chunk-size {m.attention_chunk_size} with --cp-comm-type p2p is not "
                f"supported; use --cp-comm-type a2a")
        require(kind != "p2p" or m.attention_dropout == 0,
                f"--attention-dropout {m.attention_dropout} with --cp-comm-type p2p is not "
                f"supported; use --attention-dropout 0 or --cp-comm-type a2a")
        require(kind != "p2p" or not m.apply_query_key_layer_scaling,
                "--apply-query-key-layer-scaling with --cp-comm-type p2p is not supported")

    def _check_layout_stages(self, pp: int) -> None:
        text = self.parallel.pipeline_model_parallel_layout
        if text is not None and pp == 1 and self.virtual_pipeline_size:
            raise ConfigError(f"--pipeline-model-parallel-layout {text!r} has "
                              f"{self.virtual_pipeline_size} stages for 1 pipeline rank; "
                              f"virtual stages need --pipeline-model-parallel-size > 1")

    def _check_virtual_pipeline(self, pp: int, dp: int) -> None:
        layers_per_virtual = self.parallel.num_layers_per_virtual_pipeline_stage
        if layers_per_virtual is not None:
            require(self.parallel.pipeline_model_parallel_layout is None,
                    "--pipeline-model-parallel-layout sets the virtual pipeline stages itself; "
                    "drop --num-layers-per-virtual-pipeline-stage")
            require(self.parallel.decoder_first_pipeline_num_layers is None and
                    self.parallel.decoder_last_pipeline_num_layers is None,
                    "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                    "--decoder-first/last-pipeline-num-layers (chunks differ in size); drop one")
            layers_per_stage = self.model.num_layers // pp
            require(layers_per_stage % layers_per_virtual == 0,
                    f"layers per pipeline stage ({layers_per_stage}) must be divisible by "
                    f"--num-layers-per-virtual-pipeline-stage ({layers_per_virtual})")
        if self.virtual_pipeline_size is None:
            return
        microbatches = self.training.global_batch_size // (self.training.micro_batch_size * dp)
        require(microbatches % pp == 0,
                f"the interleaved schedule needs the number of micro batches ({microbatches}) "
                f"to be a multiple of --pipeline-model-parallel-size ({pp})")

    @property
    def virtual_pipeline_size(self):
        """Model chunks per pipeline rank (None: one), from the layout's stage count or
        --num-layers-per-virtual-pipeline-stage."""
        p = self.parallel
        if p.pipeline_model_parallel_layout is not None:
            try:
                stages = len(parse_layout(p.pipeline_model_parallel_layout))
            except LayoutError as err:
                raise ConfigError(str(err)) from None
            vp = stages // p.pipeline_model_parallel_size
            return vp if vp > 1 else None
        per_virtual = p.num_layers_per_virtual_pipeline_stage
        if per_virtual is None:
            return None
        return self.model.num_layers // p.pipeline_model_parallel_size // per_virtual

    def pipeline_layout(self) -> PipelineLayout:
        """Every layer's place on the pipeline (megatron/pipeline/layout.py): the one source
        of the split that the model, the planner and checkpoint re-sharding use."""
        p = self.parallel
        text = p.pipeline_model_parallel_layout
        try:
            layout = pipeline_layout(self.model.num_layers, p.pipeline_model_parallel_size,
                                     None if text else self.virtual_pipeline_size, text,
                                     p.decoder_first_pipeline_num_layers,
                                     p.decoder_last_pipeline_num_layers, self.model.mtp_depths)
        except LayoutError as err:
            raise ConfigError(str(err)) from None
        require(not self.model.mtp_depths or MTP_LAYER + LOSS_LAYER in layout.stages[-1],
                f"--pipeline-model-parallel-layout {text!r}: the MTP layers (m) must be on the "
                f"last stage, just before L (MTP runs with the loss); move them there")
        return layout

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Config":
        """Rebuild from `to_dict()` output, ignoring fields this version does not know (and
        taking the top-level "moe" of configs saved before it moved into the model)."""
        values = dict(values)
        model = dict(values.get("model") or {})
        if not model.get("moe") and (values.get("moe") or {}).get("num_experts"):
            values["model"] = dict(model, moe=values["moe"])
        kwargs = {"hf": values.get("hf"), "fairseq": values.get("fairseq")}
        for name, section in SECTIONS.items():
            known = {sf.name for sf in fields(section)}
            if values.get(name) is not None:  # else the default (a config from Megatron's args)
                kwargs[name] = section(**{k: v for k, v in values[name].items() if k in known})
        return cls(**kwargs)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
            "optimizer": OptimizerConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
            "logging": LoggingConfig}
"""Config's sections by name; the flags' "moe" group fills model.moe (arguments.py)."""
