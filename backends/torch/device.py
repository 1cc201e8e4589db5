"""Whether a device named in a recipe or on the command line can be used here, said before
any model is built: a CPU build of torch, or a machine without a GPU, cannot run on `cuda`."""

from __future__ import annotations

import torch

from pipeline.contracts.errors import RecipeError


def check_device(device: str, where: str) -> None:
    """Raise `RecipeError` naming `where` (a recipe field or a flag) when `device` is unusable."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise RecipeError(f"{where}: {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise RecipeError(f"{where}: {device!r}: only cpu and cuda devices are supported")
    if torch.version.cuda is None:
        raise RecipeError(
            f"{where}: {device!r}, but this torch ({torch.__version__}) is a CPU build; "
            "install a CUDA build of torch, or use cpu"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise RecipeError(f"{where}: {device!r}, but no CUDA GPU is visible on this machine; use cpu")
    if parsed.index is not None and parsed.index >= count:
        raise RecipeError(
            f"{where}: {device!r}, but this machine has {count} CUDA GPU(s): cuda:0 to cuda:{count - 1}"
        )
