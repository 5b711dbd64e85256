"""CPU facts and cgroup limits, read from fake /proc and /sys trees."""
from pathlib import Path

import torch

from pagedllm.platforms import cgroup
from pagedllm.platforms.cpu import CpuInfo, CpuPlatform, memory_info, parse_cpuinfo, usable_threads
from pagedllm.platforms.malloc import MAX_MMAP_THRESHOLD, keep_freed_memory

GiB = 1024 ** 3


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v1_memory_limit_takes_the_tightest_ancestor(tmp_path):
    _write(tmp_path, "memory/a/memory.limit_in_bytes", str(8 * GiB))
    _write(tmp_path, "memory/a/memory.usage_in_bytes", str(1 * GiB))
    _write(tmp_path, "memory/a/b/memory.limit_in_bytes", str(9223372036854771712))  # no limit
    _write(tmp_path, "memory/a/b/memory.usage_in_bytes", str(1 * GiB))
    _write(tmp_path, "memory/a/b/memory.stat", f"total_inactive_file {GiB // 2}\n")
    got = cgroup.memory_limit(tmp_path, "4:memory:/a/b\n1:cpu:/\n")
    assert got.version == 1 and got.limit_bytes == 8 * GiB and got.free_bytes == 7 * GiB


def test_v2_memory_limit_minus_reclaimable_cache(tmp_path):
    _write(tmp_path, "svc/memory.max", str(int(3.5 * GiB)))
    _write(tmp_path, "svc/memory.current", str(2 * GiB))
    _write(tmp_path, "svc/memory.stat", f"anon 1\ninactive_file {GiB}\n")
    _write(tmp_path, "memory.max", "max")
    got = cgroup.memory_limit(tmp_path, "0::/svc\n")
    assert got.version == 2 and got.usage_bytes == GiB and got.free_bytes == int(2.5 * GiB)
    assert cgroup.memory_limit(tmp_path, "0::/\n") is None


def test_clean_page_cache_is_reclaimable_dirty_and_mapped_are_not(tmp_path):
    _write(tmp_path, "memory/vm/memory.limit_in_bytes", str(4 * GiB))
    _write(tmp_path, "memory/vm/memory.usage_in_bytes", str(3 * GiB))
    _write(tmp_path, "memory/vm/memory.stat",
           f"total_inactive_file {GiB}\ntotal_active_file {GiB}\ntotal_dirty {GiB // 4}\n"
           f"total_writeback 0\ntotal_mapped_file {GiB // 4}\n")
    got = cgroup.memory_limit(tmp_path, "4:memory:/vm\n")
    assert got.usage_bytes == GiB + GiB // 2 and got.free_bytes == 2 * GiB + GiB // 2
    _write(tmp_path, "svc/memory.max", str(4 * GiB))
    _write(tmp_path, "svc/memory.current", str(3 * GiB))
    _write(tmp_path, "svc/memory.stat", f"active_file {2 * GiB}\nfile_dirty {GiB}\n"
                                        f"file_writeback {GiB}\nfile_mapped {GiB}\n")
    got = cgroup.memory_limit(tmp_path, "0::/svc\n")
    assert got.usage_bytes == 3 * GiB  # nothing clean to reclaim: never below zero


def test_cpu_quota_v1_and_v2(tmp_path):
    _write(tmp_path, "cpu/job/cpu.cfs_quota_us", "150000")
    _write(tmp_path, "cpu/job/cpu.cfs_period_us", "100000")
    assert cgroup.cpu_quota(tmp_path, "2:cpu,cpuacct:/job\n") == 2
    _write(tmp_path, "v2/cpu.max", "100000 100000")
    assert cgroup.cpu_quota(tmp_path, "0::/v2\n") == 1
    _write(tmp_path, "free/cpu.max", "max 100000")
    assert cgroup.cpu_quota(tmp_path, "0::/free\n") is None


def test_threads_follow_affinity_and_quota():
    assert usable_threads(8, None) == (8, "affinity 8 CPUs, no cgroup CPU quota")
    assert usable_threads(8, 2)[0] == 2
    assert usable_threads(2, 4)[0] == 2


def test_memory_is_the_smaller_of_os_and_cgroup():
    cg = cgroup.CgroupMemory(1, int(3.49 * GiB), int(0.39 * GiB), "/x")
    mem = memory_info(20 * GiB, 24 * GiB, cg)
    assert mem.available_bytes == cg.free_bytes
    assert mem.source.startswith("cgroup v1 limit 3.49 GiB, 3.10 GiB free")
    assert memory_info(2 * GiB, 24 * GiB, cg).available_bytes == 2 * GiB


def test_isa_features_choose_the_default_dtype():
    text = "model name\t: Intel Xeon Platinum\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n"
    model, features = parse_cpuinfo(text)
    assert model == "Intel Xeon Platinum" and "amx_bf16" in features
    amx = CpuPlatform(CpuInfo(model, features, 2, "test"))
    assert amx.default_dtype(None) is torch.bfloat16
    assert amx.default_dtype("float32") is torch.float32
    avx2 = CpuPlatform(CpuInfo("AMD EPYC", ("avx2",), 2, "test"))
    assert avx2.default_dtype("bfloat16") is torch.float32


def test_cpu_token_budget_keeps_the_largest_activation_under_the_mmap_ceiling():
    cpu = CpuPlatform(CpuInfo("AMD EPYC", ("avx2",), 2, "test"))
    # float32 [tokens, intermediate] under 32 MiB, in steps of 256, between 256 and 2048
    assert cpu.default_max_num_batched_tokens(4864, False) == 1536  # Qwen2.5-0.5B: 1724 fit
    assert cpu.default_max_num_batched_tokens(1536, False) == 2048  # SmolLM2-135M: capped
    assert cpu.default_max_num_batched_tokens(8960, False) == 768  # Qwen2-1.5B: 936 fit
    assert cpu.default_max_num_batched_tokens(18944, False) == 256  # Qwen2-7B: 442 fit, the floor
    for size in (896, 4864, 8960, 18944):
        tokens = cpu.default_max_num_batched_tokens(size, False)
        assert tokens * size * 4 < MAX_MMAP_THRESHOLD or tokens == 256
        # the server keeps steps short for the time to first token
        assert cpu.default_max_num_batched_tokens(size, True) == 256


def test_glibc_keeps_freed_memory():
    assert keep_freed_memory()  # this machine runs glibc: both mallopt calls are accepted
