"""Check that every collective sends tensors NCCL accepts: the training group's device, never a
host tensor made on the side (a CPU scalar for a loss or a norm).

`CollectiveDeviceCheck` wraps the ``torch.distributed`` collectives the project calls while it is
active and raises on a violation, naming the call. Two rules:

* on an accelerator (``device.type != "cpu"``): every tensor's device type must be the group's;
* on CPU (the gloo twin, where every tensor is on the CPU anyway) a *fake device* stands in for
  the accelerator: a `TorchFunctionMode` marks each tensor made by a factory call without an
  explicit ``device=`` (``torch.zeros(())``, ``torch.tensor([...])``, ``.cpu()``) as a host
  tensor, and ops whose tensor inputs are all host tensors give host tensors; a tensor placed
  with an explicit device (``.to(device)``, ``device=``) or computed from parameters, gradients
  or placed inputs is "on the device". A host tensor sent over a device group fails the check,
  which is exactly the tensor NCCL would refuse on a GPU.

Groups listed in ``host_groups`` (the data loader's gloo group) may carry host tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "reduce",
                "send", "recv", "isend", "irecv")
_HOST = "_ray_dhp_host"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def is_host(t: torch.Tensor) -> bool:
    return bool(getattr(t, _HOST, False))


def _placed(name, args, kwargs) -> bool:
    """True for a call that names a device (``device=``, ``.to(device)``, ``.cuda()``)."""
    if "device" in kwargs or name == "cuda":
        return True
    return name == "to" and any(isinstance(a, (torch.device, str)) for a in args[1:])


class _HostTagger(TorchFunctionMode):
    """Marks host tensors (see the module docstring); everything else passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if name == "cpu":
            host = True
        elif _placed(name, args, kwargs):
            host = False
        elif name.startswith("new_") and inputs:  # placed like the tensor it is called on
            host = is_host(inputs[0])
        elif inputs and out is inputs[0]:  # in place (or a no-op .to(dtype)): keeps its mark
            return out
        else:
            host = all(is_host(t) for t in inputs)  # a factory (no inputs) or host-only inputs
        for t in _tensors(out):
            try:
                setattr(t, _HOST, host)
            except (AttributeError, RuntimeError):
                pass
        return out


class CollectiveDeviceCheck:
    """Context manager: wrap the collectives, raise AssertionError on a tensor NCCL would refuse.

    Args:
        device: the training device (``groups.device``).
        host_groups: groups that may carry host tensors (e.g. ``[groups.data]``).
    """

    def __init__(self, device: torch.device, host_groups=()):
        self.device = torch.device(device)
        self.host_groups = [g for g in host_groups if g is not None]
        self.calls = 0
        self._saved = {}
        self._mode = _HostTagger() if self.device.type == "cpu" else None

    def _check(self, name, args, kwargs):
        group = kwargs.get("group")
        if any(group is g for g in self.host_groups):
            return
        for t in _tensors(args):
            bad = (t.device.type != self.device.type if self._mode is None else is_host(t))
            if bad:
                where = "a host tensor" if self._mode is not None else f"a {t.device} tensor"
                raise AssertionError(
                    f"dist.{name} sends {where} (shape {tuple(t.shape)}, {t.dtype}) over a "
                    f"{self.device.type} group: NCCL refuses it; create it on groups.device")
        self.calls += 1

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            self._check(name, args, kwargs)
            return fn(*args, **kwargs)
        return wrapped

    def __enter__(self):
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        return False
