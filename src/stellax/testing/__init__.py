"""Public verification harness: numerics against the golden, determinism,
lowering for accelerators, PTX compile checks, and the plan and report of
`stellax check`."""

from .lowering import (
    CUSTOM_CALL_OF_BACKEND, MOSAIC_GPU_CUSTOM_CALL, PLATFORMS_OF_BACKEND, TPU_CUSTOM_CALL, TRITON_CUSTOM_CALL,
    assert_custom_call, assert_fits_smem, check_op_lowering, compile_triton_to_ptx, lower_config, lower_for,
    lower_for_gpu, platforms_of, triton_compiler_available,
)
from .numerics import (
    ErrorSummary, assert_close, assert_deterministic, assert_trees_close, compare, golden, random_array,
    random_inputs, tolerance, upcast, vjp_with_cotangent,
)
from .plan import CheckJob, plan_checks, select_ops
from .report import CheckReport
from .validation import CheckResult, check_example, check_op, iter_checks, safe_check_example

__all__ = [
    "CUSTOM_CALL_OF_BACKEND", "CheckJob", "CheckReport", "CheckResult", "ErrorSummary", "MOSAIC_GPU_CUSTOM_CALL",
    "PLATFORMS_OF_BACKEND", "TPU_CUSTOM_CALL", "TRITON_CUSTOM_CALL", "assert_close", "assert_custom_call",
    "assert_deterministic", "assert_fits_smem", "assert_trees_close", "check_example", "check_op",
    "check_op_lowering", "compare", "compile_triton_to_ptx", "golden", "iter_checks", "lower_config",
    "lower_for", "lower_for_gpu", "plan_checks", "platforms_of", "random_array", "random_inputs",
    "safe_check_example", "select_ops", "tolerance", "triton_compiler_available", "upcast",
    "vjp_with_cotangent",
]
