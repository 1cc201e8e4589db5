"""The typed input every backend is built from (`pipeline.contracts.backend_input`), with this
package's section types filled in: the torch model section, the resolved algorithm, the
placement and the trainers' own knobs. Importing it imports neither torch nor ray."""

from __future__ import annotations

from backends.placement import Placement
from backends.torch.section import ModelSection, TrainerOptions
from pipeline.algorithms.config import Algorithm
from pipeline.contracts.backend_input import BackendInput

Input = BackendInput[ModelSection, Algorithm, Placement, TrainerOptions]
