"""Per-request state the runner keeps across steps, and the flattened inputs of one step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSeq
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

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so a new one is drawn."""
        return self.state.num_computed_tokens + self.num_tokens == len(self.state.token_ids)


@dataclass(frozen=True)
class StepInputs:
    """Tensors for one forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    seqs: list[ScheduledSeq]  # decode requests first, then prefills, in row order


def build_step_inputs(states: list[CachedRequestState], num_tokens: list[int], block_size: int,
                      device: torch.device) -> StepInputs:
    """Flatten the scheduled tokens of every request; decodes (one token) go first."""
    order = sorted(range(len(states)), key=lambda i: num_tokens[i] != 1)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seqs: list[ScheduledSeq] = []
    for i in order:
        st, n = states[i], num_tokens[i]
        start_pos = st.num_computed_tokens
        seqs.append(ScheduledSeq(st, len(ids), n))
        for pos in range(start_pos, start_pos + n):
            ids.append(st.token_ids[pos])
            positions.append(pos)
            slots.append(st.block_ids[pos // block_size] * block_size + pos % block_size)

    def long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    decodes = [s for s in seqs if s.num_tokens == 1]
    attn = AttentionMetadata(
        slot_mapping=long(slots),
        decode=_decode_batch(decodes, block_size, device) if decodes else None,
        prefills=[_prefill_seq(s, block_size, device) for s in seqs if s.num_tokens > 1])
    return StepInputs(long(ids), long(positions), attn, seqs)


def _decode_batch(seqs: list[ScheduledSeq], block_size: int, device: torch.device) -> DecodeBatch:
    ctx = [s.state.num_computed_tokens + 1 for s in seqs]
    max_blocks = -(-max(ctx) // block_size)
    table = [s.state.block_ids[:max_blocks] + [0] * (max_blocks - len(s.state.block_ids[:max_blocks]))
             for s in seqs]
    ctx_t = torch.tensor(ctx, dtype=torch.int64, device=device)
    mask = torch.arange(max_blocks * block_size, device=device)[None, :] < ctx_t[:, None]
    return DecodeBatch(num_tokens=len(seqs),
                       block_table=torch.tensor(table, dtype=torch.int64, device=device),
                       mask=mask[:, None, None, :], context_lens=ctx_t)


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
