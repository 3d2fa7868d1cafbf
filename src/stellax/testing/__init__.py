"""Public verification harness: numerics against the golden, determinism,
lowering for accelerators, PTX compile checks."""

from .lowering import (
    TRITON_CUSTOM_CALL, assert_custom_call, assert_fits_smem, check_op_lowering, compile_triton_to_ptx,
    lower_for_gpu, triton_compiler_available,
)
from .numerics import (
    ErrorSummary, assert_close, assert_deterministic, assert_trees_close, compare, golden, random_array,
    random_inputs, tolerance, upcast, vjp_with_cotangent,
)
from .validation import CheckResult, check_example, check_op

__all__ = [
    "CheckResult", "ErrorSummary", "TRITON_CUSTOM_CALL", "assert_close", "assert_custom_call",
    "assert_deterministic", "assert_fits_smem", "assert_trees_close", "check_example", "check_op",
    "check_op_lowering", "compare", "compile_triton_to_ptx", "golden", "lower_for_gpu", "random_array",
    "random_inputs", "tolerance", "triton_compiler_available", "upcast", "vjp_with_cotangent",
]
