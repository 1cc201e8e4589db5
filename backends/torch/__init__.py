"""PyTorch backend: Llama/Qwen2 decoder, batched sampler and Hugging Face checkpoint I/O.

Submodules are imported explicitly (``backends.torch.model``, ``.engine``, ``.hf``) so
that importing this package stays cheap.
"""
