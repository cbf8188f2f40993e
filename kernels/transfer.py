"""Values between the host and the device: copied without the host waiting for the device,
a step's many arrays in one copy."""
from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch


def from_host(values, device: torch.device) -> torch.Tensor:
    """Host values (an array or a list) on device without the host waiting for it: on CUDA a
    copy from pageable memory synchronises with the stream, one from pinned memory does not."""
    tensor = torch.as_tensor(values)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


_TORCH_DTYPES = {np.dtype(t): getattr(torch, t) for t in ("bool", "uint8", "int8", "int16", "int32", "int64",
                                                           "float16", "float32", "float64")}


def from_host_many(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays on device in one copy (from_host's): each array, under its name, a view of
    what arrived, with its dtype and shape (pack_arrays). On a CPU each array is its tensor
    (torch.from_numpy): nothing to copy, and no view to make, each a torch op."""
    if device.type == "cpu":
        return {name: torch.from_numpy(np.require(a, requirements="CW")) for name, a in arrays.items()}
    packed, starts = pack_arrays(arrays)
    arrived, views = from_host(packed, device), {}
    for (name, a), start in zip(arrays.items(), starts):
        view = arrived[start:start + a.nbytes].view(_TORCH_DTYPES[a.dtype])
        views[name] = view if a.ndim == 1 else view.view(a.shape)   # a view less per 1-D array: a step has ~10
    return views


def pack_arrays(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """The arrays' bytes end to end, and where each starts: at a multiple of 16 bytes, as the
    allocator's tensors do (Triton compiles a kernel for pointers so aligned)."""
    starts = list(accumulate((-(-a.nbytes // 16) * 16 for a in arrays.values()), initial=0))
    packed = np.empty(max(starts[-1], 16), dtype=np.uint8)   # never empty: an empty tensor's stride is 0
    for array, start in zip(arrays.values(), starts):
        packed[start:start + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return packed, starts


def to_host(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
    """Device tensors copied to the host behind what is queued, without the host waiting: the
    copies (pinned) and the event after which they hold the values (None: they are the tensors,
    already on the host)."""
    if not tensors or not tensors[0].is_cuda:
        return tensors, None
    copies = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
    ready = torch.cuda.Event()
    ready.record()
    return copies, ready
