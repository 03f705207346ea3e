"""Host <-> device traffic of one step without a synchronization until its results are read.

A CUDA copy from pageable host memory waits for the stream to drain before it starts, and a
`.tolist()` of a device tensor waits for everything queued before it: a step built from
`torch.tensor(list, device=...)` calls and read back tensor by tensor stops the host once per call.
Here a step's inputs go through preallocated, pinned host buffers with non-blocking copies into
preallocated device buffers (vLLM's CpuGpuBuffer), and its results come back in one wait.

On the CPU the device buffer is the host buffer itself, so nothing is copied at all.
"""

from __future__ import annotations

import numpy as np
import torch


class StagingGuard:
    """Orders the reuse of pinned staging memory after the copies that read it.

    A non-blocking copy reads its pinned source when the device reaches it, possibly after the host
    has moved on to the next step; writing that step's inputs into the same buffers first waits
    for the copies of the step before (`wait`), which the step's end marks (`mark`). Normally the
    wait is already over: the step's results were read back after those copies.
    """

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False

    def mark(self) -> None:
        if self._event is not None:
            self._event.record()
            self._pending = True


class StagedBuffer:
    """A preallocated device tensor (`on_device`) with a host twin (`host`, pinned on CUDA) that
    numpy writes into (`np`); `to_device(n)` copies the first `n` entries along the first dimension
    without waiting and returns those entries of the device tensor.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self._allocate(shape, dtype, device)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.on_device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.host
        self.np: np.ndarray = self.host.numpy()

    def put(self, values: np.ndarray) -> torch.Tensor:
        """`values` written to the host buffer's first entries and sent to the device; a step
        larger than the buffer (rare: the buffers are sized by the scheduler's limits) regrows it."""
        n = len(values)
        if n > self.host.shape[0]:
            shape = (max(n, 2 * self.host.shape[0]), *self.host.shape[1:])
            self._allocate(shape, self.host.dtype, self.on_device.device)
        self.np[:n] = values
        return self.to_device(n)

    def to_device(self, n: int) -> torch.Tensor:
        if self.on_device is not self.host:
            self.on_device[:n].copy_(self.host[:n], non_blocking=True)
        return self.on_device[:n]

    def copy_rows(self, row: int, start: int | None = None, end: int | None = None) -> None:
        """Copy entry `row` to the device (of a two-dimensional buffer: its entries start..end)."""
        if self.on_device is self.host:
            return
        if start is None:
            self.on_device[row : row + 1].copy_(self.host[row : row + 1], non_blocking=True)
        else:
            self.on_device[row, start:end].copy_(self.host[row, start:end], non_blocking=True)


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """An occasional host array (one not worth a preallocated buffer) on the device without a wait:
    through pinned memory, which the caching host allocator keeps until the copy has read it."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened into one float64 vector: exact for token ids and ranks (below 2**53)
    and for float32 log-probabilities, infinities included."""
    return torch.cat([tensor.reshape(-1).to(torch.float64) for tensor in tensors])


def unpack(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`pack`'s inverse: pieces of `packed` with the shapes and types of `like`."""
    pieces = packed.split([tensor.numel() for tensor in like])
    return [piece.reshape(tensor.shape).to(tensor.dtype) for piece, tensor in zip(pieces, like, strict=True)]


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host after one copy and one wait: on CUDA they are packed into one vector
    on the device, copied without waiting into pinned memory, then unpacked; a `.tolist()` a tensor
    would copy and wait once each."""
    if not tensors or tensors[0].device.type != "cuda":
        return [tensor.cpu() for tensor in tensors]
    packed = pack(tensors)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    # An event, not the stream: its wait is the step's one, and not an implicit synchronization
    # that torch.cuda.set_sync_debug_mode reports (tests/model/test_gpu_paths.py counts those).
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()
    return unpack(host, tensors)
