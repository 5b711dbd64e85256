"""SamplingMetadata: the per-step, per-row sampling inputs the Sampler consumes."""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SparseLogitBias:
    """The (row, id) -> bias entries of the rows that set logit_bias, K entries in all."""

    rows: torch.Tensor  # [K] int64
    token_ids: torch.Tensor  # [K] int64
    values: torch.Tensor  # [K] float32


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for the N rows that sample this step (row i = i-th sampling request)."""

    temperature: torch.Tensor  # [N] float32; 0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]  # [N] float32 or None when no row uses it
    top_k: Optional[torch.Tensor]  # [N] int64 (vocab_size where disabled) or None
    min_p: Optional[torch.Tensor]  # [N] float32 or None
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded requests)
    max_num_logprobs: Optional[int]  # largest `logprobs` among rows; None when no row wants them
    no_penalties: bool
    presence_penalties: torch.Tensor  # [N] float32
    frequency_penalties: torch.Tensor  # [N] float32
    repetition_penalties: torch.Tensor  # [N] float32
    prompt_token_ids: list[list[int]]  # per row (used by repetition penalty)
    output_token_ids: list[list[int]]  # per row, tokens generated so far
    banned_token_ids: dict[int, list[int]]  # row -> ids that must not be sampled (min_tokens)
    # [N, ceil(V / 32)] int32 of the ids each row may sample (structured outputs), or None
    grammar_bitmask: Optional[torch.Tensor] = None
    # added to the logits of the rows that set logit_bias; None when no row does
    logit_bias: Optional[SparseLogitBias] = None
    # [N, V] bool, True where a row may not sample (allowed_token_ids); None when no row sets it
    disallowed_mask: Optional[torch.Tensor] = None

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: Union[str, torch.device] = "cpu",
    ) -> "SamplingMetadata":
        """Build the metadata for one step from each row's params and token history."""
        n = len(params)
        assert len(prompt_token_ids) == n and len(output_token_ids) == n

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)  # [N]

        # SamplingParams already zeroes temperature-dependent filters for greedy rows.
        greedy = [p.is_greedy for p in params]
        temperature = floats([0.0 if g else p.temperature for p, g in zip(params, greedy)])
        top_p = floats([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None
        min_p = floats([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None
        top_k = None
        if any(0 < p.top_k < vocab_size for p in params):
            ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
            top_k = torch.tensor(ks, dtype=torch.int64, device=device)  # [N]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        no_penalties = all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0
            for p in params
        )
        return cls(
            temperature=temperature,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            generators=dict(generators),
            max_num_logprobs=max(wanted) if wanted else None,
            no_penalties=no_penalties,
            presence_penalties=floats([p.presence_penalty for p in params]),
            frequency_penalties=floats([p.frequency_penalty for p in params]),
            repetition_penalties=floats([p.repetition_penalty for p in params]),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            banned_token_ids=_banned_ids(params, output_token_ids, vocab_size, eos_token_ids),
            logit_bias=_logit_bias(params, device),
            disallowed_mask=_disallowed_mask(params, vocab_size, device),
        )


def _logit_bias(params: list[SamplingParams],
                device: Union[str, torch.device]) -> Optional[SparseLogitBias]:
    """Sparse entries, so a step costs nothing when no row sets logit_bias and O(K) otherwise."""
    entries = [(row, tok, b) for row, p in enumerate(params)
               for tok, b in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, toks, values = zip(*entries)
    return SparseLogitBias(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.tensor(toks, dtype=torch.int64, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _disallowed_mask(params: list[SamplingParams], vocab_size: int,
                     device: Union[str, torch.device]) -> Optional[torch.Tensor]:
    """[N, V] True outside each row's allowed_token_ids (rows without it: all False)."""
    limited = [(row, p.allowed_token_ids) for row, p in enumerate(params) if p.allowed_token_ids]
    if not limited:
        return None
    mask = torch.zeros((len(params), vocab_size), dtype=torch.bool)  # [N, V]
    for row, ids in limited:
        mask[row] = True
        mask[row, torch.tensor(ids, dtype=torch.int64)] = False
    return mask.to(device)


def _banned_ids(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    vocab_size: int,
    eos_token_ids: Sequence[int],
) -> dict[int, list[int]]:
    """Rows still short of min_tokens may not emit a token that would stop them."""
    banned: dict[int, list[int]] = {}
    for row, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) >= p.min_tokens:
            continue
        # With ignore_eos the EOS token does not stop the request, so it stays allowed.
        stops = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            stops.update(eos_token_ids)
        ids = sorted(t for t in stops if 0 <= t < vocab_size)
        if ids:
            banned[row] = ids
    return banned
