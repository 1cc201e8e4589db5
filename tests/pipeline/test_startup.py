"""Start-up's bytecode caches: a package's stale modules are compiled by a child process (so no
import on a worker thread holds the GIL compiling them), and nothing is written where bytecode
writing is off."""

from __future__ import annotations

import importlib.util
import os
import subprocess
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
    started = _recording(monkeypatch)
    cache_bytecode(["startup_probe"])
    assert all(cache.read_bytes().endswith(b"kept") for cache in package)
    assert started == []


def test_hash_based_caches_are_left_to_the_import(
    package: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checked-hash cache (a reproducible build's) is checked by the import itself."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    root = tmp_path / "startup_probe"
    command = [sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash", str(root)]
    subprocess.run(command, check=True)
    started = _recording(monkeypatch)
    cache_bytecode(["startup_probe"])
    assert started == []


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The child processes started from now on (none is)."""
    started: list[object] = []
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: started.append(args))
    return started


def test_nothing_is_written_when_bytecode_writing_is_off(
    package: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    cache_bytecode(["startup_probe"])
    assert not any(cache.exists() for cache in package)


@pytest.mark.parametrize("flags", [["-O"], ["-X", "pycache_prefix=PREFIX"]], ids=["optimised", "prefix"])
def test_the_caches_written_are_those_the_interpreter_reads(
    package: list[Path], tmp_path: Path, flags: list[str]
) -> None:
    """Under `python -O` imports read `.opt-1.pyc` caches, under `-X pycache_prefix` caches in
    that tree: the child writes those."""
    flags = [flag.replace("PREFIX", str(tmp_path / "prefix")) for flag in flags]
    code = (
        "import importlib.util, pathlib, sys; from pipeline.startup import cache_bytecode; "
        "cache_bytecode(['startup_probe']); "
        f"sources = sorted(pathlib.Path({str(tmp_path)!r}, 'startup_probe').rglob('*.py')); "
        "sys.exit(not all(pathlib.Path(importlib.util.cache_from_source(str(s))).is_file() for s in sources))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    assert subprocess.run([sys.executable, *flags, "-c", code], env=env, check=False).returncode == 0


@pytest.mark.parametrize("host", ["embedding", "frozen"])
def test_no_interpreter_to_start_leaves_the_imports_to_compile(
    package: list[Path], monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    """An embedding host's `sys.executable` may be empty; a frozen app's is the app itself,
    which `-m compileall` would start again: no child, and start-up goes on."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    if host == "embedding":
        monkeypatch.setattr(sys, "executable", "")
    else:
        monkeypatch.setattr(sys, "frozen", True, raising=False)
    started = _recording(monkeypatch)
    cache_bytecode(["startup_probe"])
    assert started == []


def test_no_child_starts_where_no_cache_can_be_written(
    package: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only checkout (here: each `__pycache__` a file) would otherwise start a child at
    every run that compiles every module and writes nothing."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    for cache in package:
        cache.parent.touch()
    started = _recording(monkeypatch)
    cache_bytecode(["startup_probe"])
    assert started == []


def test_a_cache_newer_than_a_source_copied_in_is_rewritten(
    package: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source copied in with its older mtime (`cp -p`, `rsync -a`, `tar x`) over a newer cache:
    the import compares the cache's header with the source, not the files' mtimes."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    cache_bytecode(["startup_probe"])
    source = tmp_path / "startup_probe" / "inner" / "work.py"
    source.write_text("def f():\n    return 22\n")
    os.utime(source, (1_000_000_000, 1_000_000_000))  # 2001: older than every cache
    cache_bytecode(["startup_probe"])
    header = Path(importlib.util.cache_from_source(str(source))).read_bytes()[8:16]
    stat = source.stat()
    assert header == int(stat.st_mtime).to_bytes(4, "little") + stat.st_size.to_bytes(4, "little")
