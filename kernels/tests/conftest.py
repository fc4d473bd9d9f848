"""The kernel tests. On a GPU the kernels compile; without one, Triton's interpreter runs them (numpy,
every program in turn: hence the small shapes). The interpreter must be switched on before triton is
first imported, so it is switched on here, before pytest imports the test modules."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
