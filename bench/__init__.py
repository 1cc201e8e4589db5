"""Benchmarks (nox -s bench on CPU, nox -s gpu on a CUDA machine); results go to bench/*.json."""
