"""The boundary dtypes the contract knows, by name, and their finite range.

numpy names its own dtypes (``float32``, ``float16``, …). The formats accelerators compute
in and numpy lacks (``bfloat16``, the float8 formats) come from ``ml_dtypes``, which
registers them with numpy: once it is imported, ``np.dtype("bfloat16")`` is a numpy dtype
whose arrays convert, compare and serialise like any other. Every dtype name the kit reads
goes through ``numpy_dtype`` here, which imports ``ml_dtypes`` the first time numpy does not
know a name, so that the registration has always happened before numpy is asked again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: The formats beyond numpy's own, from ``ml_dtypes``, that a boundary residual may be in.
EXTRA_FLOAT_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype called ``name`` (``bfloat16`` and the float8 formats included);
    raises TypeError when neither numpy nor ``ml_dtypes`` knows it."""
    try:
        return np.dtype(name)
    except TypeError:
        if name not in EXTRA_FLOAT_DTYPES:
            raise
    import ml_dtypes  # noqa: F401  (registers its dtypes with numpy)

    return np.dtype(name)


def is_dtype_name(name: object) -> bool:
    """Whether ``name`` is a string naming a dtype numpy knows (``ml_dtypes``'s included)."""
    if not isinstance(name, str):
        return False
    try:
        numpy_dtype(name)
    except TypeError:
        return False
    return True


def float_info(name: str) -> Any:
    """The finite range of the floating-point dtype ``name`` (``max``, ``tiny``,
    ``smallest_subnormal``, ``eps``, as ``numpy.finfo`` gives them), or None when ``name``
    is no floating-point dtype."""
    try:
        dtype = numpy_dtype(name)
    except TypeError:
        return None
    if dtype.name in EXTRA_FLOAT_DTYPES:
        import ml_dtypes

        return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]  # ml_dtypes leaves finfo unannotated
    return np.finfo(dtype) if np.issubdtype(dtype, np.floating) else None
