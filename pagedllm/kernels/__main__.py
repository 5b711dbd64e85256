"""`python -m pagedllm.kernels`: build the CPU kernels now (setup does this ahead of first use)."""
import logging
import sys

from pagedllm.kernels import KernelBuildError, bf16_kernel, kernel_isa, load_kernels

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        load_kernels()
    except KernelBuildError as err:
        print(f"error: pagedllm's CPU kernels could not be built: {err}", file=sys.stderr)
        sys.exit(1)
    except ValueError as err:  # PAGEDLLM_KERNEL_ISA / _BF16_KERNEL: a variant this CPU cannot run
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    isa = kernel_isa()
    bf16 = bf16_kernel()
    print(f"pagedllm CPU kernels ready; kept-block matmuls: {isa.name} ({isa.reason}); "
          f"bf16 matmuls: {bf16.name} ({bf16.reason})")
