"""``DeviceReads``: fail on anything in a forward that would make the host wait for the device."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

#: ops that return a device tensor's value to Python (``item`` itself shows under inference mode)
SCALAR_READS = {aten._local_scalar_dense, aten.item, aten.is_nonzero}
#: ops whose output shape depends on a device tensor's values
DATA_DEPENDENT = {
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
    aten.bincount,
}


class DeviceRead(AssertionError):
    """The host waited for the device inside the checked code."""


def _on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _caller() -> str:
    """The innermost frame outside torch and this module: the line that caused the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("device_reads.py"):
            return f"{frame.filename}:{frame.lineno} {frame.line}"
    return "?"


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        why = _read(func, args, kwargs)
        if why is not None:
            raise DeviceRead(f"{why} ({func}) at {_caller()}")
        return func(*args, **kwargs)


def _read(func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
    packet = func.overloadpacket
    if packet is aten._to_copy:
        source, target = args[0].device, torch.device(kwargs.get("device") or args[0].device)
        if source.type != "cpu" and target.type == "cpu":
            return "a copy from the device to the host"
        if source.type == "cpu" and target.type != "cpu" and not kwargs.get("non_blocking", False):
            return "a blocking copy from the host to the device"
        return None
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not any(_on_device(t) for t in tensors):
        return None
    if packet in SCALAR_READS:
        return "a device tensor's value read on the host"
    if packet in DATA_DEPENDENT or (packet is aten.repeat_interleave and kwargs.get("output_size") is None):
        return "an op whose output size depends on a device tensor's values"
    if packet is aten.copy_:
        dst, src = args[0], args[1]
        if not _on_device(dst) and _on_device(src):
            return "a copy from the device to the host"
        if _on_device(dst) and not _on_device(src) and not (args[2:] or [kwargs.get("non_blocking", False)])[0]:
            return "a blocking copy from the host to the device"
    return None


class _Factories(TorchFunctionMode):
    """``torch.tensor(data, device=...)`` copies host data to the device in a blocking copy that the
    dispatcher does not show; ``torch.as_tensor`` too, unless the data is already there."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device).type != "cpu":
            data = args[0] if args else kwargs.get("data")
            if not (isinstance(data, torch.Tensor) and data.device == torch.device(device)):
                raise DeviceRead(f"a blocking copy from the host to the device ({func.__name__}) at {_caller()}")
        return func(*args, **kwargs)


class DeviceReads:
    """Context manager: any host wait for the device inside raises ``DeviceRead``."""

    def __enter__(self) -> DeviceReads:
        self._modes = [_Factories(), _Ops()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
