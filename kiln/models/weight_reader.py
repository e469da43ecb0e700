"""Read safetensors checkpoints into GPU memory fast.

``safetensors.safe_open(device="cuda")`` copies each tensor from the memory-mapped file with one
pageable host-to-device copy: one thread faults the pages in, and the copy waits for it (about
2.5 GB/s for a 16 GB checkpoint read from the page cache). Here several threads read byte ranges
of the file with ``preadv`` (the GIL is released) into a ring of pinned buffers, and the main thread
copies each filled buffer into the tensor's GPU memory asynchronously; so the disk (or page cache),
the host memory bus and the PCIe link work at once. The safetensors header is read with the
library's own format rules: an 8-byte little-endian length, then a JSON map of name to dtype, shape
and byte offsets into the data that follows.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import torch

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# One read, and one host-to-device copy. Each chunk takes the GIL a few times, and a start reads
# beside Python on two other threads (the model's construction, the tokenizer's import): with
# 32 MiB rather than 16, a Llama-3-8B checkpoint in the page cache was in GPU memory 0.5 s sooner
# and the tokenizer built 0.6 s sooner on an H200 (benchmarks/results/startup-H200.md#load_phases).
CHUNK_BYTES = 32 << 20
NUM_BUFFERS = 16  # pinned buffers in flight: 512 MiB of pinned host memory
NUM_THREADS = 8


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(path: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, in the order their bytes are stored."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path!r} is not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise ValueError(f"{path!r} has an unreadable safetensors header: {e}") from e
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path!r}: tensor {name!r} has dtype {info['dtype']}, which kiln cannot load")
        start, end = info["data_offsets"]
        entries.append(TensorEntry(name, DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + end))
    return sorted(entries, key=lambda e: e.start)


def _read_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


def iter_file_to_device(path: str, device: torch.device, pool: ThreadPoolExecutor,
                        buffers: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on ``device``) for every tensor of one file, in storage order. A tensor is
    yielded once all of its copies are enqueued on the current stream, so the caller's work on it
    is ordered after them."""
    entries = read_header(path)
    on_gpu = torch.device(device).type == "cuda"
    fd = os.open(path, os.O_RDONLY)
    try:
        free = deque(range(len(buffers)))
        ready_at: list[torch.cuda.Event | None] = [None] * len(buffers)
        # (future, buffer index, destination bytes, number of bytes, index of the entry it ends or -1)
        pending: deque[tuple[Future, int, torch.Tensor, int, int]] = deque()
        dests: list[torch.Tensor] = []

        def chunks() -> Iterator[tuple[int, int, torch.Tensor, int]]:
            for i, e in enumerate(entries):
                dest = torch.empty(e.end - e.start, dtype=torch.uint8, device=device)
                dests.append(dest)
                for off in range(0, max(e.end - e.start, 1), CHUNK_BYTES):
                    n = min(CHUNK_BYTES, e.end - e.start - off)
                    last = off + CHUNK_BYTES >= e.end - e.start
                    yield e.start + off, n, dest[off:off + n], i if last else -1

        source = chunks()
        exhausted = False
        next_yield = 0
        while True:
            while not exhausted and free:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                offset, n, dest, ends = item
                b = free.popleft()
                if ready_at[b] is not None:
                    ready_at[b].synchronize()  # its last copy has left the buffer
                view = memoryview(buffers[b].numpy())[:n]
                pending.append((pool.submit(_read_into, fd, view, offset) if n else None, b, dest, n, ends))
            if not pending:
                break
            fut, b, dest, n, ends = pending.popleft()
            if fut is not None:
                try:
                    fut.result()
                except OSError as e:
                    raise OSError(f"{path!r}: {e}; the file is shorter than its safetensors header says "
                                  "(an interrupted download or copy?): fetch it again") from e
                dest.copy_(buffers[b][:n], non_blocking=on_gpu)
                if on_gpu:
                    event = torch.cuda.Event()
                    event.record()
                    ready_at[b] = event
            free.append(b)
            if ends >= 0:
                while next_yield <= ends:
                    e = entries[next_yield]
                    yield e.name, dests[next_yield].view(e.dtype).view(e.shape)
                    dests[next_yield] = None  # the caller holds it now
                    next_yield += 1
    finally:  # a consumer that stops early: let running reads end before their fd and buffers go
        for fut, *_ in pending:
            if fut is not None and not fut.cancel():
                try:
                    fut.result()
                except OSError:
                    pass
        os.close(fd)


def iter_files_to_device(paths: list[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_file_to_device`` over several files with one thread pool and one set of buffers
    (pinned when ``device`` is a GPU)."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(NUM_BUFFERS)]
    with ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="kiln-weights") as pool:
        for path in paths:
            yield from iter_file_to_device(path, device, pool, buffers)
    if on_gpu:
        torch.cuda.current_stream(device).synchronize()  # the pinned buffers are freed after this


@contextlib.contextmanager
def open_safetensors(path: str) -> Iterator[Any]:
    """``safe_open`` on the CPU; a file it cannot read (missing, cut short, not safetensors at all)
    is a ValueError that names it."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path!r} is not a readable safetensors file ({e}); an interrupted download or copy? "
                         "fetch it again") from None
    with handle as f:
        yield f


def iter_file_into(path: str, destinations: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Every tensor of one safetensors file on the CPU, in storage order. One whose place in
    ``destinations`` (name -> contiguous CPU tensor) has its dtype and shape is read straight into
    it with ``preadv`` and given as (name, None); the others come mapped from the file, as
    ``safe_open`` gives them. A read into place faults in the destination's pages once, where a
    mapped tensor copied into it faults in the file's pages and then the destination's (a file
    shorter than its header is refused when it is opened)."""
    if not hasattr(os, "preadv"):  # not every platform's Python has it
        destinations = {}
    with open_safetensors(path) as mapped:
        fd = os.open(path, os.O_RDONLY)
        try:
            for e in read_header(path):
                dest = destinations.get(e.name)
                if (dest is None or dest.device.type != "cpu" or dest.dtype != e.dtype
                        or tuple(dest.shape) != e.shape or not dest.is_contiguous()):
                    yield e.name, mapped.get_tensor(e.name)
                    continue
                _read_into(fd, memoryview(dest.reshape(-1).view(torch.uint8).numpy()), e.start)
                yield e.name, None
        finally:
            os.close(fd)


class ReadAhead:
    """``tensors`` drawn by a thread of its own from the call on, at most ``max_bytes`` of them held
    ahead of the consumer (one tensor at least): a start reads the checkpoint while the main thread
    still builds the model the tensors are copied into. An error reaches the consumer after the
    tensors drawn before it. The consumer calls ``close()`` when done, also after an error of its
    own: it stops the thread and drops the tensors it holds."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]], max_bytes: int, device: torch.device) -> None:
        self._tensors, self._max_bytes, self._device = tensors, max_bytes, device
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, torch.Tensor]] = deque()
        self._bytes = 0
        self._done = self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, name="kiln-read-ahead", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread
            for name, tensor in self._tensors:
                size = tensor.nbytes
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or not self._queue
                                        or self._bytes + size <= self._max_bytes)
                    if self._stop:
                        return
                    self._queue.append((name, tensor))
                    self._bytes += size
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._error = e
        finally:
            close = getattr(self._tensors, "close", None)
            if close is not None:
                close()  # a generator's own cleanup (its reads in flight), on this thread
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._done)
            if not self._queue:
                self._thread.join()
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopIteration
            name, tensor = self._queue.popleft()
            self._bytes -= tensor.nbytes
            self._cond.notify_all()
        return name, tensor

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()
