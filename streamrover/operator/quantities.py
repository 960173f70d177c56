"""Kubernetes quantities in the job spec: memory (``512Mi``, ``2Gi``, ``1.5G``) and CPU (``2``, ``0.5``, ``500m``).

:data:`Memory` and :data:`Cpu` are the pydantic field types ``spec.py`` uses; the platforms read pod limits back
with :func:`parse_memory` and print sizes with :func:`format_memory`. Re-exported by :mod:`.spec`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")


def parse_memory(value: Any) -> int:
    """Bytes from a Kubernetes memory quantity (``512Mi``, ``2Gi``, ``1.5G``) or a plain integer."""
    if isinstance(value, bool):
        raise ValueError("a memory size, like 512Mi or 2Gi")
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a memory size (like 512Mi, 2Gi or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def parse_cpu(value: Any) -> float:
    """Cores from a Kubernetes CPU quantity (``2``, ``0.5``, ``500m``)."""
    if isinstance(value, bool):
        raise ValueError("a CPU count, like 2 or 500m")
    text = str(value).strip()
    try:
        cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a CPU count (like 2, 0.5 or 500m)") from None
    if cores <= 0:
        raise ValueError("must be more than 0")
    return cores


def format_memory(nbytes: int) -> str:
    """The shortest exact binary quantity (``1536Mi``), else bytes."""
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        if nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


Memory = Annotated[int, BeforeValidator(parse_memory), Field(gt=0, description="bytes; or 512Mi, 2Gi, 1.5G")]
Cpu = Annotated[float, BeforeValidator(parse_cpu), Field(description="cores; or 500m")]
