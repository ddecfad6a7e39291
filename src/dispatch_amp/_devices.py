"""Which device this machine offers, asked of ``torch.accelerator``: the one place the
package detects devices.

``torch.accelerator`` knows every backend torch was built for (CUDA, ROCm, MPS, XPU and
the out-of-tree ones) and is in every torch release the project supports; a build has at
most one accelerator, and ``check_available=True`` adds the runtime check (drivers loaded,
a device visible). Callers that follow another library's choice (Lightning picks only
CUDA or MPS on its own) narrow the answer with ``among``.

Example::

    accelerator_type()                       # "cuda" on a GPU machine, None on a CPU-only one
    default_device_type()                    # the accelerator's type, else "cpu"
    default_device_type(among=("cuda",))     # "cuda" where CUDA runs, else "cpu"
    device_available("mps")                  # False unless this is a Mac with MPS
"""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["accelerator_type", "default_device_type", "device_available"]


def accelerator_type() -> str | None:
    """The device type of the accelerator torch can use here now (``"cuda"``, ``"mps"``,
    ``"xpu"``, ...), or None: a CPU-only build, or no device visible.

    Example::

        >>> (accelerator_type() == "cuda") == torch.cuda.is_available()
        True
    """
    device = torch.accelerator.current_accelerator(check_available=True)
    return None if device is None else device.type


def default_device_type(among: Collection[str] | None = None) -> str:
    """The accelerator's device type when there is one (and it is one of ``among``, if
    given), else ``"cpu"``.

    Example::

        >>> default_device_type(among=("cuda", "mps")) in ("cuda", "mps", "cpu")   # Lightning's "auto"
        True
    """
    found = accelerator_type()
    if found is None or (among is not None and found not in among):
        return "cpu"
    return found


def device_available(device_type: str) -> bool:
    """Whether this machine can run on ``device_type`` (always for ``"cpu"``).

    Example::

        >>> device_available("cpu")
        True
    """
    return device_type == "cpu" or accelerator_type() == device_type
