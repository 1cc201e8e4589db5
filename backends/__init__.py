"""Compute backends: model definitions, samplers and checkpoint I/O."""
