"""The values of a file image (worker_proc/lora/file_image.py) checked as the slots will hold them:
every tensor cast to the model dtype, as the slot copy casts it on the device (round to nearest,
through float32, the same conversion on the host and the device), must be finite, and so must
every scaling in float32, as the slot tables store them.

Every read from disk runs it on the bytes it keeps, whatever the content digest says: the digest
says which version the bytes are, not that they are fit to serve, and the HTTP process's check
at registration ran on another read of the files. An adapter may still hold huge finite values;
keeping them to their own rows is the kernels' work (kernels/lora_ref.py)."""

from __future__ import annotations

import math

import torch

from ledgerserve.shared.adapter_types import AdapterError
from ledgerserve.worker_proc.lora.file_image import FileTensor, ImageBytes, ImageLayout, SlotLayout

CHECK_CHUNK_BYTES = 4 << 20  # looked at, and cast, this much at a time


def check_image(image: ImageBytes, layout: ImageLayout, slots: SlotLayout, dtype: torch.dtype) -> None:
    """AdapterError naming the first slice whose scaling or A / B is not finite in `dtype`."""
    for piece in layout.pieces:
        spec = slots.slices[piece.slice]
        where = f"{spec.module} slice {spec.index}"
        if not math.isfinite(layout.scalings[piece.slice]):
            raise AdapterError(f"the adapter's scaling of {where} is infinite in float32.")
        for name, tensor in (("A", piece.a), ("B", piece.b)):
            if not is_finite(image, tensor, dtype):
                raise AdapterError(
                    f"the adapter's {name} of {where} holds NaN or infinite values once cast to the model's "
                    f"dtype ({str(dtype).removeprefix('torch.')})."
                )


def is_finite(image: ImageBytes, tensor: FileTensor, dtype: torch.dtype) -> bool:
    """Whether every value of `tensor` is finite once cast to `dtype`."""
    itemsize = tensor.torch_dtype.itemsize
    step = CHECK_CHUNK_BYTES - CHECK_CHUNK_BYTES % itemsize
    stop = tensor.offset + tensor.num_bytes
    for start in range(tensor.offset, stop, step):
        values = _values(image.ranges(start, min(stop, start + step)), tensor.torch_dtype)  # [n] file dtype
        if not bool(torch.isfinite(values.to(dtype)).all()):
            return False
    return True


def _values(views: list[torch.Tensor], file_dtype: torch.dtype) -> torch.Tensor:
    """Image bytes (uint8 views over one or two extents, whole values) as values of `file_dtype`;
    copied where they straddle extents or sit off their item size (a tensor unaligned in its file)."""
    raw = views[0] if len(views) == 1 else torch.cat(views)  # [num_bytes] uint8
    if raw.data_ptr() % file_dtype.itemsize:
        raw = raw.clone()
    return raw.view(file_dtype)
