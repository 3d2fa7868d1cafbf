"""The float32 contract over the whole registry (`stellax.core.precision`).

Every op that contracts takes ``precision``; every implementation runs each
float32 contraction of its forward and backward at the precision asked for
(the traced program is read, kernels included: on a CPU all precisions
compute alike, so numerics alone cannot show it); a value that is not a
precision is refused naming it. Ops without a contraction are listed in
`NON_CONTRACTING` and refuse the argument like any unknown keyword.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.core import interpret_mode
from stellax.core.precision import check_precision, resolve_precision
from stellax.testing.precision import contractions, violations
from stellax.testing.validation import _grad_positions, abstract_examples_of

#: Ops with no contraction (elementwise / reductions / routing): no ``precision``.
NON_CONTRACTING = frozenset({"layer_norm", "layer_norm_backward", "quantize", "dequantize", "moe_route"})

OPS = stellax.registered_ops()
CONTRACTING = sorted(name for name in OPS if name not in NON_CONTRACTING)


def _example(name):
    return abstract_examples_of(OPS[name], "float32")[0]


def test_check_precision_values():
    assert check_precision(None) is None
    assert check_precision("HIGHEST") == jax.lax.Precision.HIGHEST
    assert check_precision(("high", jax.lax.Precision.HIGH)) == jax.lax.Precision.HIGH
    for bad in ("fp32", 3, ("high", "highest"), jnp.float32):
        with pytest.raises(ValueError, match="precision"):
            check_precision(bad)


def test_none_is_highest_unless_jax_says_otherwise():
    assert resolve_precision(None) == jax.lax.Precision.HIGHEST
    with jax.default_matmul_precision("bfloat16"):
        assert resolve_precision(None) == jax.lax.Precision.DEFAULT
    with jax.default_matmul_precision("tensorfloat32"):
        assert resolve_precision(None) == jax.lax.Precision.HIGH
    assert resolve_precision("default") == jax.lax.Precision.DEFAULT


@pytest.mark.parametrize("name", CONTRACTING)
def test_op_takes_precision(name):
    op, example = OPS[name], _example(name)
    call = op.check(*example.args, **{**example.kwargs, "precision": "high"})
    assert call.precision == jax.lax.Precision.HIGH, f"{name}: the checked call carries the precision"
    with pytest.raises(ValueError, match=r"precision.*'fp64'"):
        op.check(*example.args, **{**example.kwargs, "precision": "fp64"})


@pytest.mark.parametrize("name", sorted(NON_CONTRACTING))
def test_non_contracting_ops_have_no_contraction(name):
    op, example = OPS[name], _example(name)
    call = op.check(*example.args, **example.kwargs)
    for impl in op.implementations:
        with interpret_mode():
            if not op.implementations[impl].supported(call):
                continue
            found = contractions(lambda *a, **k: op(*a, implementation=impl, **k), *example.args, **example.kwargs)
        assert not [c for c in found if c.float32], f"{name}/{impl} contracts float32: it needs a precision"


def _loss(fn):
    def loss(*args, **kwargs):
        leaves = [l for l in jax.tree_util.tree_leaves(fn(*args, **kwargs)) if jnp.issubdtype(l.dtype, jnp.floating)]
        return sum(jnp.sum(l.astype(jnp.float32)) for l in leaves)
    return loss


@pytest.mark.parametrize("precision", ["default", "high", "highest"])
@pytest.mark.parametrize("name,impl", [(n, i) for n in CONTRACTING for i in OPS[n].implementations])
def test_every_float32_contraction_honours_precision(name, impl, precision):
    _assert_contract(name, impl, precision, _example(name))


#: Examples beyond the first that take another path through the op (and its backward).
MORE_EXAMPLES = {"ragged_dot_backward": ("act=gelu gated=True",)}


@pytest.mark.parametrize("precision", ["default", "high", "highest"])
@pytest.mark.parametrize("name,impl,label", [(n, i, label) for n, labels in MORE_EXAMPLES.items()
                                             for label in labels for i in OPS[n].implementations])
def test_more_examples_honour_precision(name, impl, label, precision):
    (example,) = [e for e in abstract_examples_of(OPS[name], "float32") if label in e.label]
    _assert_contract(name, impl, precision, example)


@pytest.mark.parametrize("name", CONTRACTING)
def test_example_inputs_are_computed_at_highest(name):
    """An example operand derived by a contraction (a saved pre-activation, a
    reference state) is computed at HIGHEST, as the golden it is compared with;
    at ``None`` a TPU computes it in one bfloat16 pass, and the op's error on
    the chip is then the example's (a ragged_dot_backward example did that)."""
    def build():
        examples = OPS[name].examples(jnp.dtype("float32"))
        return [leaf for leaf in jax.tree_util.tree_leaves([(e.args, e.kwargs) for e in examples])
                if isinstance(leaf, jax.Array)]

    try:
        found = contractions(build)
    except jax.errors.ConcretizationTypeError:
        pytest.skip("the examples need concrete values to be built")
    bad = violations(found, "highest")
    assert not bad, (f"{name}: its examples compute {len(bad)} float32 contractions at "
                     f"{sorted({str(c.precision) for c in bad})}, not HIGHEST")


def _assert_contract(name, impl, precision, example):
    op = OPS[name]
    kwargs = {**example.kwargs, "precision": precision}
    call = op.check(*example.args, **kwargs)
    if not op.implementations[impl].supported(call):  # interpret mode below makes every backend traceable
        with interpret_mode():
            support = op.implementations[impl].supported(call)
        if not support:
            pytest.skip(f"{impl} does not take this example: {support.reason}")

    def run(*args, **kw):
        return op(*args, implementation=impl, **kw)

    with interpret_mode():
        found = contractions(run, *example.args, **kwargs)
        positions = _grad_positions(op, example)
        if positions:
            # Every array is traced (the others as inputs the gradient ignores), so shape structs
            # in the example never reach the op as values.
            def wrt(diff, args, kw):
                args = list(args)
                for i, d in zip(positions, diff):
                    args[i] = d
                return _loss(run)(*args, **kw)
            found += contractions(jax.grad(wrt), [example.args[i] for i in positions], list(example.args), kwargs)
    bad = violations(found, precision)
    assert not bad, (f"{name}/{impl} at precision={precision!r}: {len(bad)} of {len(found)} float32 contractions "
                     f"run at another precision: {sorted({str(c.precision) for c in bad})}")
