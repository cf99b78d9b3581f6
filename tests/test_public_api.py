"""The public names are a contract (../shared/API.md): pin them."""

import subprocess
import sys

import remat

EXPECTED_ALL = [
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


def test_all_is_pinned_and_sorted():
    assert remat.__all__ == EXPECTED_ALL
    assert remat.__all__ == sorted(remat.__all__)


def test_every_name_in_all_exists():
    for name in remat.__all__:
        assert hasattr(remat, name), name


def test_every_name_of_torch_utils_checkpoint_all_is_in_remat():
    import torch.utils.checkpoint as tuc

    missing = [name for name in tuc.__all__ if name not in remat.__all__]
    assert missing == []
    for name in tuc.__all__:
        assert hasattr(remat, name), name


def test_import_does_not_import_torchs_distributed_wrapper():
    code = (
        "import sys, torch, remat\n"
        "m = remat.checkpoint_wrapper(torch.nn.Linear(2, 2), "
        "checkpoint_impl=remat.CheckpointImpl.REENTRANT)\n"
        "m(torch.randn(1, 2, requires_grad=True)).sum().backward()\n"
        "print('torch.distributed.algorithms._checkpoint.checkpoint_wrapper' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_and_first_checkpoint_do_not_import_dynamo():
    code = (
        "import sys, torch, remat\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "remat.checkpoint(torch.sin, x).sum().backward()\n"
        "remat.checkpoint(torch.sin, x, use_reentrant=True).sum().backward()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_checkpoint_error_is_torchs_and_rematerror():
    import torch.utils.checkpoint as tuc

    assert issubclass(remat.CheckpointError, tuc.CheckpointError)
    assert issubclass(remat.CheckpointError, remat.RematError)
    assert issubclass(remat.CheckpointError, RuntimeError)
