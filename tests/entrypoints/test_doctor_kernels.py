"""`pagedllm doctor` says which variant of the kept-block matmuls runs and why."""
from __future__ import annotations

from pagedllm.entrypoints import doctor
from pagedllm.kernels import kernel_isa, load_kernels


def test_doctor_names_the_kernel_variant_and_why():
    load_kernels()
    expected = kernel_isa()
    report = doctor.platform_report("cpu")
    assert report["kernels"] == {"isa": expected.name, "reason": expected.reason,
                                 "runnable": list(expected.runnable)}
    line = next(line for line in doctor.format_text(report).splitlines()
                if line.startswith("kept-block matmuls: "))
    assert f"{expected.name} kernels ({expected.reason})" in line


def test_doctor_without_a_build_says_so(monkeypatch):
    monkeypatch.setattr("pagedllm.kernels.kernels_built", lambda: False)
    report = doctor.kernel_report()
    assert report["isa"] is None and "python -m pagedllm.kernels" in report["reason"]
