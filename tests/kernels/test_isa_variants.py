"""The x8 matmuls' instruction-set variants (kernels/csrc/ggml_x8_isa.h): each one this machine
executes gives the AVX2 variant's numbers bit for bit at every batch size, and the reference's
within the int8 rounding; the choice follows PAGEDLLM_KERNEL_ISA, and asking for a variant the
CPU cannot execute is an error naming the missing feature."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from pagedllm.kernels import kernel_isa, load_kernels
from pagedllm.layers.ggml_linear import X8_TYPES

from test_ggml_kernels import random_blocks, rel_error

ops = torch.ops.pagedllm
REPO = Path(__file__).resolve().parents[2]
SIMD_VARIANTS = ("avx512amx", "avx512vnni", "avxvnni", "avx512bw")  # each against avx2, the baseline
# gemv tiles of 4, 2 and 1 (1-7 rows); the gemm from 8, in chunks of 64 rows
ROWS = (1, 2, 3, 4, 7, 8, 9, 33, 64, 65)


@pytest.fixture(autouse=True)
def restore_variant():
    load_kernels()
    before = ops.kernel_isa()[0]
    yield
    ops.set_kernel_isa(before)


def _use(variant: str) -> None:
    """Force `variant`, or skip the test where this machine cannot execute it (the error names
    the missing CPU feature)."""
    try:
        ops.set_kernel_isa(variant)
    except RuntimeError as err:
        pytest.skip(str(err).splitlines()[0])


@pytest.mark.parametrize("qtype", sorted(X8_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("variant", SIMD_VARIANTS)
def test_variant_gives_avx2_numbers_bit_for_bit(variant, qtype):
    _use("avx2")
    k = 512  # two K-quant super-blocks, sixteen 32-value blocks
    raw = torch.from_numpy(random_blocks(qtype, 40, k, seed=5))
    packed = ops.ggml_pack_x8(raw, int(qtype), k)
    ref_w = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype).reshape(40, k)).double()
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1))
    expected = {m: ops.ggml_linear_x8(x[:m], [packed], [int(qtype)], k)[0] for m in ROWS}
    _use(variant)
    for m in ROWS:
        y = ops.ggml_linear_x8(x[:m], [packed], [int(qtype)], k)[0]
        assert torch.equal(y, expected[m]), f"{variant} differs from avx2 at {m} rows"
        assert rel_error(y, x[:m].double() @ ref_w.t()) < 0.02


def _q8_0_with_extremes(k: int):
    """88 random Q8_0 rows of k values (11 groups: an odd count), every weight of row 0 at -128 and
    of row 9 at 127; uint8 [88, k / 32 * 34]."""
    raw = random_blocks(T.Q8_0, 88, k, seed=11).reshape(88, k // 32, 34)
    raw[0, :, 2:] = 0x80
    raw[9, :, 2:] = 0x7F
    return raw.reshape(88, -1)


def test_amx_q8_0_gemm_equals_avx512vnni_bit_for_bit_at_the_default_models_shapes():
    """avx512amx runs Q8_0's gemm on the AMX-INT8 tiles for chunks (of up to 64 rows) of 32 rows
    and more, in passes of 32 and 16 rows (so 16-17, 31-33, 48, 63-65, 100, 130 rows take every
    path, the vpdpbusd kernel's for fewer rows among them), over pairs
    of weight groups and a group alone (an odd group count per thread), with every weight at
    -128 or 127 in two rows; its numbers are avx512vnni's bit for bit (the same int32 per block,
    the same float update)."""
    _use("avx512amx")
    k = 896
    packed = ops.ggml_pack_x8(torch.from_numpy(_q8_0_with_extremes(k)), int(T.Q8_0), k)
    other = ops.ggml_pack_x8(torch.from_numpy(random_blocks(T.Q4_0, 24, k, seed=12)), int(T.Q4_0), k)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(3))
    x[5] = -1.0
    rows = (16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 130)
    amx = {m: ops.ggml_linear_x8(x[:m], [packed, other], [int(T.Q8_0), int(T.Q4_0)], k) for m in rows}
    _use("avx512vnni")
    for m in rows:
        vnni = ops.ggml_linear_x8(x[:m], [packed, other], [int(T.Q8_0), int(T.Q4_0)], k)
        assert torch.equal(amx[m][0], vnni[0]) and torch.equal(amx[m][1], vnni[1]), f"{m} rows"


Q8_TILE_ROWS = 16  # ggml_x8_isa.h's kQ8TileRows


def test_amx_bf16_runs_q8_0_on_the_bf16_tiles_and_every_other_type_as_avx512amx():
    """avx512amx_bf16 (asked for only) sends Q8_0 from 16 rows on to the AMX-BF16 tiles: x rounded
    to bf16 times each block dequantized to bf16 (q d rounded once), summed in float32, so within
    float32 summation error of that product in float64 (weights at -128 and 127, a lone 8-row
    group, chunks past 64 rows), a row's bits the same in any call of 16 rows or more, and below
    16 rows avx512amx's integer numbers. A Q4_0 weight in the same call keeps avx512amx's numbers
    bit for bit."""
    _use("avx512amx_bf16")
    k = 896
    raw = _q8_0_with_extremes(k)
    packed = ops.ggml_pack_x8(torch.from_numpy(raw), int(T.Q8_0), k)
    w = torch.from_numpy(gguf_dequantize(raw, T.Q8_0).reshape(88, k)).to(torch.bfloat16).double()
    other = ops.ggml_pack_x8(torch.from_numpy(random_blocks(T.Q4_0, 24, k, seed=12)), int(T.Q4_0), k)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(3))
    rows = (1, 7, 15, 16, 17, 31, 32, 33, 64, 65, 130)
    tiles = {m: ops.ggml_linear_x8(x[:m], [packed, other], [int(T.Q8_0), int(T.Q4_0)], k) for m in rows}
    ops.set_kernel_isa("avx512amx")
    exact = {m: ops.ggml_linear_x8(x[:m], [packed, other], [int(T.Q8_0), int(T.Q4_0)], k) for m in rows}
    xb = x.to(torch.bfloat16).double()
    ref, bound = xb @ w.t(), (xb.abs() @ w.abs().t()) * k * 2 ** -24
    for m in rows:
        assert torch.equal(tiles[m][1], exact[m][1]), f"Q4_0 at {m} rows"
        if m < Q8_TILE_ROWS:
            assert torch.equal(tiles[m][0], exact[m][0]), f"Q8_0 at {m} rows"
            continue
        assert ((tiles[m][0].double() - ref[:m]).abs() <= bound[:m]).all(), f"Q8_0 at {m} rows"
        assert torch.equal(tiles[m][0], tiles[130][0][:m]), f"Q8_0 at {m} rows: other bits than in 130"
        assert not torch.equal(tiles[m][0], exact[m][0])  # x in bf16, not int8: other numbers
    ops.set_kernel_isa("avx512amx_bf16")
    later = ops.ggml_linear_x8(x[40:70], [packed], [int(T.Q8_0)], k)[0]
    assert torch.equal(later, tiles[130][0][40:70])  # rows from the middle of a batch, alone


def test_generic_variant_matches_the_reference():
    _use("generic")  # dequantize, then a float32 matmul: what a CPU without AVX2 runs
    raw = torch.from_numpy(random_blocks(T.Q4_K, 16, 256))
    x = torch.randn(3, 256)
    y = ops.ggml_linear_x8(x, [ops.ggml_pack_x8(raw, int(T.Q4_K), 256)], [int(T.Q4_K)], 256)[0]
    ref = torch.from_numpy(gguf_dequantize(raw.numpy(), T.Q4_K).reshape(16, 256)).double()
    assert rel_error(y, x.double() @ ref.t()) < 1e-5


def test_auto_takes_the_first_runnable_variant():
    runnable = ops.kernel_isas()
    assert runnable[-1] == "generic" and "avx2" in runnable  # the suite runs on AVX2 machines
    assert ops.set_kernel_isa("auto") == runnable[0] != "avx512amx_bf16"  # asked for only
    name, reason = ops.kernel_isa()
    assert name == runnable[0] and reason.startswith("set_kernel_isa('auto'): the CPU has avx2")


def test_unknown_variant_is_a_clear_error():
    with pytest.raises(RuntimeError, match="unknown kernel variant 'sse9' .one of: auto, "):
        ops.set_kernel_isa("sse9")


def _kernel_isa_in_subprocess(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), PAGEDLLM_KERNEL_ISA=value)
    code = "from pagedllm.kernels import kernel_isa; k = kernel_isa(); print(k.name, '|', k.reason)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_environment_variable_forces_the_variant():
    proc = _kernel_isa_in_subprocess("avx2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "avx2 | PAGEDLLM_KERNEL_ISA=avx2"


def test_environment_variable_naming_a_variant_the_cpu_lacks_is_a_value_error():
    lacking = [v for v in SIMD_VARIANTS if v not in kernel_isa().runnable]
    if not lacking:
        pytest.skip("this CPU executes every variant")
    proc = _kernel_isa_in_subprocess(lacking[0])
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: PAGEDLLM_KERNEL_ISA={lacking[0]} asks for the {lacking[0]} "
                           "kernels, but this machine lacks "), last
    assert "it can run: " in last
