"""Import the registry's torchvision wheel (a CUDA build) beside the CPU torch, for tests."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any


def _declare_ops(package_dir: str) -> None:
    import torch

    try:
        torch.ops.load_library(os.path.join(package_dir, "_C.so"))
        return
    except (OSError, RuntimeError):
        pass
    for name in ("nms", "qnms"):
        if not hasattr(torch.ops.torchvision, name):
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.origin:
            try:
                _declare_ops(os.path.dirname(spec.origin))
            except Exception as e:  # an import that would work without the hook must still work
                print(f"torchvision_cpu_shim: {type(e).__name__}: {e}", file=sys.stderr)
        return spec


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
