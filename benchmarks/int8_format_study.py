"""Perplexity of int8 weight-and-activation formats, simulated, before any kernel is written.

    .venv/bin/python benchmarks/int8_format_study.py --model DIR [--formats q8_0 ch32 ch128 ...]

DIR is an HF checkpoint directory (the default model's bf16 export). Every linear layer, the head
included, computes fq(x) @ fq(W).T in float32, where fq rounds to int8 with one scale per group:
`wG` for weights (G values of a row share a scale; `ch` for one scale per output row) and `xG` for
the activations (G values of a token's row; `tok` for one scale per token). `q8_0` is w32/x32, the
int8-at-load format pagedllm runs today. The scales are float32 (Q8_0 keeps fp16 weight scales;
that difference is far below what this compares). The text is pagedllm's shipped perplexity text,
one forward pass, as `pagedllm.eval.perplexity` scores it; beside the perplexity, each format's
KL divergence from the first format's next-token distributions and how often their top tokens agree
(llama.cpp's `perplexity --kl-divergence` measures), which separate formats far better than a
perplexity on 2,300 tokens.

The question it answers: how much perplexity a format with fewer scales costs. Fewer scales mean
fewer float updates per int32 sum in the AMX-INT8 pass (one per 32 values for Q8_0).
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from pagedllm.eval.perplexity import DEFAULT_TEXT

FORMATS = {  # name: (weight group, activation group); 0 = the whole row
    "q8_0": (32, 32),
    "ch32": (0, 32),
    "ch128": (0, 128),
    "w128x128": (128, 128),
    "ch_tok": (0, 0),
    "w32x128": (32, 128),
    "w64x64": (64, 64),
    "bf16": ("bf16", "bf16"),  # weights and x rounded to bf16, float32 sums (the bf16 tiles' numbers)
}


def fake_quant(t: torch.Tensor, group) -> torch.Tensor:
    if group == "bf16":
        return t.to(torch.bfloat16).float()
    shape = t.shape
    k = shape[-1]
    g = k if group == 0 or group >= k else group
    if k % g:
        raise ValueError(f"row of {k} values does not split into groups of {g}")
    v = t.reshape(-1, k // g, g)
    scale = v.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(v / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127), 0.0)
    return (q * scale).reshape(shape)


class QLinear(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, xg: int, wg: int):
        super().__init__()
        self.weight = torch.nn.Parameter(fake_quant(lin.weight.data.float(), wg), requires_grad=False)
        self.bias = lin.bias
        self.xg = xg

    def forward(self, x):
        return F.linear(fake_quant(x, self.xg), self.weight, self.bias)


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--formats", nargs="+", default=["none", *FORMATS])
    ap.add_argument("--max-tokens", type=int, default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor(tok.encode(DEFAULT_TEXT.read_text()))
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    ref = None
    for name in args.formats:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        if name != "none":
            wg, xg = FORMATS[name]
            for mod in list(model.modules()):
                for child, sub in list(mod.named_children()):
                    if isinstance(sub, torch.nn.Linear):
                        setattr(mod, child, QLinear(sub, xg, wg))
        t = time.perf_counter()
        lp = log_probs(model, ids)
        del model
        ppl = math.exp(F.nll_loss(lp[:-1], ids[1:]).item())
        line = f"{name:>9}: perplexity {ppl:.4f}"
        if ref is None:
            ref = (lp, ppl)
        else:  # against the first format's distributions, token by token (llama.cpp's KLD measure)
            kld = (ref[0].exp() * (ref[0] - lp)).sum(-1)
            same = (ref[0].argmax(-1) == lp.argmax(-1)).float().mean().item()
            line += (f" ({(ppl / ref[1] - 1) * 100:+.2f} %), KL divergence from the first mean {kld.mean().item():.5f}"
                     f" p99 {kld.quantile(0.99).item():.4f}, same top token {same * 100:.2f} %")
        print(f"{line} over {len(ids)} tokens ({time.perf_counter() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
