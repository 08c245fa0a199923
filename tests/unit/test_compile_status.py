"""Why a tower would not run compiled, found before compiling (``models/compiled.py``):

- the setting (``compile=off``, ``auto`` on a CPU);
- a host without what the backend builds with at run time: a C compiler, Python's headers and
  libcuda for Triton's launcher on CUDA, a C++ compiler and the headers for inductor on a CPU;
  each missing piece is named, and looked for where Triton and inductor look;
- the metric's causes are the status's causes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from visenc import metrics
from visenc.models import compiled

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_the_setting_is_a_cause() -> None:
    off = compiled.why_eager("off", CUDA)
    assert off is not None and off.state == "eager" and off.cause == "setting"
    auto = compiled.why_eager("auto", CPU)
    assert auto is not None and auto.cause == "setting" and "CUDA only" in auto.detail


def test_this_host_compiles_on_the_cpu() -> None:
    """What the CPU suites compile with (inductor's g++ and Python's headers) is here."""
    assert compiled.toolchain_problem(CPU) is None
    assert compiled.why_eager("on", CPU) is None


def test_each_missing_piece_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    problem = compiled.toolchain_problem(CPU)
    assert problem is not None and "C++ compiler (set CXX" in problem
    status = compiled.why_eager("on", CPU)
    assert status is not None and status.cause == "toolchain" and status.detail == problem

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    problem = compiled.toolchain_problem(CUDA)
    assert problem is not None and "C compiler (set CC" in problem

    monkeypatch.delenv("CXX")
    monkeypatch.setattr(compiled, "python_headers", lambda: tmp_path)
    problem = compiled.toolchain_problem(CPU)
    assert problem is not None and f"Python.h in {tmp_path}" in problem and "C++" not in problem


def test_the_compiler_is_found_as_triton_finds_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``CC`` when set, else gcc, else clang on PATH."""
    cc = shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler on this host")
    monkeypatch.delenv("CC", raising=False)
    assert compiled._compiler("CC", "gcc", "clang") == cc
    monkeypatch.setenv("CC", cc)
    assert compiled._compiler("CC", "gcc", "clang") == cc
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC")
    assert compiled._compiler("CC", "gcc", "clang") is None


def test_triton_finds_the_same_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    build = pytest.importorskip("triton.runtime.build", reason="Triton is installed with CUDA torch only")
    monkeypatch.delenv("CC", raising=False)
    build._find_compiler.cache_clear()
    assert compiled._compiler("CC", "gcc", "clang") == build._find_compiler("c")


def test_the_headers_are_where_inductor_looks() -> None:
    from torch._inductor.cpp_builder import _get_python_include_dirs

    assert compiled.python_headers() == Path(_get_python_include_dirs()[0])
    assert (compiled.python_headers() / "Python.h").is_file()


def test_the_metric_knows_every_cause() -> None:
    assert metrics.COMPILE_CAUSES == compiled.CAUSES
    assert len(metrics.COMPILE_STATES) == 2 + len(compiled.CAUSES)


def test_the_warm_up_limit_scales_with_the_tower() -> None:
    small, large = compiled.warm_up_limit_s(4), compiled.warm_up_limit_s(32)
    assert compiled.WARM_UP_BASE_S < small < large
