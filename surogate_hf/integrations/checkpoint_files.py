"""Opening checkpoint files: a truncated or corrupt safetensors file is named, never a raw SafetensorError."""

from __future__ import annotations

import contextlib


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read; raised before any weight is set, so nothing was loaded."""


@contextlib.contextmanager
def open_safetensors(path: str):
    """`safetensors.safe_open(path, "pt")`, with read errors (bad header, truncated file, bad tensor bytes) raised
    as CheckpointFileError naming the file. Call it from the quantizers' before-loading hooks only, where
    raising still leaves the model untouched."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointFileError(
            f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}; nothing was loaded"
        ) from exc
