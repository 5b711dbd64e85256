"""ModelRunner: SchedulerOutput in, one forward pass over all scheduled tokens, ModelRunnerOutput out."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

import torch
from torch import nn

from pagedllm.core.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import LogprobsTensors, Sampler, compute_prompt_logprobs
from pagedllm.worker.input_batch import (CachedRequestState, ScheduledSeq, StepInputs,
                                         build_step_inputs)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole KV cache in one allocation: [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # calloc'd memory reads as zeros but the OS commits a page only when it is first written,
    # so resident memory grows with the tokens actually cached, not with the planned size
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(math.prod(shape) * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class ModelRunner:
    """Keeps per-request state, builds step inputs, runs the model and the sampler."""

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, block_size: int,
                 eos_token_ids: Sequence[int], device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self.device = device
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput(sampled={})
        states = [self.requests[r] for r in sched.num_scheduled_tokens]
        step = build_step_inputs(states, list(sched.num_scheduled_tokens.values()),
                                 self.block_size, self.device)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.attn)  # [T, H]
        out = ModelRunnerOutput(sampled={})
        self._prompt_logprobs(step, hidden, out)
        self._sample(step, hidden, out)
        for seq in step.seqs:
            seq.state.num_computed_tokens += seq.num_tokens
        return out

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.new_reqs:
            # a request resumed after preemption keeps its RNG and what it already returned
            old = self.requests.get(new.req_id)
            generator = old.generator if old else self._make_generator(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                generator, list(new.block_ids), new.num_computed_tokens,
                old.num_prompt_logprobs if old else 0)
        for cached in sched.cached_reqs:
            st = self.requests[cached.req_id]
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    def _make_generator(self, seed: Optional[int]) -> Optional[torch.Generator]:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def _sample(self, step: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        seqs = [s for s in step.seqs if s.samples]
        if not seqs:
            return
        rows = torch.tensor([s.start + s.num_tokens - 1 for s in seqs], device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [N, V]
        states = [s.state for s in seqs]
        generators = {i: st.generator for i, st in enumerate(states) if st.generator is not None}
        meta = SamplingMetadata.from_params(
            [st.sampling_params for st in states], [st.prompt_token_ids for st in states],
            [st.output_token_ids for st in states], generators, self.vocab_size,
            self.eos_token_ids, self.device)
        result = self.sampler(logits, meta)
        tokens = result.sampled_token_ids.tolist()
        for i, (st, token) in enumerate(zip(states, tokens)):
            st.token_ids.append(token)
            out.sampled[st.req_id] = token
            k = st.sampling_params.logprobs
            if k is not None and result.logprobs is not None:
                out.logprobs[st.req_id] = _row_logprobs(result.logprobs, i, k)

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor,
                         out: ModelRunnerOutput) -> None:
        for seq in step.seqs:
            k = seq.state.sampling_params.prompt_logprobs
            if k is None:
                continue
            st = seq.state
            # position p predicts prompt token p + 1; a recompute skips positions already returned
            first = max(st.num_computed_tokens, st.num_prompt_logprobs)
            last = min(st.num_computed_tokens + seq.num_tokens, st.num_prompt_tokens - 1)
            if last <= first:
                continue
            row0 = seq.start + first - st.num_computed_tokens
            logits = self.model.compute_logits(hidden[row0:row0 + last - first])  # [S, V]
            targets = torch.tensor(st.token_ids[first + 1:last + 1], device=self.device)
            lp = compute_prompt_logprobs(logits, targets, k)
            out.prompt_logprobs[st.req_id] = [_row_logprobs(lp, i, k) for i in range(last - first)]
            st.num_prompt_logprobs = last


def _row_logprobs(lp: LogprobsTensors, row: int, k: int) -> TokenLogprobs:
    """Row `row` of batched logprobs, keeping the chosen token and the top k."""
    return TokenLogprobs(lp.token_ids[row, :k + 1].tolist(), lp.logprobs[row, :k + 1].tolist(),
                         int(lp.ranks[row]))


__all__ = ["ModelRunner", "allocate_kv_cache", "ScheduledSeq"]
