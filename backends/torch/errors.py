"""Errors raised while building or loading models."""


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: a file is missing, or tensor names do not match the model."""


class UnsupportedModelError(ModelLoadError):
    """A model configuration asks for an architecture or feature this backend does not implement."""
