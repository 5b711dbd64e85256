"""Per-request state the runner keeps across steps, and the flattened inputs of one step, written
into buffers allocated once and reused every step (no tensor built from a Python list per token).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.metadata import CommonAttentionInputs, DecodeBatch, PrefillSeq
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner remembers about a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + generated tokens known to the runner
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: Optional[torch.Generator]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were already returned
    pooling_params: Optional[PoolingParams] = None  # a pooling request: pooled, not sampled
    lora_request: Optional[LoRARequest] = None  # its adapter (None: the base model)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt part of token_ids."""
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated part of token_ids."""
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's slice of the flattened batch."""

    state: CachedRequestState
    start: int  # first row in the flattened batch
    num_tokens: int
    # its rows attend as decode rows, row j to the keys up to its own position (a speculative
    # verify: the last token and the drafts after it)
    decode_rows: bool = False

    @property
    def is_decode(self) -> bool:
        """Its rows go to the decode batch (one token, or a verify's decode rows)."""
        return self.num_tokens == 1 or self.decode_rows

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so a new one is drawn."""
        return self.state.num_computed_tokens + self.num_tokens == len(self.state.token_ids)


@dataclass(frozen=True)
class StepInputs:
    """Tensors for one forward pass (views into the persistent buffers, valid for this step)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: CommonAttentionInputs
    seqs: list[ScheduledSeq]  # decode requests first, then prefills, in row order


class InputBuffers:
    """int64 step inputs allocated once: token ids, positions and slots per row; block table and
    context length per decode request. numpy views write into the same memory.

        block_table  [max_reqs * max_blocks] flat; a step with B decodes and M blocks at most
                     uses the first B * M entries as a contiguous [B, M] table
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int,
                 device: torch.device) -> None:
        self.device = device
        self.max_blocks = max_blocks
        self._alloc_rows(max_tokens)
        self.block_table = torch.zeros(max_reqs * max_blocks, dtype=torch.int64)
        self.context_lens = torch.zeros(max_reqs, dtype=torch.int64)
        self.block_table_np, self.context_lens_np = self.block_table.numpy(), self.context_lens.numpy()

    def _alloc_rows(self, rows: int) -> None:
        self.input_ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64)
        self.input_ids_np, self.positions_np = self.input_ids.numpy(), self.positions.numpy()
        self.slot_mapping_np = self.slot_mapping.numpy()

    def ensure_rows(self, rows: int) -> None:
        """Grow the per-row buffers if a step has more tokens than planned."""
        if rows > self.input_ids.numel():
            self._alloc_rows(rows)

    def ensure_table(self, reqs: int, blocks: int) -> None:
        """Grow the block table if a step needs more than planned."""
        if reqs * blocks > self.block_table.numel():
            self.block_table = torch.zeros(reqs * blocks, dtype=torch.int64)
            self.block_table_np = self.block_table.numpy()
        if reqs > self.context_lens.numel():
            self.context_lens = torch.zeros(reqs, dtype=torch.int64)
            self.context_lens_np = self.context_lens.numpy()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer view on the engine's device (the view itself on the CPU)."""
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)


def build_step_inputs(states: list[CachedRequestState], num_tokens: list[int], block_size: int,
                      buffers: InputBuffers,
                      verify: frozenset[str] = frozenset()) -> StepInputs:
    """Flatten the scheduled tokens of every request into the buffers; decodes (one token, or
    the rows of a request in `verify`: a speculative verify) go first.

    A verify's k + 1 rows are k + 1 decode rows of one sequence, row j seeing the keys up to
    position computed + j (every row's K/V is written before any row attends), so each row's
    numbers are those of a plain decode step at its position:

        rows      last  d1   d2        (computed = c)
        context   c+1   c+2  c+3
    """
    order = sorted(range(len(states)),
                   key=lambda i: num_tokens[i] != 1 and states[i].req_id not in verify)
    total = sum(num_tokens)
    buffers.ensure_rows(total)
    ids, pos, slots = buffers.input_ids_np, buffers.positions_np, buffers.slot_mapping_np
    seqs: list[ScheduledSeq] = []
    row = 0
    for i in order:
        st, n = states[i], num_tokens[i]
        start = st.num_computed_tokens
        seqs.append(ScheduledSeq(st, row, n, st.req_id in verify))
        if n == 1:
            ids[row] = st.token_ids[start]
            pos[row] = start
            slots[row] = st.block_ids[start // block_size] * block_size + start % block_size
        else:
            p = np.arange(start, start + n)
            ids[row:row + n] = st.token_ids[start:start + n]
            pos[row:row + n] = p
            slots[row:row + n] = np.asarray(st.block_ids)[p // block_size] * block_size + p % block_size
        row += n
    decodes = [s for s in seqs if s.is_decode]
    attn = CommonAttentionInputs(
        slot_mapping=buffers.to_device(buffers.slot_mapping[:total]),
        decode=_decode_batch(decodes, block_size, buffers) if decodes else None,
        prefills=[_prefill_seq(s, block_size, buffers.device) for s in seqs if not s.is_decode])
    return StepInputs(buffers.to_device(buffers.input_ids[:total]),
                      buffers.to_device(buffers.positions[:total]), attn, seqs)


def _decode_batch(seqs: list[ScheduledSeq], block_size: int, buffers: InputBuffers) -> DecodeBatch:
    # one row per token: a verify's rows each see one more key than the row before
    row_seqs = [(s, s.state.num_computed_tokens + 1 + j) for s in seqs for j in range(s.num_tokens)]
    b = len(row_seqs)
    ctx = [c for _, c in row_seqs]
    width = -(-max(ctx) // block_size)
    buffers.ensure_table(b, width)
    table = buffers.block_table_np[:b * width].reshape(b, width)
    table.fill(0)
    for r, (s, c) in enumerate(row_seqs):
        used = -(-c // block_size)
        table[r, :used] = s.state.block_ids[:used]
    buffers.context_lens_np[:b] = ctx
    return DecodeBatch(num_tokens=b,
                       block_table=buffers.to_device(buffers.block_table[:b * width].view(b, width)),
                       context_lens=buffers.to_device(buffers.context_lens[:b]))


def _prefill_seq(seq: ScheduledSeq, block_size: int, device: torch.device) -> PrefillSeq:
    computed = seq.state.num_computed_tokens
    ctx = computed + seq.num_tokens
    block_ids = torch.tensor(seq.state.block_ids[:-(-ctx // block_size)], dtype=torch.int64,
                             device=device)
    mask = None
    if computed > 0:  # query i sits at position computed + i and sees keys 0..computed + i
        q_pos = computed + torch.arange(seq.num_tokens, device=device)
        mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
    return PrefillSeq(seq.start, seq.num_tokens, ctx, block_ids, mask)
