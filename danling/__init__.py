"""danling: training scaffolding for PyTorch researchers.

The top level re-exports the public names of every subpackage (each lists them in its
``__all__``). Nothing optional is imported here: TensorBoard, W&B and DeepSpeed load lazily
when a feature needs them.
"""

from . import checkpoint, data, distributed, metrics, optim, runners, tensors, utils
from .checkpoint import *
from .data import *
from .distributed import *
from .metrics import *
from .optim import *
from .runners import *
from .tensors import *
from .utils import *

__version__ = "0.1.0"

__all__ = [
    *utils.__all__,
    *tensors.__all__,
    *metrics.__all__,
    *optim.__all__,
    *data.__all__,
    *distributed.__all__,
    *checkpoint.__all__,
    *runners.__all__,
]
