"""The megatron-core training backend (`train.backend: megatron`).

A megatron-core `GPTModel` (local layer spec, core attention through torch SDPA) trains with
the torch trainer's GRPO loss; our torch engine serves a torch `Decoder` refreshed from its
parameters. Importing this package imports neither megatron nor torch: `build_backend` does.
"""
