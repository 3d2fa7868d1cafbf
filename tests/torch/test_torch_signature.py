"""Custom-op schemas derived from JAX signatures, structured operands, option
encoders and the eval_shape fakes under torch.compile with dynamic shapes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")

from jax import Array  # noqa: E402

import stellax  # noqa: E402
import stellax.torch as st  # noqa: E402
from stellax.torch import options, registry, signature, structs  # noqa: E402


def _annotated(x: Array, scale: Array | None, w: stellax.QArray, pool: stellax.QuantizedPages | Array | None, *,
               eps: float, window: list[int] | None, name: str | None) -> tuple[Array, stellax.QArray]:
    raise NotImplementedError


def test_schema_is_derived_from_the_annotations():
    sig = signature.derive(_annotated, no_grad=("w_scales",))
    assert sig.schema() == (
        "(Tensor x, Tensor? scale, Tensor w_values, Tensor w_scales, Tensor? w_zero_points, Tensor? w_tensor_scale, "
        "Tensor? pool_pages, Tensor? pool_scale, Tensor? pool_zero, Tensor? pool_signs, Tensor? pool_window, "
        "str w_format, int[] w_shape, int[] w_block_shape, int w_axis, int? w_rotation, str? pool_quant, "
        "int? pool_head_dim, float eps, int[]? window, str? name) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    assert [t.name for t in sig.tensors if not t.differentiable] == ["w_scales"]
    assert sig.own_options == ["eps", "window", "name"]


def test_underivable_signatures_name_the_parameter():
    def no_annotation(x, *, k: int) -> Array:
        return x

    def bad_option(x: Array, *, k: dict) -> Array:
        return x

    def bad_operand(x: int) -> Array:
        return x

    with pytest.raises(TypeError, match="parameter 'x' has no annotation"):
        signature.derive(no_annotation)
    with pytest.raises(TypeError, match="option 'k'"):
        signature.derive(bad_option)
    with pytest.raises(TypeError, match="parameter 'x'"):
        signature.derive(bad_operand)
    with pytest.raises(ValueError, match="no_grad"):
        signature.derive(_annotated, no_grad=("nope",))


def test_every_front_end_schema_is_derived():
    """Only the bridge test's explicit op keeps a hand-written schema."""
    for name, op in registry.registered_torch_ops().items():
        if name != "test_identity":
            assert op.schema == signature.derive(op.jax_fn, where=name).schema(), name


def test_structured_operands_round_trip():
    q = st.quantize(torch.randn(8, 64), "int4_asym", block_size=32)
    tensors, statics = structs.QARRAY.flatten(q, "q", dense=False)
    assert tensors == [q.values, q.scales, q.zero_points, q.tensor_scale]
    assert statics == [q.format, list(q.shape), list(q.block_shape), q.axis, q.rotation]
    back = structs.QARRAY.to_torch(tensors, (q.format, q.shape, q.block_shape, q.axis, q.rotation))
    assert back.values is q.values and back.zero_points is q.zero_points and back.shape == q.shape
    dense = torch.randn(3, 4)
    assert structs.PAGES.flatten(dense, "k", dense=True) == ([dense, None, None, None, None], [None, None])
    with pytest.raises(TypeError, match="k: expected a torch.Tensor or a stellax.torch.QuantizedPages"):
        structs.PAGES.flatten(q, "k", dense=True)
    with pytest.raises(TypeError, match="w: expected a stellax.torch.QTensor"):
        structs.QARRAY.flatten(dense, "w", dense=False)


def test_window_encoder():
    assert options.encode_window(None) is None
    assert options.encode_window(3) == [3, 3]
    assert options.encode_window(3, int_means="left") == [3, 0]
    assert options.encode_window((None, 2)) == [-1, 2]
    assert options.decode_window([-1, 2]) == (None, 2)
    assert options.left_window((5, 0)) == 5 and options.left_window(4) == 4
    with pytest.raises(ValueError, match="local_window_size: expected an int or a"):
        options.encode_window((1, 2, 3))


def test_dynamic_shapes_compile_soundly():
    """Symbolic sizes: kept symbolic where the output follows an input size
    (rms_norm), specialized where it is derived (the final states of a packed
    batch: len(cu_seqlens) - 1). Either way the compiled graph is right for
    every size it is reused for."""

    def norm_step(x, w):
        y = st.rms_norm(x, w)
        return y.reshape(y.shape[0] * y.shape[1], -1).sum(0)

    compiled = torch.compile(norm_step, dynamic=True, fullgraph=True, backend="aot_eager")
    w = torch.randn(16)
    for rows in (3, 5, 7):
        x = torch.randn(2, rows, 16)
        torch.testing.assert_close(compiled(x, w), norm_step(x, w))

    def packed_step(q, k, v, g, beta, cu):
        o, state = st.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
        return o.reshape(-1).sum(), state.reshape(state.shape[0], -1).sum(1)

    compiled = torch.compile(packed_step, dynamic=True, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    for cu in ([0, 3, 8], [0, 2, 5, 8]):
        t = 8
        args = (torch.randn(1, t, 2, 8, generator=gen), torch.nn.functional.normalize(
            torch.randn(1, t, 2, 8, generator=gen), dim=-1), torch.randn(1, t, 2, 8, generator=gen),
            -torch.rand(1, t, 2, generator=gen), torch.rand(1, t, 2, generator=gen),
            torch.tensor(cu, dtype=torch.int32))
        for a, b in zip(compiled(*args), packed_step(*args)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_derived_arrays_and_options_agree_with_the_registered_ops():
    """Where a front end wraps a registered `Op` of the same name, no argument
    is an array on one side and a static option on the other (the Op's
    checked `Call` on its first example decides)."""
    import jax.numpy as jnp
    from stellax.core.op import registered_ops

    ops = registered_ops()
    checked = 0
    for name, top in registry.registered_torch_ops().items():
        op = ops.get(name)
        examples = op.examples(jnp.float32) if op is not None else []
        if not examples:
            continue
        call = op.check(*examples[0].args, **examples[0].kwargs)
        tensors = {t.name for t in top.tensors}
        assert not tensors & set(call.options), (name, tensors & set(call.options))
        assert not set(top.options) & set(call.arrays), (name, set(top.options) & set(call.arrays))
        checked += 1
    assert checked >= 5
