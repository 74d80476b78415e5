"""The names the library uses for dtypes, declared once.

``Problem``, ``BackendSpec`` and recipes name floating-point dtypes as strings
(``"bfloat16"``) so that a problem stays a plain, hashable description; this module maps
those names to torch dtypes and back, and says which integer dtypes ``m_splits`` may have.
"""

from __future__ import annotations

from typing import Literal

import torch

#: A floating-point dtype as Problem, BackendSpec and Recipe name it.
DTypeName = Literal["bfloat16", "float16", "float32"]

#: The floating-point dtypes operands and results may have, by name.
FLOAT_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FLOAT_DTYPE_NAMES: tuple[str, ...] = tuple(FLOAT_DTYPES)
_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (any dtype: ``torch.int8`` -> ``"int8"``)."""
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


#: The integer dtypes an ``m_splits`` tensor may have, and how errors say it (built from
#: the tuple, so the two cannot disagree).
SPLIT_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_SPLIT_NAMES = [dtype_name(d) for d in SPLIT_DTYPES]
SPLIT_TENSOR = f"a 1-D integer tensor ({', '.join(_SPLIT_NAMES[:-1])} or {_SPLIT_NAMES[-1]})"
