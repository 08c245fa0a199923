"""A compiled tower: each repeated transformer block through ``torch.compile`` with dynamic shapes."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from visenc import devices

log = logging.getLogger(__name__)

#: most graphs one block's code may compile (dynamo falls back to eager past it)
RECOMPILE_LIMIT = 8

Compile = Literal["auto", "on", "off"]
Cause = Literal["setting", "toolchain", "backend", "warm_up_timeout", "warm_up_error"]
CAUSES: tuple[Cause, ...] = ("setting", "toolchain", "backend", "warm_up_timeout", "warm_up_error")
#: a warm-up's time limit, plus ``WARM_UP_S_PER_BLOCK`` per block: a cold 32-block compile takes minutes
WARM_UP_BASE_S = 300.0
WARM_UP_S_PER_BLOCK = 20.0


@dataclass(frozen=True, slots=True)
class Status:
    """Whether the blocks run compiled: ``warming``, ``compiled`` (with ``graphs``), or ``eager`` (with ``cause``)."""

    state: Literal["warming", "compiled", "eager"]
    cause: Cause | None = None
    detail: str = ""
    graphs: int = 0

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state}
        if self.state == "compiled":
            out["graphs"] = self.graphs
        if self.cause is not None:
            out.update(cause=self.cause, detail=self.detail)
        return out

    def sentence(self) -> str:
        if self.state == "eager":
            return f"the tower runs eagerly ({self.cause}): {self.detail}"
        if self.state == "warming":
            return f"the tower runs compiled: {self.detail}"
        return f"the tower runs compiled ({self.graphs} graphs built by the warm-up)"


NOT_COMPILED = Status("eager", "setting", "the tower was not compiled")


def wanted(setting: Compile, device: torch.device) -> bool:
    """``auto``: on where the device compiles by default (CUDA), off on a CPU (compiling costs more than it saves)."""
    return setting == "on" or (setting == "auto" and devices.for_device(device).compiles_by_default)


def why_eager(setting: Compile, device: torch.device) -> Status | None:
    """Why a tower on ``device`` will not be compiled under ``setting`` (``None``: it will be)."""
    if not wanted(setting, device):
        return Status("eager", "setting", f"compile={setting} on {device.type} (auto compiles on CUDA only)")
    problem = toolchain_problem(device)
    return None if problem is None else Status("eager", "toolchain", problem)


def toolchain_problem(device: torch.device) -> str | None:
    """What the compiler backend needs at run time and this host lacks (``None``: nothing found missing)."""
    runtime = devices.for_device(device)
    missing = []
    variable, *names = runtime.compiler
    if _compiler(variable, *names) is None:
        missing.append(f"{runtime.compiler_name} (set {variable}, or install {names[0]})")
    headers = python_headers()
    if not (headers / "Python.h").is_file():
        missing.append(f"Python.h in {headers} (install the headers of this Python: python3-dev)")
    missing += runtime.compiler_problems()
    return None if not missing else "missing " + "; ".join(missing)


def _compiler(variable: str, *names: str) -> str | None:
    chosen = os.environ.get(variable)
    if chosen is not None:
        return shutil.which(chosen)
    return next((found for name in names if (found := shutil.which(name)) is not None), None)


def python_headers() -> Path:
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def warm_up_limit_s(blocks: int) -> float:
    return WARM_UP_BASE_S + WARM_UP_S_PER_BLOCK * blocks


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    found: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            found.extend(module)
    return found


def configure() -> None:
    """Dynamo's settings for the blocks, in the calling thread (torch keeps them per thread)."""
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed in torch 2.6
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)
    torch._dynamo.config.suppress_errors = True  # a failed compile costs speed, never a request


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile every repeated block of ``model`` in place; returns how many."""
    configure()
    found = blocks(model)
    for block in found:
        block.compile(dynamic=True)
    log.info("compiled %d blocks of %s (dynamic shapes)", len(found), type(model).__name__)
    return len(found)


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Undo ``compile_blocks``: the blocks never enter dynamo again (nor wait for its compile lock)."""
    for block in blocks(model):
        block._compiled_call_impl = None  # what ``Module.compile`` set; ``None`` is its eager default


@contextlib.contextmanager
def backend_failures() -> Iterator[list[str]]:
    """Collect, while inside, the compile failures dynamo suppressed, one line each."""
    found: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and record.exc_info and record.exc_info[1] is not None:
                found.append(_first_line(record.exc_info[1]))

    handler = Collect()
    source = logging.getLogger("torch._dynamo.convert_frame")
    source.addHandler(handler)
    try:
        yield found
    finally:
        source.removeHandler(handler)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] or type(error).__name__


def after_warm_up(failures: list[str]) -> Status:
    """Compiled after the warm-up, or eager: the backend failed, or no graph was built (``TORCHDYNAMO_DISABLE=1``)."""
    if failures:
        return Status(
            "eager", "backend", f"the compiler backend failed on {len(failures)} frame(s); first: {failures[0]}"
        )
    built = graphs()
    if built == 0:
        return Status("eager", "backend", "the warm-up compiled no graph: dynamo ran the blocks eagerly (disabled?)")
    return Status("compiled", graphs=built)


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
