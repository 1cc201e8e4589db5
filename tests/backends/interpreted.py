"""Run a test case module under Triton's interpreter, in a process of its own (the interpreter
must be on before Triton is first imported), and read the JSON it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str) -> Any:
    """`python -m module` with TRITON_INTERPRET=1 from the checkout's root; its printed JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", module],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
