"""Fingerprints of weights, so the gate can check after each wake or refit that the engine
serves exactly the weights the trainer published (`async_rl.handoff_checks`).

A tensor's fingerprint is a checksum over a fixed sample of its elements: viewed as [rows,
columns] (a 1-D tensor as one column), one element of every row, in column
``(row * 40503 + 17) % columns``. Every row is read, so a row that was not copied or was
corrupted changes its tensor's fingerprint, at about 1/columns of the cost of reading it all.
The checksum is ``sum_j bits(x_j) * (2j + 1)`` over the samples j in int64 (wrapping), with
``bits`` the element's bit pattern: integers, so any order of summation gives the same value
(the GPU kernel and the torch path agree bit for bit), and weighted by position, so swapped
rows show too.

A `Probe` names a tensor and says where its sampled elements live: the trainer and the engine
both probe their model's parameters where they are, by their names (the engine reads no other
copy of them). On CUDA one Triton launch per dtype
reads every probe's samples through a table of their addresses, in chunks of `_CHUNK` samples,
and one `index_add_` sums the chunks per probe; elsewhere each probe is a gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from triton.runtime.jit import KernelInterface

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


class Probe(NamedTuple):
    """The samples of tensor ``name``: elements ``indices`` of the flat ``base``."""

    name: str
    base: Tensor
    indices: Tensor


def sample_rows(shape: Sequence[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """The sampled (row, column) of a tensor of ``shape``: one per row of its [rows, columns]
    view."""
    columns = shape[-1] if len(shape) > 1 else 1
    rows = torch.arange(int(torch.Size(shape).numel()) // columns, device=device)
    return rows, (rows * 40503 + 17) % columns


def parameter_probe(name: str, tensor: Tensor) -> Probe:
    """The probe of a contiguous tensor read where it is."""
    rows, columns = sample_rows(tensor.shape, tensor.device)
    width = tensor.shape[-1] if tensor.dim() > 1 else 1
    return Probe(name, tensor.detach().view(-1), rows * width + columns)


def parameter_probes(named: Iterable[tuple[str, Tensor]]) -> list[Probe]:
    return [parameter_probe(name, tensor) for name, tensor in named]


class Fingerprinter:
    """Computes ``{name: checksum}`` for a fixed list of probes (built once: the address table
    is rebuilt only when a base tensor moves)."""

    def __init__(self, probes: Sequence[Probe]) -> None:
        self.probes = list(probes)
        self._by_dtype: dict[torch.dtype, list[Probe]] = {}
        for probe in self.probes:
            self._by_dtype.setdefault(probe.base.dtype, []).append(probe)
        self._tables: dict[torch.dtype, tuple[tuple[int, ...], list[str], Tensor, Tensor]] = {}

    def __call__(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for dtype, probes in self._by_dtype.items():
            device = probes[0].base.device
            if device.type == "cuda" and _kernel() is not None:
                names, sums = self._on_gpu(dtype, probes)
                out.update(zip(names, sums.tolist(), strict=True))
            else:
                out.update((p.name, checksum(p.base[p.indices])) for p in probes)
        return out

    def _on_gpu(self, dtype: torch.dtype, probes: list[Probe]) -> tuple[list[str], Tensor]:
        key = tuple(p.base.data_ptr() for p in probes)
        table = self._tables.get(dtype)
        if table is None or table[0] != key:
            table = (key, *_address_table(probes))
            self._tables[dtype] = table
        _, names, addresses, chunks = table
        partial = torch.empty(chunks.shape[0], dtype=torch.int64, device=addresses.device)
        kernel = _kernel()
        assert kernel is not None
        value, bits = _TRITON_DTYPES[dtype]
        kernel[(chunks.shape[0],)](addresses, chunks, partial, DTYPE=value, BITS=bits, CHUNK=_CHUNK)
        sums = torch.zeros(len(names), dtype=torch.int64, device=addresses.device)
        return names, sums.index_add_(0, chunks[:, 2], partial)


# Samples a GPU program sums: every tensor's samples are cut into chunks of this many, so the
# embedding's 150k rows are spread over programs like everything else.
_CHUNK = 2048


def _address_table(probes: list[Probe]) -> tuple[list[str], Tensor, Tensor]:
    """Every sample's address, and per chunk [first sample, end, probe, the probe's first
    sample] (int64 on the probes' device)."""
    size = probes[0].base.element_size()
    addresses = torch.cat([p.base.data_ptr() + p.indices * size for p in probes])
    rows, start = [], 0
    for number, probe in enumerate(probes):
        end = start + probe.indices.numel()
        rows += [(first, min(first + _CHUNK, end), number, start) for first in range(start, end, _CHUNK)]
        start = end
    chunks = torch.tensor(rows, dtype=torch.int64, device=addresses.device)
    return [p.name for p in probes], addresses, chunks


def checksum(values: Tensor) -> int:
    """The module docstring's checksum of a 1-D tensor of sampled values (the torch path)."""
    bits = values.contiguous().view(_BITS[values.dtype]).to(torch.int64)
    weights = torch.arange(1, 2 * bits.numel() + 1, 2, device=bits.device)
    return int((bits * weights).sum())


_TRITON_DTYPES: dict[torch.dtype, tuple[object, object]] = {}
_KERNEL: list[KernelInterface[Any] | None] = []


def _kernel() -> KernelInterface[Any] | None:
    """The Triton kernel (built on first use), or None without Triton."""
    if not _KERNEL:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _KERNEL.append(None)
            return None
        _TRITON_DTYPES.update(
            {torch.bfloat16: (tl.bfloat16, tl.int16), torch.float16: (tl.float16, tl.int16)}
        )
        _TRITON_DTYPES[torch.float32] = (tl.float32, tl.int32)

        @triton.jit
        def sampled_checksums(
            addresses, chunks, out, DTYPE: tl.constexpr, BITS: tl.constexpr, CHUNK: tl.constexpr
        ):
            # One chunk of one probe's samples: its share of the probe's checksum.
            c = tl.program_id(0)
            lo = tl.load(chunks + 4 * c)
            hi = tl.load(chunks + 4 * c + 1)
            origin = tl.load(chunks + 4 * c + 3)
            j = lo + tl.arange(0, CHUNK)
            inside = j < hi
            pointer = tl.load(addresses + j, mask=inside, other=0).to(tl.pointer_type(DTYPE))
            x = tl.load(pointer, mask=inside, other=0.0)
            bits = x.to(BITS, bitcast=True).to(tl.int64)
            tl.store(out + c, tl.sum(tl.where(inside, bits * (2 * (j - origin) + 1), 0), axis=0))

        _KERNEL.append(sampled_checksums)
    return _KERNEL[0]
