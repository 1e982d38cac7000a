"""Pure rank arithmetic of 3D parallelism."""
import pytest

from megatron.mpu.topology import ParallelDims


def _check_partition(groups, world):
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world))


@pytest.mark.parametrize("world, tp, pp", [(1024, 8, 16), (64, 2, 4), (8, 2, 2), (6, 1, 3)])
def test_groups_partition_the_world(world, tp, pp):
    dims = ParallelDims(world, tp, pp)
    dp = world // (tp * pp)
    for groups, size in ((dims.tensor_parallel_groups(), tp), (dims.data_parallel_groups(), dp),
                         (dims.pipeline_parallel_groups(), pp), (dims.model_parallel_groups(), tp * pp)):
        assert all(len(g) == size for g in groups)
        _check_partition(groups, world)


def test_megatron_rank_order_1024_ranks():
    dims = ParallelDims(1024, tp=8, pp=16)
    assert dims.dp == 8
    for rank in (0, 7, 8, 63, 64, 1023, 517):
        pp, dp, tp = dims.coordinates(rank)
        assert rank == pp * (8 * 8) + dp * 8 + tp
        assert dims.rank_of(pp, dp, tp) == rank
    assert dims.tensor_parallel_groups()[0] == list(range(8))  # contiguous
    assert dims.data_parallel_groups()[0] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert dims.pipeline_parallel_groups()[0] == [64 * i for i in range(16)]
    assert dims.embedding_groups()[0] == [0, 960]
    assert all(len(g) == 2 and g[1] - g[0] == 960 for g in dims.embedding_groups())


def test_embedding_group_without_pipeline_is_the_rank_itself():
    assert ParallelDims(4, tp=2, pp=1).embedding_groups() == [[0], [1], [2], [3]]


def test_rejects_sizes_that_do_not_divide_the_world():
    with pytest.raises(ValueError, match=r"size \(8\).*world size \(12\)"):
        ParallelDims(12, tp=8, pp=1)
    with pytest.raises(ValueError, match="virtual"):
        ParallelDims(4, tp=1, pp=1, virtual_pp=2)


def test_context_parallel_in_megatron_core_order_tp_cp_dp_pp():
    """Megatron-Core's RankGenerator order: tp fastest, then cp, dp, pp."""
    dims = ParallelDims(16, tp=2, pp=2, cp=2)
    assert dims.dp == 2
    assert dims.tensor_parallel_groups()[:2] == [[0, 1], [2, 3]]
    assert dims.context_parallel_groups()[:2] == [[0, 2], [1, 3]]
    assert dims.data_parallel_groups()[:2] == [[0, 4], [1, 5]]
    assert dims.data_context_parallel_groups()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.pipeline_parallel_groups()[0] == [0, 8]
    assert dims.model_parallel_groups()[0] == [0, 1, 8, 9]
    for rank in range(16):
        pp, dp, tp = dims.coordinates(rank)
        cp = dims.cp_rank_of(rank)
        assert rank == ((pp * 2 + dp) * 2 + cp) * 2 + tp == dims.rank_of(pp, dp, tp, cp)
    for groups, size in ((dims.context_parallel_groups(), 2),
                         (dims.data_context_parallel_groups(), 4)):
        assert all(len(g) == size for g in groups)
        _check_partition(groups, 16)


def test_cp_1_keeps_the_3d_rank_order():
    plain, with_cp = ParallelDims(8, tp=2, pp=2), ParallelDims(8, tp=2, pp=2, cp=1)
    assert plain.data_parallel_groups() == with_cp.data_parallel_groups() == [[0, 2], [1, 3],
                                                                              [4, 6], [5, 7]]
    assert with_cp.context_parallel_groups() == [[r] for r in range(8)]


def test_rejects_cp_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match=r"context-parallel-size \(4\).*world size \(6\)"):
        ParallelDims(6, tp=1, pp=1, cp=4)


def test_expert_groups_with_context_parallelism_re_divide_tp_cp_dp():
    """Megatron-Core's expert decomposition: the TP x CP x DP ranks of a stage re-divided
    into ETP x EP x expert-DP, so expert-DP includes CP; dense gradients go over DP x CP."""
    dims = ParallelDims(4, cp=2, ep=2)  # CP 2 x DP 2: the EP groups are the CP groups
    assert dims.expert_parallel_groups() == dims.context_parallel_groups() == [[0, 1], [2, 3]]
    assert dims.expert_data_parallel_groups() == dims.data_parallel_groups() == [[0, 2], [1, 3]]
    assert dims.data_context_parallel_groups() == [[0, 1, 2, 3]]
    one_ep = ParallelDims(4, cp=2)  # EP 1: expert-DP is DP x CP
    assert one_ep.edp == 4
    assert one_ep.expert_data_parallel_groups() == one_ep.data_context_parallel_groups()
    big = ParallelDims(16, tp=2, cp=2, pp=2, ep=2)  # DP 2
    assert big.edp == 2
    for groups, size in ((big.expert_parallel_groups(), 2), (big.expert_data_parallel_groups(), 2),
                         (big.data_context_parallel_groups(), 4)):
        assert all(len(g) == size for g in groups)
        _check_partition(groups, 16)
    coords = [big.expert_coordinates(r) for r in range(16)]  # (pp, edp, ep, etp)
    assert [c[3] for c in coords] == [big.coordinates(r)[2] for r in range(16)]  # ETP = TP
    # expert-DP rank 0 writes the model file: exactly one rank per (PP, EP, TP)
    writers = [(p, e, t) for p, edp, e, t in coords if edp == 0]
    assert len(set(writers)) == len(writers) == 2 * 2 * 2
