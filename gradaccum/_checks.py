"""Argument validators shared by the public constructors: a leaf (nothing of gradaccum's above).

``check=`` and ``timeout=`` mean the same for every sync, and ``positive`` is the rule for a
positive, finite number (``bucket_mb``, ``clip``, ``timeout``).
"""

from __future__ import annotations

from typing import Literal

import torch

from ._errors import describe

__all__ = ["CHECKS", "Check", "check_bool", "check_options", "check_timeout", "positive"]

Check = Literal["fingerprint", "full", "never"]
CHECKS = ("fingerprint", "full", "never")


def check_options(where: str, check: object, timeout: object, overlap: object = True) -> None:
    """Validate the options every sync shares: ``check``, ``timeout``, ``overlap``."""
    if not isinstance(check, str) or check not in CHECKS:
        raise ValueError(
            f"{where}: check must be one of {', '.join(map(repr, CHECKS))}, got "
            f"{describe(check)}; pass check='fingerprint' (the default: the ranks check that their "
            f"trees agree in every window), 'full' (a debug mode) or 'never'."
        )
    check_timeout(where, timeout)
    check_bool(where, "overlap", overlap)


def check_bool(where: str, name: str, value: object) -> None:
    """Validate a ``True``/``False`` keyword (a NumPy bool is named, not taken for one)."""
    if not isinstance(value, bool):
        kind = type(value)
        raise TypeError(
            f"{where}: {name} must be a bool, got {describe(value)} "
            f"({kind.__module__}.{kind.__qualname__}); pass {name}=True or False."
        )


def check_timeout(where: str, timeout: object) -> None:
    """Validate ``timeout``: None, or a positive, finite number of seconds."""
    if timeout is not None and not positive(timeout):
        raise ValueError(
            f"{where}: timeout must be None or a positive, finite number of seconds, got "
            f"{describe(timeout)}; pass e.g. timeout=60."
        )


def positive(x: object) -> bool:
    """Whether ``x`` is a positive, finite int or float (not a bool, NaN or inf)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < float("inf")


def check_reduce_dtype(where: str, reduce_dtype: object, default: str) -> None:
    """Refuse a ``reduce_dtype=`` that is neither ``None`` nor a floating ``torch.dtype``.

    ``default`` says what ``None`` means for the caller's sync.
    """
    if reduce_dtype is None or (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        return
    error = ValueError if isinstance(reduce_dtype, torch.dtype) else TypeError
    raise error(
        f"{where}: reduce_dtype must be a floating torch.dtype, got {describe(reduce_dtype)}; "
        f"pass e.g. reduce_dtype=torch.bfloat16 (half the bytes of float32 on the wire), or "
        f"None (the default: {default})."
    )
