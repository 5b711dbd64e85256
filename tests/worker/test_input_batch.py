"""Step inputs: row order, ids, positions, slots, block tables, and the persistent buffers."""
from __future__ import annotations

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, InputBuffers, build_step_inputs

BS = 4


def _state(req_id: str, tokens: list[int], blocks: list[int], computed: int) -> CachedRequestState:
    return CachedRequestState(req_id, tokens, len(tokens) - 1, SamplingParams(), None, blocks,
                              computed)


def _buffers(rows: int = 16) -> InputBuffers:
    return InputBuffers(rows, 4, 8, torch.device("cpu"))


def test_decodes_first_then_prompt_chunks_with_exact_slots():
    prefill = _state("p", [10, 11, 12, 13, 14, 15], [5, 2], 0)   # 6 tokens, all scheduled
    decode = _state("d", list(range(100, 110)), [7, 3, 9], 9)  # computing position 9
    chunk = _state("c", list(range(200, 208)), [4, 6], 3)        # 4 more after 3 cached
    step = build_step_inputs([prefill, decode, chunk], [6, 1, 4], BS, _buffers())
    assert [s.state.req_id for s in step.seqs] == ["d", "p", "c"]
    assert [(s.start, s.num_tokens) for s in step.seqs] == [(0, 1), (1, 6), (7, 4)]
    assert step.input_ids.tolist() == [109, 10, 11, 12, 13, 14, 15, 203, 204, 205, 206]
    assert step.positions.tolist() == [9, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6]
    # position p of a request lands in slot block_ids[p // 4] * 4 + p % 4
    assert step.attn.slot_mapping.tolist() == [9 * 4 + 1, 20, 21, 22, 23, 8, 9, 19, 24, 25, 26]
    dec = step.attn.decode
    assert dec.num_tokens == 1 and dec.context_lens.tolist() == [10]
    assert dec.block_table.tolist() == [[7, 3, 9]] and dec.block_table.is_contiguous()
    fresh, cont = step.attn.prefills
    assert (fresh.start, fresh.num_tokens, fresh.context_len, fresh.mask) == (1, 6, 6, None)
    assert fresh.block_ids.tolist() == [5, 2]
    assert (cont.start, cont.num_tokens, cont.context_len) == (7, 4, 7)
    # query i of the chunk sits at position 3 + i and sees keys 0..3 + i
    assert cont.mask.tolist() == [[j <= 3 + i for j in range(7)] for i in range(4)]


def test_block_table_rows_are_padded_with_block_zero():
    a = _state("a", list(range(3)), [8], 2)
    b = _state("b", list(range(10)), [1, 2, 3], 9)
    step = build_step_inputs([a, b], [1, 1], BS, _buffers())
    assert step.attn.decode.block_table.tolist() == [[8, 0, 0], [1, 2, 3]]
    assert step.attn.decode.context_lens.tolist() == [3, 10]
    assert step.attn.prefills == []


def test_buffers_are_reused_across_steps_and_grow_when_needed():
    buffers = _buffers(rows=4)
    ptr = buffers.input_ids.data_ptr()
    s = _state("a", list(range(20, 23)), [1], 2)
    first = build_step_inputs([s], [1], BS, buffers)
    assert first.input_ids.data_ptr() == ptr  # a view of the buffer, not a new tensor
    s.num_computed_tokens, s.token_ids = 3, s.token_ids + [23]
    second = build_step_inputs([s], [1], BS, buffers)
    assert second.input_ids.data_ptr() == ptr and second.input_ids.tolist() == [23]
    long = _state("b", list(range(9)), [2, 3, 4], 0)  # 9 rows > the 4 allocated
    step = build_step_inputs([long], [9], BS, buffers)
    assert step.input_ids.tolist() == list(range(9)) and buffers.input_ids.numel() >= 9
