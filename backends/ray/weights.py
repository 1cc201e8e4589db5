"""Weights on their way from the trainer's actor to the engines': one package per version.

The trainer packs its parameters once per published version (`pack`); the controller hands
the package's object reference to every engine replica, which checks it on arrival (`unpack`)
before it copies anything in: the version must be the one the controller announced for this
refit, and every parameter must be there with the engine's own shape and dtype. So a replica
serves one announced version at a time, never a mix of two.

Transports:
- `object_store`: the tensors, copied to CPU, travel through Ray's object store (any two
  machines);
- `cuda_ipc`: engine and trainer share one GPU (two actors in one placement-group bundle): the
  package holds CUDA IPC handles of the trainer's own parameter tensors (torch's
  multiprocessing reductions), and the engine copies from them device to device. The trainer
  does not change its parameters until the refit that reads them has finished (the gate trains
  the next step only after it), so the handles stay valid while they are read;
- `collective`: a broadcast in a process group of the trainer and every replica
  (`backends/ray/broadcast.py`); its `Header` goes through the same `check` before any payload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

Transport = Literal["object_store", "cuda_ipc"]  # a package's; `collective` sends none


class WeightsMismatch(RuntimeError):
    """A package that is not what the engine was told to expect: a bug, never bad input."""


@dataclass(frozen=True)
class Header:
    """What a version's weights are: each tensor's (name, shape, dtype), in the sender's order."""

    version: int
    specs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def header(version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Header:
    return Header(version, tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def check(sent: Header, *, version: int, like: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse weights that are not the announced `version` or not, name for name, the engine's
    own parameters `like` (shapes and dtypes)."""
    if sent.version != version:
        raise WeightsMismatch(f"weights of version {sent.version} arrived for the refit to version {version}")
    got = {name: (shape, dtype) for name, shape, dtype in sent.specs}
    expected = dict(like)
    if got.keys() != expected.keys():
        missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        raise WeightsMismatch(f"weights of version {version}: missing {missing}, unexpected {extra}")
    for name, target in expected.items():
        shape, dtype = got[name]
        if shape != tuple(target.shape) or dtype != target.dtype:
            raise WeightsMismatch(
                f"weights of version {version}: {name} is {shape} {dtype}, "
                f"the engine's is {tuple(target.shape)} {target.dtype}"
            )


@dataclass(frozen=True)
class Package:
    version: int
    transport: Transport
    tensors: dict[str, Any]  # name -> tensor (object store) or (rebuild, args) (CUDA IPC)


def pack(version: int, parameters: Iterable[tuple[str, torch.Tensor]], transport: Transport) -> Package:
    if transport == "cuda_ipc":
        from torch.multiprocessing.reductions import reduce_tensor

        return Package(version, transport, {name: reduce_tensor(p.detach()) for name, p in parameters})
    return Package(version, transport, {name: p.detach().to("cpu", copy=True) for name, p in parameters})


def unpack(
    package: Package, *, version: int, like: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The package's tensors by name, checked against the announced `version` and the engine's
    own parameters `like` (names, shapes, dtypes)."""
    tensors = package.tensors
    if package.transport == "cuda_ipc":
        tensors = {name: rebuild(*args) for name, (rebuild, args) in tensors.items()}
    check(header(package.version, tensors.items()), version=version, like=like)
    return tensors
