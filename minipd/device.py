"""Which device and dtype minipd runs on (the kernel backends available there: :mod:`minipd.kernels.backend`)."""

from __future__ import annotations

import torch

from minipd.errors import ParameterError


def default_device() -> torch.device:
    """CUDA when present, otherwise the CPU. No code path assumes a GPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA (the dtype models ship in), fp32 on CPU (fast and exact there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


#: The dtypes minipd runs in, by every name ``LLM(dtype=...)`` accepts for them (vLLM's spellings).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def available_devices() -> list[str]:
    """The devices this machine can run on, in words: ``cpu``, each ``cuda:N``, and ``mps`` when present."""
    found = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` checked against this machine; None picks :func:`default_device`.

    Accepts ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device`` of those. A device
    the machine lacks is a ``ValueError`` naming ``device`` and what is available, so a missing GPU is
    reported before any weights are read rather than deep inside loading.
    """
    if device is None:
        return default_device()
    available = ", ".join(available_devices())
    if not isinstance(device, (str, torch.device)):
        raise ParameterError("device", f"device must be None, a string such as 'cpu' or 'cuda:0', or a torch.device; "
                                       f"got {type(device).__name__} (available here: {available})")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:  # torch's message lists device types minipd does not run on; ours is shorter
        raise ParameterError("device", f"device {device!r} is not a device name (available here: {available})") from err
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ParameterError("device", f"device {device!r} needs CUDA, which this machine lacks "
                                           f"(available here: {available})")
        if resolved.index is not None and resolved.index >= count:
            raise ParameterError("device", f"device {device!r}: this machine has {count} CUDA device(s) "
                                           f"(available here: {available})")
        return resolved
    if resolved.type == "mps" and torch.backends.mps.is_available():
        return resolved
    raise ParameterError("device", f"device {device!r} is not available; minipd runs on cpu, cuda or mps "
                                   f"(available here: {available})")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """``dtype`` as a torch dtype: None or ``"auto"`` picks :func:`default_dtype` for ``device``.

    Accepts ``torch.float32``, ``torch.float16``, ``torch.bfloat16`` and the names in
    :data:`DTYPE_NAMES` (``"bf16"``, ``"half"`` ...); anything else is a ``ValueError`` naming ``dtype``.
    """
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        return default_dtype(device)
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    allowed = ", ".join(["'auto'", *(repr(n) for n in DTYPE_NAMES), "torch.float32", "torch.float16",
                         "torch.bfloat16"])
    raise ParameterError("dtype", f"dtype must be None or one of {allowed}; got {dtype!r}")
