"""Start-up's bytecode caches: a package's stale modules are compiled by a child process (so no
import on a worker thread holds the GIL compiling them), and nothing is written where bytecode
writing is off."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from pipeline.startup import cache_bytecode


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """A package `startup_probe` on the path with two modules; their cache files' paths."""
    root = tmp_path / "startup_probe"
    (root / "inner").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "inner" / "__init__.py").write_text("")
    (root / "inner" / "work.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return [Path(importlib.util.cache_from_source(str(p))) for p in sorted(root.rglob("*.py"))]


def test_the_stale_modules_of_a_package_get_their_caches_written(
    package: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    cache_bytecode(["startup_probe"])
    assert all(cache.is_file() for cache in package)


def test_fresh_caches_are_left_as_they_are(package: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    cache_bytecode(["startup_probe"])
    for cache in package:  # marked, so a rewrite would show
        cache.write_bytes(cache.read_bytes() + b"kept")
        os.utime(cache, (cache.stat().st_atime, cache.stat().st_mtime + 10))
    cache_bytecode(["startup_probe"])
    assert all(cache.read_bytes().endswith(b"kept") for cache in package)


def test_nothing_is_written_when_bytecode_writing_is_off(
    package: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    cache_bytecode(["startup_probe"])
    assert not any(cache.exists() for cache in package)
