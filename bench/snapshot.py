"""What an asynchronous save's two halves cost, before and after issue 34's changes, on a
synthetic trainer state: its parts shaped as a Qwen2.5-1.5B-shaped model's (bf16 weights, float32
masters and two Adam moments; `--scale` of its 1.54e9 parameters), on the GPU.

The snapshot, in the step: a copy into a fresh host buffer (before: allocated and written in the
step, pageable on its first copy, then pinned), against a copy into a buffer reserved ahead
(`HostCopier.reserve`: its allocation, page touching and pinning timed apart, off the step).
The write, in the background: before, the finiteness check on the host copy, torch.save of the
whole state with its zip CRC-32s, fsync, and the marker's checksum read back on one thread;
after, the finiteness check on the GPU (in the step), the tensors written raw by many threads
(`backends.torch.tensor_file`) beside a small torch.save of the rest, each file's checksum read
on several threads while its fsync waits for the disk (`stages.checkpoint.flushed`). Prints one
JSON line.

    python -m bench.snapshot --scale 0.25 --dir /tmp/snap
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import torch

from backends.torch.host_copy import HostCopier
from backends.torch.state_file import nonfinite, nonfinite_on_device, save_state, tensor_path
from stages.checkpoint import flushed
from stages.checkpoint_marker import checksum

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 1536, 8960, 28, 151936, 256


def state_on_gpu(scale: float) -> dict[str, object]:
    shapes = [(VOCAB, HIDDEN)]
    for _ in range(LAYERS):
        shapes += [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN)]  # q/k/v fused, o
        shapes += [(2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # gate/up fused, down
    shapes = [(max(1, int(rows * scale)), cols) for rows, cols in shapes]
    cuda = torch.device("cuda")
    model = {f"p{i}": torch.randn(s, device=cuda, dtype=torch.bfloat16) for i, s in enumerate(shapes)}
    master = [t.float() for t in model.values()]
    moments = {
        i: {"exp_avg": torch.randn_like(m), "exp_avg_sq": torch.rand_like(m)} for i, m in enumerate(master)
    }
    return {"model": model, "master": master, "optimizer": {"state": moments}}


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def _fsync(path: Path) -> None:
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


def _checksum_one_thread(path: Path) -> int:
    value = 0
    with path.open("rb") as handle:
        while chunk := handle.read(16 * 2**20):
            value = zlib.crc32(chunk, value)
    return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--dir", default="/tmp/snapshot-bench")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    state = state_on_gpu(args.scale)
    torch.cuda.synchronize()
    out: dict[str, object] = {"scale": args.scale, "torch": torch.__version__}

    before = HostCopier()  # a fresh buffer, filled in the step
    out["snapshot_before_s"] = _timed(lambda: before.copy(state))
    out["gb"] = before.arena.numel() / 1e9
    before.wait()  # its pinning, beside the next steps
    out["snapshot_before_second_s"] = _timed(lambda: before.copy(state))

    after = HostCopier()
    out["reserve_s"] = _timed(lambda: (after.reserve(state), after.wait()))  # off the step
    out["check_on_gpu_s"] = _timed(lambda: nonfinite_on_device(state))
    out["snapshot_after_s"] = _timed(lambda: after.copy(state))
    copied = after.copy(state)

    old, new = root / "before.pt", root / "trainer.pt"
    out["write_before"] = {
        "check_on_host_s": _timed(lambda: nonfinite(copied)),
        "save_s": _timed(lambda: torch.save(copied, old)),  # zip CRCs on: torch's default
        "fsync_s": _timed(lambda: _fsync(old)),
        "checksum_s": _timed(lambda: _checksum_one_thread(old)),
    }
    old.unlink()  # one state file on the disk at a time
    out["write_after"] = {
        "save_s": _timed(lambda: save_state(new, copied, checked=True)),
        "fsync_and_checksum_s": _timed(lambda: [flushed(root, p.name) for p in (new, tensor_path(new))]),
    }
    for name in ("write_before", "write_after"):
        out[f"{name}_s"] = sum(out[name].values())  # type: ignore[union-attr]
    assert checksum(tensor_path(new)) == _checksum_one_thread(tensor_path(new))
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
