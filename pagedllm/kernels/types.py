"""The GGML block formats the compiled kernels handle."""
from __future__ import annotations

from enum import IntEnum

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

# types with row kernels (csrc/ggml_quants.cpp, ggml_quants_low.cpp): kept in block form on the CPU
KERNEL_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                          T.Q6_K, T.IQ4_NL, T.IQ4_XS})
# types with an eight-row layout and its int8 gemv/gemm (csrc/ggml_x8.cpp)
X8_TYPES = KERNEL_TYPES


class PagedType(IntEnum):
    """pagedllm's own x8 types, not GGUF ones (csrc/ggml_common.h). Q8_0G4: Q8_0 blocks whose
    groups of Q8_GROUP_BLOCKS consecutive blocks of a row share one scale (each block carries it;
    a row's last group may be shorter), multiplied against x quantized with one scale per group
    of x values, so the kernels make one float update per group. Its blocks dequantize as Q8_0's.
    quantization="int8_g128" makes it at load (layers/quantization.py)."""

    Q8_0G4 = 1008


Q8_0G4 = PagedType.Q8_0G4
Q8_GROUP_BLOCKS = 4
X8_OWN_TYPES = frozenset({Q8_0G4})


def block_sizes(qtype: int) -> tuple[int, int]:
    """(values, bytes) of a type's block, GGUF's or pagedllm's own. Q8_0G4's "block" is its group
    of 4 Q8_0 blocks: a matrix of it has a multiple of 128 values a row, and a split of its rows
    (tensor parallel) keeps whole groups."""
    if qtype == Q8_0G4:
        return 32 * Q8_GROUP_BLOCKS, 34 * Q8_GROUP_BLOCKS
    return GGML_QUANT_SIZES[qtype]
# a float checkpoint's matrices kept in bf16, regrouped eight rows at a time (csrc/x8_bf16.cpp):
# quantization="bf16", the default for a bf16 checkpoint on the CPU (docs/models_and_kernels.md)
FLOAT_X8_TYPES = frozenset({T.BF16})
