"""Greedy tokens of a bf16 output head without computing its logits (kernels/csrc/head_screen.cpp).

A greedy row wants one id: the largest of the head's V logits. The screen keeps a Q8_0 copy of
the head (0.53 of its bytes) and, for such rows, multiplies it with the int8 kernels (twice the
bf16 kernels' peak on AVX512-VNNI/BF16), bounds how far each int8 logit can be from the bf16 one,
and computes the bf16 logits of the few ids that bound cannot rule out (one, most rows). The
token is the id the full head and the sampler's argmax give, bit for bit: the op's comment says
why. Rows the op does not decide (not finite, or a kernel variant whose rows depend on the batch)
come back as -1 and take the full head.

Planned at config time (the copy's bytes are in the memory plan) for a float checkpoint run as
bf16 blocks on the CPU (quantization "bf16"); built after load where the model's logits are its
head alone (no soft-capping), the head is a packed BF16 matrix and the kernels run the int8
path. PAGEDLLM_HEAD_SCREEN=0 turns it off (every greedy row then takes the full head).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.layers.ggml_linear import BF16, GGMLLinear
from pagedllm.memory.head_screen import Q8_BLOCK


class HeadScreen:
    """The Q8_0 copy of a packed BF16 head and its norms; argmax(x) gives greedy tokens."""

    def __init__(self, head: GGMLLinear, wq: torch.Tensor, norms: torch.Tensor) -> None:
        self.head, self.wq, self.norms = head, wq, norms

    @classmethod
    def build(cls, head: Optional[nn.Module]) -> Optional["HeadScreen"]:
        """The screen of head, or None where it has none (not a packed BF16 matrix without a
        bias, a width not of whole 32-value blocks, or a scale past fp16's range)."""
        if (not isinstance(head, GGMLLinear) or head.qtype != BF16 or not head.packed
                or head.bias is not None or head.in_features % Q8_BLOCK):
            return None
        wq, norms = torch.ops.pagedllm.bf16_head_q8_copy(head.weight, head.in_features)
        if wq.numel() == 0:
            return None
        return cls(head, wq, norms)

    @property
    def nbytes(self) -> int:
        return self.wq.numel() + self.norms.numel() * 4

    def argmax(self, x: torch.Tensor, step_rows: int = 0) -> torch.Tensor:
        """Greedy token of each row of x [M, H] under the head ([M] int64), -1 where undecided:
        the head's argmax in a call of step_rows rows (0: M), the step's rows x is part of."""
        return torch.ops.pagedllm.bf16_head_argmax(x, self.head.weight, self.wq, self.norms,
                                                   self.head.in_features, step_rows)
