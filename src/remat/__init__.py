"""remat: activation checkpointing (rematerialization) for PyTorch.

Example:
    >>> import torch, remat
    >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> remat.checkpoint(block, x).sum().backward()
"""

from . import memory, policies
from .engine.checkpoint import checkpoint, noop_context_fn
from .engine.config import (
    GraphExecGroup,
    disable_checkpointing,
    is_checkpointing,
    is_recomputing,
    set_checkpoint_debug_enabled,
    set_checkpoint_early_stop,
)
from .engine.errors import CheckpointError, PlanError, RematError
from .engine.forms import CheckpointImpl
from .engine.offload import OffloadStats, offload
from .engine.reentrant import CheckpointFunction, check_backward_validity, detach_variable
from .engine.selective import (
    SAC_IGNORED_OPS,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)
from .engine.sequential import checkpoint_sequential
from .engine.state import DefaultDeviceType, get_device_states, set_device_states
from .measure.diagnose import Diagnostic
from .measure.explain import Explanation, explain
from .measure.verify import Report, verify
from .modules.wrap import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
    unwrap,
)
from .planner import (
    Inputs,
    Plan,
    Profile,
    ShapePlans,
    Shapes,
    StagePlan,
    StageShapePlans,
    auto_checkpoint,
    measure_peak,
    plan,
    plan_pipeline_stage,
    profile,
)
from .policies import CheckpointPolicy

__version__ = "0.1.0.dev0"

__all__ = [
    "CheckpointError",
    "CheckpointFunction",
    "CheckpointImpl",
    "CheckpointPolicy",
    "DefaultDeviceType",
    "Diagnostic",
    "Explanation",
    "GraphExecGroup",
    "Inputs",
    "OffloadStats",
    "Plan",
    "PlanError",
    "Profile",
    "RematError",
    "Report",
    "SAC_IGNORED_OPS",
    "SelectiveCheckpointContext",
    "ShapePlans",
    "Shapes",
    "StagePlan",
    "StageShapePlans",
    "apply_activation_checkpointing",
    "auto_checkpoint",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "create_selective_checkpoint_contexts",
    "detach_variable",
    "disable_checkpointing",
    "explain",
    "get_device_states",
    "is_checkpointing",
    "is_recomputing",
    "measure_peak",
    "memory",
    "noop_context_fn",
    "offload",
    "offload_wrapper",
    "plan",
    "plan_pipeline_stage",
    "policies",
    "profile",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
    "unwrap",
    "verify",
]
