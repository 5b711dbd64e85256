"""TensorParallelRank's splits: split (even, or refused) and split_blocks (at block boundaries,
uneven when the even split would cut a block)."""
from __future__ import annotations

import pytest

from pagedllm.distributed.tensor_parallel import TensorParallelRank


def _parts(total: int, block: int, world: int) -> list[range]:
    return [TensorParallelRank(r, world).split_blocks(total, block, "w") for r in range(world)]


def test_19_blocks_of_256_over_2_ranks_split_10_and_9():
    """Qwen2.5-0.5B's 4864 intermediate rows: the even 2432 would cut a K-quant block."""
    assert _parts(4864, 256, 2) == [range(0, 2560), range(2560, 4864)]


def test_an_even_split_on_block_boundaries_stays_even():
    assert _parts(4864, 32, 2) == [range(0, 2432), range(2432, 4864)]
    assert _parts(4864, 256, 2) != _parts(4864, 32, 2)
    assert _parts(1024, 256, 4) == [range(i * 256, (i + 1) * 256) for i in range(4)]


def test_blocks_are_dealt_out_first_ranks_first():
    """20 blocks over 3 ranks: 7, 7, 6 -- contiguous, covering every value once."""
    parts = _parts(20 * 32, 32, 3)
    assert [len(p) // 32 for p in parts] == [7, 7, 6]
    assert [v for p in parts for v in p] == list(range(640))


def test_fewer_blocks_than_ranks_is_refused_naming_the_tensor():
    tp = TensorParallelRank(0, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: model\.layers\.0\.mlp\."
                                         r"down_proj\.weight has 768 values, 3 blocks of 256, "
                                         r"which cannot be split at block boundaries over 4 "
                                         r"ranks \(load it dequantized with quantization="
                                         r"'none', or use a smaller tensor_parallel_size\)"):
        tp.split_blocks(768, 256, "model.layers.0.mlp.down_proj.weight")


def test_values_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="has 800 values, 3.125 blocks of 256"):
        TensorParallelRank(1, 2).split_blocks(800, 256, "w")


def test_split_stays_even_or_refused():
    assert TensorParallelRank(1, 2).split(14, "q", "heads") == range(7, 14)
    with pytest.raises(ValueError, match="q has 9 heads, which do not split evenly"):
        TensorParallelRank(0, 2).split(9, "q", "heads")
