"""Host tensors onto a CUDA device through pinned memory, the copies overlapping the reads.

A copy from pageable host memory goes through the driver's own bounce buffer, one piece at a time,
and each `.to("cuda")` waits for its copy: a snapshot's layers (2 x layers tensors) then load at a
fraction of the bus. Here the bytes pass through two pinned staging buffers of CHUNK bytes: while
the device copies one buffer (non_blocking, on the current stream), the CPU fills the other. The
staging buffers come from torch's caching host allocator, so after the first load no page is pinned
again. The device tensors are ordered after their copies on the current stream: a kernel reading
them there waits for its bytes without a host synchronization.
"""

from __future__ import annotations

import torch

CHUNK = 32 << 20  # bytes a staging buffer holds: large enough that a copy's fixed cost is small against it


def to_device(tensors: list[torch.Tensor], device: torch.device | str, chunk: int = CHUNK) -> list[torch.Tensor]:
    """Copies of the host `tensors` on `device` (same dtypes and shapes), staged through two pinned
    buffers of `chunk` bytes (module doc). On a CPU `device` the staging is plain memory: the same
    pieces in the same order, so the tests run it without a GPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    out = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors]
    stage = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]  # when the copy out of each buffer has finished
    i = 0
    for src, dst in zip(tensors, out):
        flat_src = src.contiguous().reshape(-1).view(torch.uint8)
        flat_dst = dst.view(-1).view(torch.uint8)
        for a in range(0, flat_src.numel(), chunk):
            n = min(chunk, flat_src.numel() - a)
            b = i % 2
            if (last := done[b]) is not None:
                last.synchronize()  # its last copy to the device has read it
            buf = stage[b][:n]
            buf.copy_(flat_src[a : a + n])
            flat_dst[a : a + n].copy_(buf, non_blocking=cuda)
            if cuda:
                done[b] = event = torch.cuda.Event()
                event.record()
            i += 1
    return out
