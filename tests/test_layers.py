"""The layers of docs/DESIGN.md hold: pyproject.toml's import contracts pass (`lint-imports`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold() -> None:
    command = shutil.which("lint-imports")
    assert command is not None, "import-linter is in the test extra: pip install -e '.[test]'"
    result = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:]
