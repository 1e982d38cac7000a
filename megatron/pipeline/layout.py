"""Where every layer of a pipeline lives: one pure function of the flags (no torch).

`pipeline_layout(...)` turns --num-layers, --pipeline-model-parallel-size and the split
flags into a `PipelineLayout`: the layer string of each virtual stage. Virtual stage
s = v * PP + r is model chunk v of pipeline rank r (Megatron-LM's order; the interleaved
schedule runs the stages in it), and the global layer indices follow the stages in that
order. The split is, in the first of these forms that is given:

- --pipeline-model-parallel-layout: Megatron-LM's grammar. `E` the embedding, `t` a
  transformer layer, `m` a multi-token-prediction layer, `L` the loss (final norm and
  head), `|` a stage boundary, `X*N` and `(...)*N` repetition (groups may nest), commas
  cosmetic; stages may be empty. The layout has PP x VP stages, so it sets VP;
- --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the first /
  last pipeline rank holds that many layers, the others split the rest evenly; each rank's
  layers are split evenly over its VP chunks;
- the even split: L / (PP x VP) layers per chunk, VP from
  --num-layers-per-virtual-pipeline-stage.

The embedding is always on chunk 0 of rank 0 and the loss on the last chunk of the last
rank; without a layout, the --mtp-num-layers MTP layers are on the loss's chunk, before it. Bad settings raise LayoutError, one line naming the flags and values.
"""
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

EMBEDDING, LAYER, MTP, LOSS, BOUNDARY = "E", "t", "m", "L", "|"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"


class LayoutError(ValueError):
    """A pipeline split that cannot be built; the message names the flags and values."""


@dataclass(frozen=True)
class Chunk:
    """One model chunk: (pp rank, virtual chunk), its transformer layers
    [layer_offset, layer_offset + num_layers) and whether it holds the embedding / loss."""
    pp_rank: int
    vp_rank: int
    layer_offset: int
    num_layers: int
    embedding: bool
    loss: bool
    mtp_layers: int = 0


@dataclass(frozen=True)
class PipelineLayout:
    """The layer string of each virtual stage, in Megatron-LM's order (s = v * PP + r)."""
    pp_size: int
    stages: Tuple[str, ...]

    @property
    def vp_size(self) -> int:
        return len(self.stages) // self.pp_size

    @property
    def num_layers(self) -> int:
        return sum(stage.count(LAYER) for stage in self.stages)

    def stage(self, pp_rank: int, vp_rank: int = 0) -> str:
        return self.stages[vp_rank * self.pp_size + pp_rank]

    def chunk(self, pp_rank: int, vp_rank: int = 0) -> Chunk:
        index = vp_rank * self.pp_size + pp_rank
        stage = self.stages[index]
        offset = sum(s.count(LAYER) for s in self.stages[:index])
        return Chunk(pp_rank, vp_rank, offset, stage.count(LAYER), EMBEDDING in stage,
                     LOSS in stage, stage.count(MTP))

    def chunks(self, pp_rank: int) -> List[Chunk]:
        """The chunks of one pipeline rank, in chunk order."""
        return [self.chunk(pp_rank, v) for v in range(self.vp_size)]

    def place(self, layer: int) -> Tuple[int, int, int]:
        """(pp rank, virtual chunk, local index) of global transformer layer `layer`."""
        for index, stage in enumerate(self.stages):
            count = stage.count(LAYER)
            if layer < count:
                return index % self.pp_size, index // self.pp_size, layer
            layer -= count
        raise LayoutError(f"layer {layer} is beyond the layout's {self.num_layers} layers")

    def __str__(self) -> str:
        return BOUNDARY.join(self.stages)


def pipeline_layout(num_layers: int, pp_size: int, vp_size: Optional[int] = None,
                    layout: Optional[str] = None, first: Optional[int] = None,
                    last: Optional[int] = None, mtp_num_layers: int = 0) -> PipelineLayout:
    """The split of `num_layers` transformer layers over `pp_size` ranks x `vp_size` chunks
    (None: 1, or the layout's), by the first of `layout`, `first` / `last`, the even split
    that is given (module docstring)."""
    if layout is not None:
        if first is not None or last is not None:
            raise LayoutError(f"{LAYOUT_FLAG} cannot be combined with {FIRST_FLAG} / "
                              f"{LAST_FLAG}; the layout places every layer, drop them")
        stages = parse_layout(layout)
        found = check_layout(stages, layout, num_layers, pp_size, mtp_num_layers)
        if vp_size is not None and vp_size != found.vp_size:
            raise LayoutError(f"{LAYOUT_FLAG} {layout!r} has {len(stages)} stages = "
                              f"{pp_size} ranks x {found.vp_size} virtual stages, not "
                              f"{vp_size}; drop the virtual pipeline flag")
        return found
    counts = rank_layer_counts(num_layers, pp_size, first, last)
    vp = vp_size or 1
    for rank, count in enumerate(counts):
        if count % vp:
            raise LayoutError(f"pipeline rank {rank} holds {count} layers, not divisible by "
                              f"the {vp} virtual pipeline stages")
    found = layout_of_counts([[count // vp] * vp for count in counts])
    if not mtp_num_layers:
        return found
    last = found.stages[-1][:-len(LOSS)] + MTP * mtp_num_layers + LOSS  # on the loss stage
    return PipelineLayout(pp_size, found.stages[:-1] + (last,))


def layout_of_counts(counts: List[List[int]]) -> PipelineLayout:
    """The layout whose pipeline rank r, chunk v holds counts[r][v] transformer layers (what
    a saved checkpoint's files hold), numbered in stage order as every layout is."""
    pp, vp = len(counts), len(counts[0])
    stages = [LAYER * counts[r][v] for v in range(vp) for r in range(pp)]
    stages[0] = EMBEDDING + stages[0]
    stages[-1] += LOSS
    return PipelineLayout(pp, tuple(stages))


def rank_layer_counts(num_layers: int, pp_size: int, first: Optional[int],
                      last: Optional[int]) -> List[int]:
    """Transformer layers of each pipeline rank: `first` / `last` on the first / last rank
    (None: not uneven), the rest evenly over the others."""
    given = [(FIRST_FLAG, first), (LAST_FLAG, last)]
    for flag, value in given:
        if value is not None and (value <= 0 or pp_size == 1):
            raise LayoutError(f"{flag} {value} needs a positive number of layers and "
                              f"--pipeline-model-parallel-size > 1 (got {pp_size})")
    middle_ranks = pp_size - sum(value is not None for _, value in given)
    middle = num_layers - (first or 0) - (last or 0)
    if first is None and last is None and num_layers % pp_size:
        raise LayoutError(f"--num-layers ({num_layers}) must be divisible by "
                          f"--pipeline-model-parallel-size ({pp_size})")
    if middle < 0 or bool(middle) != bool(middle_ranks) or (middle_ranks and
                                                            middle % middle_ranks):
        named = " / ".join(f"{flag} {value}" for flag, value in given if value is not None)
        raise LayoutError(f"{named} do not fit --num-layers {num_layers} at "
                          f"--pipeline-model-parallel-size {pp_size}: the "
                          f"{middle} other layers must split evenly over the {middle_ranks} "
                          f"other ranks (and be none when there are none)")
    counts = [middle // middle_ranks if middle_ranks else 0] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


# -- the grammar ---------------------------------------------------------------------
_TOKEN = re.compile(r"\d+|.")


def parse_layout(text: str) -> List[str]:
    """The stages of a layout string, each a string of E / t / m / L (repetitions expanded,
    commas dropped): "E(tt|)*2L" -> ["Ett", "tt", "L"]."""
    tokens = _TOKEN.findall(text.replace(",", ""))
    expanded, end = _sequence(tokens, 0, text)
    if end != len(tokens):
        raise LayoutError(f"{LAYOUT_FLAG} {text!r}: unmatched ')'")
    return expanded.split(BOUNDARY)


def _sequence(tokens: List[str], at: int, text: str) -> Tuple[str, int]:
    """Expand items from `at` to the end or a ')': (their text, the index reached)."""
    out = []
    while at < len(tokens) and tokens[at] != ")":
        token = tokens[at]
        if token == "(":
            item, at = _sequence(tokens, at + 1, text)
            if at == len(tokens):
                raise LayoutError(f"{LAYOUT_FLAG} {text!r}: unmatched '('")
        elif token in (EMBEDDING, LAYER, MTP, LOSS, BOUNDARY):
            item = token
        else:
            raise LayoutError(f"{LAYOUT_FLAG} {text!r}: unknown {token!r}; use E (embedding), t "
                              f"(layer), m (MTP layer), L (loss), | (stage boundary), "
                              f"(...)*N, X*N")
        at += 1
        if at < len(tokens) and tokens[at] == "*":
            if at + 1 == len(tokens) or not tokens[at + 1].isdigit():
                raise LayoutError(f"{LAYOUT_FLAG} {text!r}: '*' needs a count after it")
            item, at = item * int(tokens[at + 1]), at + 2
        out.append(item)
    return "".join(out), at


def check_layout(stages: List[str], text: str, num_layers: int, pp_size: int,
                 mtp_num_layers: int = 0) -> PipelineLayout:
    """The layout of parsed `stages`, checked against the model (Megatron-LM's rules)."""
    flag = f"{LAYOUT_FLAG} {text!r}"
    if len(stages) % pp_size:
        raise LayoutError(f"{flag} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size {pp_size} (stages = PP x VP)")
    whole = "".join(stages)
    if whole.count(EMBEDDING) != 1 or not stages[0].startswith(EMBEDDING):
        raise LayoutError(f"{flag}: E (the embedding) must appear once, first in the first "
                          f"stage")
    if whole.count(LOSS) != 1 or not stages[-1].endswith(LOSS):
        raise LayoutError(f"{flag}: L (the loss) must appear once, last in the last stage")
    if whole.count(LAYER) != num_layers:
        raise LayoutError(f"{flag} has {whole.count(LAYER)} transformer layers (t), "
                          f"--num-layers is {num_layers}")
    _check_mtp(stages, flag, pp_size, mtp_num_layers)
    return PipelineLayout(pp_size, tuple(stages))


def _check_mtp(stages: List[str], flag: str, pp_size: int, mtp_num_layers: int) -> None:
    whole = "".join(stages)
    count = whole.count(MTP)
    if count != mtp_num_layers:
        raise LayoutError(f"{flag} has {count} MTP layers (m); MTP layers need "
                          f"--mtp-num-layers {count}" if mtp_num_layers == 0 else
                          f"{flag} has {count} MTP layers (m), --mtp-num-layers is "
                          f"{mtp_num_layers}")
    if count == 0:
        return
    if LAYER in whole[whole.index(MTP):]:
        raise LayoutError(f"{flag}: MTP layers (m) must come after every transformer layer")
    holding = [s for s, stage in enumerate(stages) if MTP in stage]
    if len(holding) != 1 or holding[0] < len(stages) - pp_size:
        raise LayoutError(f"{flag}: the MTP layers (m) must be together in one stage, the "
                          f"last virtual stage of its rank")
