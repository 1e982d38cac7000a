"""megatron/pipeline/layout.py: every layer's place from the flags, one pure function (issue
30, item 3). The grammar, the uneven first / last split and the even split are checked
against Megatron-Core 0.16.1's own code (PipelineParallelLayerLayout, and the offsets and
counts of transformer_layer / transformer_block), on many settings, in a child process."""
import pytest

from megatron.arguments import parse_args
from megatron.pipeline.layout import (FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, LayoutError,
                                      PipelineLayout, parse_layout, pipeline_layout)
from tests import oracles
from tests.gpt_setup import assert_exits_2_with_one_line
from tests.mcore_setup import run_mcore_script

LAYOUTS = [  # (layout, PP, layers): accepted by both
    ("Ett|tL", 2, 3), ("EtL", 1, 1), ("E|ttttL", 2, 4), ("Etttt|L", 2, 4),
    ("Et|t||tL", 2, 3), ("Et|t|t|tL", 2, 4), ("Et|t|t|tL", 4, 4), ("E(tt|)*3L", 2, 6),
    ("E,t*3|(tt|)*2,tL", 2, 8), ("Ettt|(tt|)*29,m|L", 16, 61), ("E|(t|)*6L", 8, 6),
    ("E(t|)*7tL", 4, 8), ("Et*2|t*2|t*3L", 3, 7), ("Ett|tt|tt|tt|tt|ttL", 3, 12),
    ("E|t|t|t|t|tL", 2, 5), ("Et|tmL", 2, 2), ("E||||tL", 5, 1), ("(t)*0EtL", 1, 1),
]
MTP = {"Ettt|(tt|)*29,m|L": 1, "Et|tmL": 1}
REFUSED = [  # (layout, PP, layers): refused by both
    ("Ett|t", 2, 3), ("tE|tL", 2, 2), ("Ett|tL", 2, 4), ("Ett|tL|t", 2, 4), ("Et|Lt", 2, 2),
    ("EEt|tL", 2, 2), ("Et|tLL", 2, 2), ("Ex|tL", 2, 2), ("Et|tL", 3, 2), ("Et|t*|L", 2, 2),
    ("Et|m|tL", 2, 2), ("Et m|tL", 2, 1), ("Et|(tL", 2, 2),
]
UNEVEN = [  # (layers, PP, VP, first, last)
    (4, 2, None, 3, None), (4, 2, None, None, 1), (4, 2, None, 1, 3), (10, 4, None, 1, 3),
    (12, 3, 2, 2, 6), (9, 4, None, 3, None), (8, 4, 2, None, 2), (7, 3, None, 1, None),
    (12, 4, 2, 2, 2), (6, 3, None, None, 2),
]
UNEVEN_REFUSED = [(4, 2, None, 3, 2), (6, 3, None, 1, None), (12, 3, 2, 3, None),
                  (4, 2, None, 2, 0), (4, 3, None, 2, 2), (8, 3, 2, 3, 1)]
EVEN = [(4, 1, None), (4, 2, None), (8, 2, 2), (12, 3, 2), (16, 4, 2), (8, 2, 4)]


def places(layout: PipelineLayout):
    """{(pp rank, vp rank): [global layer ids, embedding?, loss?]} of a layout."""
    out = {}
    for r in range(layout.pp_size):
        for c in layout.chunks(r):
            out[f"{r},{c.vp_rank}"] = [list(range(c.layer_offset, c.layer_offset + c.num_layers)),
                                       c.embedding, c.loss]
    return out


def test_the_grammar_expands_repetitions_and_keeps_empty_stages():
    assert parse_layout("E(tt|)*2L") == ["Ett", "tt", "L"]
    assert parse_layout("Ettt|(tt|)*2,m|L") == ["Ettt", "tt", "tt", "m", "L"]
    assert parse_layout("E|t*3|") == ["E", "ttt", ""]
    assert parse_layout("E((t|)*2t)*2L") == ["Et", "t", "tt", "t", "tL"]  # groups may nest
    assert parse_layout("t*12") == ["t" * 12]


def test_every_layer_has_one_place_in_stage_order():
    layout = pipeline_layout(6, 2, layout="Et|t|tt|ttL")  # PP 2 x VP 2
    assert layout.vp_size == 2
    assert places(layout) == {"0,0": [[0], True, False], "1,0": [[1], False, False],
                              "0,1": [[2, 3], False, False], "1,1": [[4, 5], False, True]}
    assert [layout.place(i) for i in range(6)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 1, 1),
                                                   (1, 1, 0), (1, 1, 1)]
    with pytest.raises(LayoutError):
        layout.place(6)


@pytest.mark.parametrize("layers, pp, vp", EVEN)
def test_without_the_new_flags_the_split_is_megatrons_interleaved_one(layers, pp, vp):
    """Chunk v of rank r holds layers [v L/V + r L/(P V), + L/(P V)), as before the flags."""
    layout, chunks = pipeline_layout(layers, pp, vp), vp or 1
    per_chunk = layers // (pp * chunks)
    for r in range(pp):
        for v in range(chunks):
            c = layout.chunk(r, v)
            assert (c.layer_offset, c.num_layers) == (v * layers // chunks + r * per_chunk,
                                                      per_chunk)
            assert c.embedding == (r == 0 and v == 0)
            assert c.loss == (r == pp - 1 and v == (vp or 1) - 1)


def test_uneven_first_and_last_stages():
    assert str(pipeline_layout(10, 4, first=1, last=3)) == "Et|ttt|ttt|tttL"
    assert str(pipeline_layout(12, 3, 2, first=2, last=6)) == "Et|tt|ttt|t|tt|tttL"
    assert str(pipeline_layout(4, 2, first=3)) == "Ettt|tL"


@pytest.mark.parametrize("layout, pp, layers", REFUSED)
def test_bad_layouts_are_one_line_errors(layout, pp, layers):
    with pytest.raises(LayoutError) as err:
        pipeline_layout(layers, pp, layout=layout)
    assert "\n" not in str(err.value) and repr(layout) in str(err.value)


@pytest.mark.parametrize("layers, pp, vp, first, last", UNEVEN_REFUSED)
def test_uneven_stages_that_do_not_fit_are_refused(layers, pp, vp, first, last):
    with pytest.raises(LayoutError):
        pipeline_layout(layers, pp, vp, first=first, last=last)


def test_a_layout_excludes_the_other_split_flags():
    with pytest.raises(LayoutError, match="cannot be combined"):
        pipeline_layout(3, 2, layout="Ett|tL", first=2)
    with pytest.raises(LayoutError, match="not 2"):
        pipeline_layout(3, 2, 2, layout="Ett|tL")


def test_mtp_layers_must_match_their_count_and_come_last():
    assert pipeline_layout(2, 2, layout="Et|tmL", mtp_num_layers=1).chunk(1).mtp_layers == 1
    with pytest.raises(LayoutError, match="need --mtp-num-layers 1"):
        pipeline_layout(2, 2, layout="Et|tmL")
    with pytest.raises(LayoutError, match="after every transformer layer"):
        pipeline_layout(2, 2, layout="Et|mtL", mtp_num_layers=1)
    with pytest.raises(LayoutError, match="last virtual stage"):
        pipeline_layout(2, 2, layout="Et|tm||L", mtp_num_layers=1)


MCORE_LAYOUTS = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
cases = json.load(sys.stdin)

def layout_places(text, pp, layers, mtp):
    try:
        found = PipelineParallelLayerLayout(text, pp)
        found.validate_layer_layout(layers, mtp)
    except (AssertionError, ValueError, KeyError):
        return None
    vp = found.virtual_pipeline_model_parallel_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp if vp > 1 else None)
    out = {}
    for r in range(pp):
        for v in range(vp):
            stage = found.layout[r][v]
            out[f"{r},{v}"] = [found.get_layer_id_list(LayerType.decoder, v, r),
                               LayerType.embedding in stage, LayerType.loss in stage]
    return out

def split_places(layers, pp, vp, first, last):
    try:
        cfg = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vp,
                                num_layers_in_first_pipeline_stage=first,
                                num_layers_in_last_pipeline_stage=last,
                                pipeline_dtype=torch.float32)
    except (AssertionError, ValueError):
        return None
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)
    out = {}
    for r in range(pp):
        for v in range(vp or 1):
            stage = v if vp else None
            count = get_num_layers_to_build(cfg, stage, r)
            offset = get_transformer_layer_offset(cfg, stage, r) if pp > 1 else 0
            out[f"{r},{v}"] = list(range(offset, offset + count))
    return out

print(json.dumps({"layouts": [layout_places(*c) for c in cases["layouts"]],
                  "splits": [split_places(*c) for c in cases["splits"]]}))
"""


def _ours_or_none(make):
    try:
        return make()
    except LayoutError:
        return None


@oracles.needs("megatron-core")
def test_megatron_core_places_every_layer_alike():
    layouts = [(t, pp, n, MTP.get(t)) for t, pp, n in LAYOUTS + REFUSED]
    splits = [(n, pp, vp, None, None) for n, pp, vp in EVEN] + UNEVEN + UNEVEN_REFUSED
    theirs = run_mcore_script(MCORE_LAYOUTS, {"layouts": layouts, "splits": splits})
    for (text, pp, n, mtp), got in zip(layouts, theirs["layouts"]):
        ours = _ours_or_none(lambda: places(pipeline_layout(n, pp, layout=text,
                                                            mtp_num_layers=mtp or 0)))
        assert ours == got, (text, pp, n, ours, got)
    for (n, pp, vp, first, last), got in zip(splits, theirs["splits"]):
        ours = _ours_or_none(lambda: {k: v[0] for k, v in places(
            pipeline_layout(n, pp, vp, first=first, last=last)).items()})
        assert ours == got, (n, pp, vp, first, last, ours, got)
    assert sum(v is None for v in theirs["layouts"]) == len(REFUSED)
    assert sum(v is None for v in theirs["splits"]) == len(UNEVEN_REFUSED)


FLAGS = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "1",
         "--pipeline-model-parallel-size", "2"]
BAD_FLAGS = {
    "MTP without --mtp-num-layers": (
        [LAYOUT_FLAG, "Ett|tmL"], ["'Ett|tmL'", "MTP layers need --mtp-num-layers"]),
    "layer count": ([LAYOUT_FLAG, "Ettt|tL"], ["4 transformer layers", "--num-layers is 3"]),
    "stages not PP x VP": ([LAYOUT_FLAG, "Et|t|tL"], ["3 stages", "multiple of", "size 2"]),
    "E not first": ([LAYOUT_FLAG, "tE|ttL"], ["E (the embedding)", "first"]),
    "L not last": ([LAYOUT_FLAG, "Ett|Lt"], ["L (the loss)", "last"]),
    "layout with virtual stages": ([LAYOUT_FLAG, "Et|t||tL",
                                    "--num-layers-per-virtual-pipeline-stage", "1"],
                                   ["drop --num-layers-per-virtual-pipeline-stage"]),
    "layout with uneven stages": ([LAYOUT_FLAG, "Et|ttL", FIRST_FLAG, "1"],
                                  ["cannot be combined", FIRST_FLAG]),
    "uneven stages that do not fit": ([FIRST_FLAG, "3"], [f"{FIRST_FLAG} 3", "do not fit"]),
    "uneven stages with virtual stages": ([LAST_FLAG, "1",
                                           "--num-layers-per-virtual-pipeline-stage", "1"],
                                          ["--decoder-first/last-pipeline-num-layers"]),
    "layout stages at PP 1": ([LAYOUT_FLAG, "Et|ttL", "--pipeline-model-parallel-size", "1"],
                              ["2 stages for 1 pipeline rank"]),
    "no layout, uneven layer count": (["--num-layers", "3"], ["--num-layers (3)", "(2)"]),
}


@pytest.mark.parametrize("flags, words", BAD_FLAGS.values(), ids=list(BAD_FLAGS))
def test_bad_settings_exit_2_with_one_line(capsys, flags, words):
    assert_exits_2_with_one_line(capsys, lambda: parse_args(FLAGS + flags, world_size=2), words)


def test_the_flags_set_the_layout_and_its_virtual_stages():
    config, _ = parse_args(FLAGS + [LAYOUT_FLAG, "Et|t||tL"], world_size=2)
    assert config.virtual_pipeline_size == 2 and str(config.pipeline_layout()) == "Et|t||tL"
    config, _ = parse_args(FLAGS + [LAST_FLAG, "2"], world_size=2)
    assert config.virtual_pipeline_size is None and str(config.pipeline_layout()) == "Et|ttL"


def test_a_torch_checkpoint_of_another_split_is_refused_in_one_line():
    from types import SimpleNamespace

    from megatron.checkpointing.io import CheckpointError
    from megatron.checkpointing.model_file import check_layout
    pstate = SimpleNamespace(tp_size=1, pp_size=2, ep_size=1, etp_size=1)
    saved = {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                          "virtual_pipeline_model_parallel_size": 2,
                          "pipeline_layout": "Et|t||tL"}}
    check_layout(saved, pstate, 2, "ckpt", "Et|t||tL")
    with pytest.raises(CheckpointError) as err:
        check_layout(saved, pstate, 2, "ckpt", "Et||t|tL")
    assert "'Et|t||tL'" in str(err.value) and "--universal-checkpoint" in str(err.value)
    del saved["parallel"]["pipeline_layout"]  # saved before the split was recorded
    check_layout(saved, pstate, 2, "ckpt", "Et||t|tL")


def test_the_flags_have_help_and_are_in_the_readme():
    from megatron.arguments import build_parser
    from tests.data_setup import ROOT
    readme = (ROOT / "README.md").read_text()
    actions = build_parser()._option_string_actions
    for flag in (LAYOUT_FLAG, FIRST_FLAG, LAST_FLAG):
        assert actions[flag].help and f"`{flag}" in readme, flag
