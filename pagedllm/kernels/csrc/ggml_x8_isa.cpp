// Which variant of the x8 kernels runs (ggml_x8_isa.h): chosen on first use from the features the
// CPU reports at run time (cpuid, through __builtin_cpu_supports), not from the compiler's flags,
// or forced by PAGEDLLM_KERNEL_ISA (or the set_kernel_isa op, for tests and benchmarks). A forced
// variant the CPU cannot execute is an error naming the missing feature, never a SIGILL.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cpuid.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "ggml_x8_isa.h"
#include "kernels.h"

namespace pagedllm_ggml {
namespace x8 {
namespace {

TypeKernels avxvnni_kernels(int64_t qtype) { return isa_avxvnni::kernels_for(qtype); }
TypeKernels avx512amx_kernels(int64_t qtype) { return isa_avx512amx::kernels_for(qtype); }

// Best first: "auto" takes the first one this CPU executes. avx512vnni before avx2: on a Zen 4
// its matmuls took 0.64-0.96 of avx2's time on the default model's shapes at 1, 32 and 128 rows
// (bench_kernels.py --isa, one thread), the same at the memory-bound 1-row output head; avx2
// compiled with AVX-512VL's 32 registers was no faster than avx2, so the gain is vpdpbusd's.
// avxvnni is that code with the VEX encoding, for CPUs without AVX-512 (not measured: no such
// CPU was at hand). avx512bw (Skylake-SP: AVX-512 without VNNI) before avx2: its gemm does 512-bit
// maddubs on two weight groups at once, which a CPU with two 512-bit FMA units issues at twice
// the ymm rate (not measured: no such CPU was at hand; on a Zen 4, which splits zmm in two, it
// runs at avx2's speed).
// avx512amx first where the CPU has AMX-INT8: avx512vnni's kernels with Q8_0's gemm (32 x rows
// and more) on the tiles, the same numbers. On a 2-vCPU Xeon with AMX (family 6 model 207) its
// Q8_0 matmuls took 0.69-0.81 of avx512vnni's time at 64-512 rows and 0.78-0.94 at 32 (one
// thread, benchmarks/bench_q8_gemm.py --isa, alternating, best of 5; docs/performance.md).
const IsaVariant kVariants[] = {
    {"avx512amx", "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni amx_tile amx_int8", avx512amx_kernels},
    // avx512amx_bf16: asked for only (PAGEDLLM_KERNEL_ISA; auto takes avx512amx, listed first, on
    // every CPU that runs it). Q8_0 from kQ8TileRows rows on as bf16 tiles: its weights read as
    // int8 and no float update per 32 values, so int8 prefill runs at the bf16 weights' speed
    // (1.4x avx512amx's here), but its numbers are not the integer variants' and a row's bits
    // depend on whether its call had kQ8TileRows rows (docs/models_and_kernels.md).
    {"avx512amx_bf16", "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16",
     avx512amx_kernels, true},
    {"avx512vnni", "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni", isa_avx512vnni::kernels_for},
    {"avxvnni", "avx2 fma f16c avx_vnni", avxvnni_kernels},
    {"avx512bw", "avx2 fma f16c avx512f avx512bw avx512vl", isa_avx512bw::kernels_for},
    {"avx2", "avx2 fma f16c", isa_avx2::kernels_for},
    {"generic", "", nullptr},
};

// a CPU feature, spelled as in /proc/cpuinfo (__builtin_cpu_supports wants string literals)
bool cpu_has(const std::string& f) {
  __builtin_cpu_init();
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "f16c") return __builtin_cpu_supports("f16c");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (f == "avx512_vnni") return __builtin_cpu_supports("avx512vnni");
  if (f == "avx_vnni") return __builtin_cpu_supports("avxvnni");
  if (f == "avx512_bf16") return __builtin_cpu_supports("avx512bf16");
  if (f == "amx_tile" || f == "amx_int8" || f == "amx_bf16") {  // cpuid leaf 7: edx bits 24, 25 and 22
    unsigned a, b, c, d;
    const int bit = f == "amx_tile" ? 24 : (f == "amx_int8" ? 25 : 22);
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << bit));
  }
  TORCH_CHECK(false, "unknown CPU feature ", f);
}

// Why this build or CPU cannot run v ("" when it can): the first missing feature.
std::string missing(const IsaVariant& v) {
  if (v.kernels_for == avxvnni_kernels && !isa_avxvnni::compiled())
    return "a compiler that emits AVX-VNNI (gcc 11 or clang 12 and later)";
  std::istringstream needs(v.needs);
  for (std::string f; needs >> f;)
    if (!cpu_has(f)) return f;
  if (v.kernels_for == avx512amx_kernels) {
    const std::string lacks = isa_avx512amx::missing();  // the build, the tile permission
    if (!lacks.empty() || !v.q8_bf16_tiles) return lacks;
    return pagedllm_bf16::amx_q8_missing();
  }
  return "";
}

std::vector<std::string> runnable() {
  std::vector<std::string> names;
  for (const IsaVariant& v : kVariants)
    if (missing(v).empty()) names.push_back(v.name);
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

struct Choice {
  const IsaVariant* variant;
  std::string reason;  // which CPU features or which request chose it
};

// `name` ("auto" or a variant) -> the variant; `asked` names who asked, for the messages
Choice resolve(const std::string& name, const std::string& asked) {
  if (name == "auto") {
    for (const IsaVariant& v : kVariants)
      if (missing(v).empty())
        return {&v, *v.needs ? asked + ": the CPU has " + v.needs : asked + ": the CPU lacks avx2, fma or f16c"};
  }
  for (const IsaVariant& v : kVariants) {
    if (name != v.name) continue;
    const std::string lacks = missing(v);
    TORCH_CHECK(lacks.empty(), asked, " asks for the ", name, " kernels, but this machine lacks ", lacks,
                " (it can run: ", joined(runnable()), ")");
    return {&v, asked};
  }
  std::vector<std::string> names{"auto"};
  for (const IsaVariant& v : kVariants) names.push_back(v.name);
  TORCH_CHECK(false, asked, ": unknown kernel variant '", name, "' (one of: ", joined(names), ")");
}

std::mutex g_mutex;                           // guards the first choice and every change
std::atomic<const IsaVariant*> g_active{nullptr};
std::string g_reason;

void set_active(const Choice& c) {
  g_reason = c.reason;
  g_active.store(c.variant, std::memory_order_release);
}

std::string set_kernel_isa(const std::string& name) {
  const Choice c = resolve(name, "set_kernel_isa('" + name + "')");
  std::lock_guard<std::mutex> lock(g_mutex);
  set_active(c);
  return c.variant->name;
}

std::tuple<std::string, std::string> kernel_isa() {
  const IsaVariant& v = active_isa();
  std::lock_guard<std::mutex> lock(g_mutex);
  return {v.name, g_reason};
}

std::vector<std::string> kernel_isas() { return runnable(); }

}  // namespace

const IsaVariant& active_isa() {
  const IsaVariant* v = g_active.load(std::memory_order_acquire);
  if (v != nullptr) return *v;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_active.load(std::memory_order_relaxed) == nullptr) {  // first use: read the environment once
    const char* env = std::getenv("PAGEDLLM_KERNEL_ISA");
    const std::string name = env != nullptr && *env ? env : "auto";
    set_active(resolve(name, env != nullptr && *env ? "PAGEDLLM_KERNEL_ISA=" + name : "auto"));
  }
  return *g_active.load(std::memory_order_relaxed);
}

}  // namespace x8
}  // namespace pagedllm_ggml

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  // the variant the x8 matmuls run and why; the variants this CPU runs, best first; force one
  m.def("kernel_isa() -> (str, str)", &pagedllm_ggml::x8::kernel_isa);
  m.def("kernel_isas() -> str[]", &pagedllm_ggml::x8::kernel_isas);
  m.def("set_kernel_isa(str name) -> str", &pagedllm_ggml::x8::set_kernel_isa);
}
