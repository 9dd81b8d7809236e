"""Turning caller tensors (numpy arrays or torch tensors) into the float32
matrices hmem stores, with every check a bad input deserves.

torch is optional: it is only touched when the caller passes a torch tensor
(detected by type, without importing torch).  float16 and bfloat16 inputs
become float32 exactly; float64 is rounded to float32, the stored dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hmem.errors import InvalidTensorError


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def to_numpy(x: Any, what: str) -> np.ndarray:
    """A numpy view or copy of a numpy array or torch tensor, float32 if it was a float."""
    if is_torch(x):
        t = x.detach()
        if t.is_floating_point() and t.dtype != _torch_float32(t):
            t = t.float()  # bfloat16 / float16 / float64 -> float32 in torch, exactly for the halves
        try:
            return t.cpu().numpy()
        except (RuntimeError, TypeError) as exc:
            raise InvalidTensorError(f"{what}: cannot read this torch tensor ({exc})") from None
    if isinstance(x, np.ndarray):
        return x
    raise InvalidTensorError(f"{what} must be a numpy array or a torch tensor, got {type(x).__name__}")


def bf16_words(x: Any) -> np.ndarray | None:
    """The 16-bit words of a torch bfloat16 tensor as a uint16 numpy view
    (on the CPU; a tensor elsewhere is copied there as bfloat16, half the
    bytes of float32), or None for anything else.  put_cache hands them to
    put_many as they are (storage.Bf16Rows) instead of widening the whole
    cache to float32 first."""
    if not is_torch(x):
        return None
    t = x.detach()
    import torch  # only reached with a torch tensor in hand

    if t.dtype != torch.bfloat16:
        return None
    try:
        return t.cpu().view(torch.int16).numpy().view(np.uint16)
    except (RuntimeError, TypeError):
        return None  # a tensor numpy cannot view (to_numpy then says why)


def _torch_float32(t: Any) -> Any:
    import torch  # only reached with a torch tensor in hand

    return torch.float32


def as_rows(x: Any, what: str, embed_dim: int, *, allow_vector: bool = False) -> np.ndarray:
    """A C-contiguous float32 [n, embed_dim] matrix with n >= 1 and finite
    values; a view of the input when it already is one.

    With `allow_vector`, a 1-D [embed_dim] input is one row.
    """
    arr = to_numpy(x, what)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise InvalidTensorError(f"{what} must hold floats, got dtype {arr.dtype}")
    if allow_vector and arr.ndim == 1:
        arr = arr.reshape(1, -1)
    if arr.ndim != 2:
        shape = "[n_tokens, embed_dim]" + (" or [embed_dim]" if allow_vector else "")
        raise InvalidTensorError(f"{what} must have shape {shape}, got {list(arr.shape)}")
    if arr.shape[1] != embed_dim:
        raise InvalidTensorError(f"{what} has rows of {arr.shape[1]} values; the store's embed_dim is {embed_dim}")
    if arr.shape[0] < 1:
        raise InvalidTensorError(f"{what} has no tokens (shape {list(arr.shape)})")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow becomes inf, refused just below
        rows = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(rows).all():
        raise InvalidTensorError(f"{what} holds NaN or infinite values")
    return rows
