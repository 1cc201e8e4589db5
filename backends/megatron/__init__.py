"""The megatron-core training backend (`train.backend: megatron`).

A megatron-core `GPTModel` (local layer spec, core attention through torch SDPA) trains with
the torch trainer's GRPO loss; our torch engine serves a torch `Decoder` refreshed from its
parameters. Importing this package imports neither megatron nor torch: `build_backend` does.

megatron-core announces at import, as warnings, that TransformerEngine and Apex are missing
(this backend uses neither) and that options it never sets are deprecated, and logs at info
that its FSDP (unused here) runs without TransformerEngine. Those warnings, from megatron's own
modules only, are ignored, and its FSDP package logs warnings and above.
"""

import logging
import warnings

for _category in (UserWarning, DeprecationWarning, FutureWarning):
    warnings.filterwarnings("ignore", category=_category, module=r"megatron\.")
logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
