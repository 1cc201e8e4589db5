"""nox sessions: tests, lint, typecheck, bench (CPU) and gpu (on a CUDA machine)."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"

CPU_TORCH = "torch==2.13.0"  # the CPU build on this project's CI machines; GPU users keep theirs
# megatron-core 0.17+ declares Python >= 3.12 and CUDA extras; its cp311 wheel runs on 3.11 with
# triton (which its imports need, and torch's CPU build does not bring) and the `megatron` extra.
MEGATRON = ("--no-deps", "--ignore-requires-python", "megatron-core==0.19.2", "triton==3.6.0")
# The version `typecheck` passes with, as in pyproject's dev extra: a new mypy adds checks.
MYPY = "mypy==2.4.1"


def _install(session: nox.Session, *extras: str) -> None:
    session.install(CPU_TORCH)
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")
    if "test" in extras:
        session.install(*MEGATRON)


@nox.session
def tests(session: nox.Session) -> None:
    _install(session, "test")
    # `python -m` puts the checkout on sys.path, as the README's test command does (the tests
    # import `tests.…`); the `pytest` entry point does not.
    session.run("python", "-m", "pytest", "-m", "not gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff", "import-linter>=2.1")
    session.run("ruff", "check", "pipeline", "stages", "backends", "tests", "bench")
    # The layers of docs/DESIGN.md, as pyproject.toml's import contracts.
    session.run("lint-imports")


@nox.session
def typecheck(session: nox.Session) -> None:
    _install(session, "test")
    session.install(MYPY)
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """CPU benchmarks; results go to bench/results-cpu.json."""
    _install(session, "test")
    session.run("python", "-m", "bench.cpu", *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """GPU tests and benchmarks, run in the current environment of a CUDA machine."""
    session.run("python", "-m", "pytest", "-m", "gpu", "tests", *session.posargs)
    session.run("python", "-m", "bench.gpu", *session.posargs)
