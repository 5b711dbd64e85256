"""DraftRunner: the draft model of speculative_config method "draft_model", run by the model
runner after the target's step: it proposes each sampling request's next k tokens (its greedy
continuation), which the scheduler sends back with that request's next step for the target
to verify (sample/rejection.py: a greedy draft is a point mass, so the output keeps the
target's law exactly).

Its KV cache is its own, with as many blocks as the target's and addressed by the target's
block ids: the scheduler allocates the blocks for the draft's positions ahead (lookahead).
Per request it remembers how many of the sequence's tokens its cache holds and the drafts it
fed after them; at the next call the prefix of those drafts the target kept is cached too:

    call 1   tokens t0..t9: catch up t(c)..t9 -> d1; feed d1 -> d2; feed d2 -> d3
             cached: t0..t9, and d1 d2 (fed, not yet known)
    target   keeps d1, samples x: the sequence is t0..t9 d1 x
    call 2   d1 was fed and kept: cached t0..t9 d1; catch up x -> e1; feed e1 -> e2 ...

A request's prompt is brought into the draft's cache chunk by chunk, in the steps the target
prefills it (the scheduler asks 0 drafts of those), so a step's draft work follows its
scheduled tokens; the catch-up after a verify (the kept drafts it did not feed, and the
target's token) runs as decode rows. Each catch-up pass takes many requests (at most the
step's token capacity a pass); the feeds after it are decode steps of all drafting requests
at once, through the C++ decode stack where the draft model can take it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from pagedllm.attention.metadata import set_forward_context
from pagedllm.config import EngineConfig
from pagedllm.layers.attention import bind_kv_cache
from pagedllm.layers.custom_op import attn_backend_for
from pagedllm.worker.captured_decode import CapturedDecode, decide
from pagedllm.worker.input_batch import InputBuffers, build_step_inputs
from pagedllm.worker.kv_cache import allocate_kv_cache, kv_block_bytes
from pagedllm.worker.model_loader import load_model


DECODE_ROWS = 8  # a catch-up of at most this many tokens runs as decode rows


@dataclass
class DraftJob:
    """One request to draft for: its tokens (the sampled ones of this step included), its
    block ids (the target's), and how many drafts the scheduler wants."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_drafts: int


@dataclass
class _Seq:
    """A request's sequence as build_step_inputs reads it (the draft's computed count)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class _Cached:
    """What the draft's cache holds of a request: its first `computed` tokens, then `fed`."""

    computed: int
    fed: list[int] = field(default_factory=list)


class DraftRunner:
    """Loads the draft model and its KV cache; proposes drafts for a step's sampling requests."""

    def __init__(self, config: EngineConfig, target_vocab_size: int,
                 buffers: InputBuffers) -> None:
        """config: the draft's own (EngineConfig.draft); target_vocab_size: drafts are ids the
        target's embedding has; buffers: step buffers this runner may overwrite (the target's:
        it runs after the target's step has read them)."""
        self.config = config
        self.block_size = config.cache.block_size
        self.device = config.platform.device()
        self.vocab_limit = min(config.arch.vocab_size, target_vocab_size)
        self.buffers = buffers
        self.capacity = max(1, config.scheduler.max_num_batched_tokens)
        self.attn_builder = attn_backend_for(config.platform, config.dtype).builder_cls(
            self.block_size)
        self.model: Optional[nn.Module] = None
        self.kv_cache: Optional[torch.Tensor] = None
        self.captured: Optional[CapturedDecode] = None
        self.decode_path = "not loaded"
        self._cached: dict[str, _Cached] = {}

    def load_model(self) -> None:
        """Build and load the draft model; capture its decode step where it can be."""
        self.model = load_model(self.config, None, None)
        self.captured, self.decode_path = decide(self.model, self.config.platform.kernels_ready)

    def kv_block_bytes(self) -> int:
        """Bytes of one of the draft's KV blocks (all its layers)."""
        return kv_block_bytes(self.config.arch, self.block_size, self.config.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The draft's KV cache: num_blocks blocks, as many as the target's."""
        arch = self.config.arch
        self.kv_cache = allocate_kv_cache(arch.num_hidden_layers, num_blocks, self.block_size,
                                          arch.num_key_value_heads, arch.head_dim,
                                          self.config.dtype, self.device)
        bind_kv_cache(self.model, self.kv_cache)

    def forget(self, req_id: str) -> None:
        """A request finished, or restarts (preempted, its blocks given up): nothing of it is
        cached any more."""
        self._cached.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, jobs: list[DraftJob]) -> dict[str, list[int]]:
        """Each job's drafts (at most num_drafts, fewer where its blocks end: the draft writes
        the keys of every draft but the last). A job of 0 drafts (a prompt chunk of a request
        that will draft) only brings the cache up to its tokens, as the target's step did."""
        seqs: list[tuple[_Seq, int]] = []
        for job in jobs:
            room = len(job.block_ids) * self.block_size - len(job.token_ids) + 1
            k = min(job.num_drafts, room)
            if k < 0 or not job.token_ids or (job.num_drafts > 0 and k == 0):
                continue
            computed = self._cached_prefix(job.req_id, job.token_ids, k > 0)
            if computed < len(job.token_ids):
                seqs.append((_Seq(job.req_id, list(job.token_ids), job.block_ids, computed), k))
        drafting = frozenset(s.req_id for s, k in seqs if k > 0)
        drafts: dict[str, list[int]] = {r: [] for r in drafting}
        known = {s.req_id: len(s.token_ids) for s, _ in seqs}
        pending = [s for s, _ in seqs]
        while pending:  # catch up: the tokens the cache lacks, up to capacity rows a pass
            batch, nums, room = [], [], self.capacity
            for s in pending:
                if room == 0:
                    break
                n = min(len(s.token_ids) - s.num_computed_tokens, room)
                batch.append(s)
                nums.append(n)
                room -= n
            for req_id, token in self._run(batch, nums, drafting).items():
                drafts[req_id].append(token)
            pending = [s for s in pending if s.num_computed_tokens < len(s.token_ids)]
        for j in range(1, max((k for _, k in seqs), default=0)):  # feed draft j, get j + 1
            active = [s for s, k in seqs if k > j]
            for s in active:
                s.token_ids.append(drafts[s.req_id][-1])
            for req_id, token in self._run(active, [1] * len(active), drafting).items():
                drafts[req_id].append(token)
        for s, _ in seqs:
            n = known[s.req_id]
            self._cached[s.req_id] = _Cached(n, s.token_ids[n:])
        return drafts

    def _cached_prefix(self, req_id: str, token_ids: list[int], leave_last: bool) -> int:
        """How many of the sequence's first tokens the draft's cache holds: what it caught up
        to, then the drafts it fed that the sequence kept (leave_last: at most all but the
        last token, whose logits give the first draft)."""
        cached = self._cached.get(req_id)
        if cached is None:
            return 0
        limit = len(token_ids) - 1 if leave_last else len(token_ids)
        n = min(cached.computed, limit)
        if n == cached.computed:
            for fed in cached.fed:
                if n >= limit or token_ids[n] != fed:
                    break
                n += 1
        return n

    def _run(self, seqs: list[_Seq], nums: list[int], drafting: frozenset[str]
             ) -> dict[str, int]:
        """One forward pass of the draft over nums[i] tokens of seqs[i]; the greedy next token
        of each drafting sequence whose rows reach its last token."""
        # a few tokens (the kept drafts and the target's token) go as decode rows, each seeing
        # the keys up to its position: the decode path (the C++ stack) rather than a prompt's
        rows = frozenset(s.req_id for s, n in zip(seqs, nums) if 1 < n <= DECODE_ROWS)
        step = build_step_inputs(seqs, nums, self.block_size, self.buffers, rows)
        meta = self.attn_builder.build(step.attn)
        with set_forward_context(meta):
            if self.captured is not None and meta.decode_only:
                hidden = self.captured(step.input_ids, step.positions, self.kv_cache, meta)
            else:
                hidden = self.model(step.input_ids, step.positions, None)
        ends = [seq for seq in step.seqs if seq.samples and seq.state.req_id in drafting]
        for seq in step.seqs:
            seq.state.num_computed_tokens += seq.num_tokens
        if not ends:
            return {}
        rows = torch.tensor([seq.start + seq.num_tokens - 1 for seq in ends], device=self.device)
        logits = self.model.compute_logits(hidden[rows])[:, :self.vocab_limit]
        tokens = logits.argmax(dim=-1).tolist()
        return {seq.state.req_id: t for seq, t in zip(ends, tokens)}
