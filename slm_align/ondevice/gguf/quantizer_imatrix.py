"""The importance matrix handed to llama.cpp's quantizer: collected by export (export/imatrix.py),
passed here as the C array ``llama_model_quantize_params.imatrix`` reads."""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np


def imatrix_array(named: Optional[dict[str, np.ndarray]]):
    """The C array llama.cpp's quantizer reads (NULL-terminated), and the buffers it points
    into (keep them alive)."""
    import llama_cpp

    if not named:
        return None, []
    buffers = [(name.encode(), np.ascontiguousarray(values, dtype=np.float32))
               for name, values in named.items()]
    entries = (llama_cpp.llama_model_imatrix_data * (len(buffers) + 1))()
    for entry, (name, values) in zip(entries, buffers):
        entry.name = name
        entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entry.size = values.size
    return entries, buffers
