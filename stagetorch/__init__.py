"""stagetorch: stage PyTorch code, know its memory before it runs, run batches that do not fit in exact chunks."""

from . import ops
from .api import Staged, clear_caches, eval_shape, jit, make_ir, memory
from .errors import (
    BatchCouplingError,
    BatchShapeError,
    BatchStatisticsError,
    ConcretizationError,
    ModifiedInputError,
    NotATensorError,
    OutOfMemoryError,
    PlanOnlyDeviceError,
    RankMismatchError,
    ShapeError,
    StagingError,
    UnknownDeviceError,
    UnsupportedOpError,
)
from .interpreters.memory import MemoryReport
from .ir import Aval, Eqn, Graph, Literal, SourceInfo, Var
from .lazymode import LazyTensor, lazy
from .planning.chunks import Plan

__all__ = [
    "jit",
    "make_ir",
    "eval_shape",
    "clear_caches",
    "Staged",
    "memory",
    "lazy",
    "LazyTensor",
    "MemoryReport",
    "Plan",
    "Aval",
    "Var",
    "Literal",
    "Eqn",
    "Graph",
    "SourceInfo",
    "ops",
    "StagingError",
    "ShapeError",
    "BatchShapeError",
    "NotATensorError",
    "ConcretizationError",
    "UnsupportedOpError",
    "BatchCouplingError",
    "BatchStatisticsError",
    "OutOfMemoryError",
    "ModifiedInputError",
    "RankMismatchError",
    "UnknownDeviceError",
    "PlanOnlyDeviceError",
]

__version__ = "0.1.0"
