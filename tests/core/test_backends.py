"""Backend tables (`core.backends`) and the shared custom VJP (`core.vjp`): what a family declares,
what gets generated from it, and that a new backend is one kernel file plus one row."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stellax.core import Call, KernelConfig, vjp
from stellax.core import op as op_module
from stellax.core.backends import UNTUNED, Backend, BackendTable, Tuning
from stellax.ops.norm import api as norm_api

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "stellax"


@dataclasses.dataclass(frozen=True)
class _Cfg(KernelConfig):
    block: int = 8


def _tuning(tag):
    return Tuning(_Cfg, heuristic=lambda call: _Cfg(block=tag), space=lambda call: [_Cfg(block=tag)],
                  requirements=lambda call: None if tag else "never")


def _run(row, call, config):
    return row.name, config


def test_a_table_generates_one_implementation_per_row_in_order():
    table = BackendTable("toy", [
        Backend("triton", object(), "triton", _tuning(8), backward_tuning=_tuning(16)),
        Backend("slow", object(), native=False, backward=False),
        Backend("xla", object()),
    ])
    forward = table.forward(_run)
    assert [i.name for i in forward] == ["triton", "slow", "xla"]
    assert forward[0].backend == "triton" and forward[0].config_type is _Cfg and not forward[1].native
    assert forward[0].default_config(None) == _Cfg(block=8)
    assert forward[0].run("call", "cfg") == ("triton", "cfg")
    backward = table.backward(_run)
    assert [i.name for i in backward] == ["triton", "xla"]  # "slow" has no backward
    assert backward[0].default_config(None) == _Cfg(block=16)  # the backward tuning
    assert backward[1].config_type is None and table["xla"].tuning is UNTUNED
    assert [i.name for i in table.forward(_run, only=("xla",))] == ["xla"]


def test_retuned_keeps_the_backends_and_gives_another_ops_tuning():
    table = BackendTable("toy", [
        Backend("triton", "triton-kernels", "triton", _tuning(8), backward_tuning=_tuning(16)),
        Backend("xla", "xla-kernels", tuning=_tuning(4)),
    ])
    other = table.retuned({"triton": _tuning(32)}, kernels={"triton": "other-kernels"},
                          writes_float8={"triton": bool})
    assert other.names == table.names and other.family == "toy"
    assert other["triton"].tuning.heuristic(None) == _Cfg(block=32) and other["xla"].tuning is UNTUNED
    assert other.kernels("triton") == "other-kernels" and other.kernels("xla") == "xla-kernels"
    assert other["triton"].writes_float8 is bool and other["xla"].writes_float8 is None
    assert other["triton"].backward_tuning == table["triton"].backward_tuning  # only the forward is retuned
    assert table["triton"].tuning.heuristic(None) == _Cfg(block=8)  # the original is unchanged


def test_table_op_registers_an_op_over_the_generated_implementations(monkeypatch):
    monkeypatch.setattr(op_module, "_REGISTRY", dict(op_module._REGISTRY))  # leave the real registry alone
    table = BackendTable("toy", [
        Backend("triton", object(), "triton", _tuning(8), backward_tuning=_tuning(16)),
        Backend("slow", object(), backward=False),
        Backend("xla", object()),
    ])
    fields = dict(check=lambda x: Call({"x": x}, {}), reference=lambda call: call.x)
    forward = table.op("toy_forward", _run, **fields)
    backward = table.op("toy_backward", _run, backward=True, family="other", **fields)
    only = table.op("toy_only", _run, only=("xla",), **fields)
    assert op_module.registered_ops()["toy_forward"] is forward and forward.family == "toy"
    assert list(forward.implementations) == ["triton", "slow", "xla"]
    assert forward.implementations["triton"].default_config(None) == _Cfg(block=8)
    assert backward.family == "other" and list(backward.implementations) == ["triton", "xla"]
    assert backward.implementations["triton"].default_config(None) == _Cfg(block=16)  # the backward tuning
    assert list(only.implementations) == ["xla"]
    assert forward.implementations["slow"].run("call", "cfg") == ("slow", "cfg")


def test_table_errors_name_the_family_and_the_choices():
    with pytest.raises(ValueError, match=r"'toy'.*'xla' row"):
        BackendTable("toy", [Backend("triton", object(), "triton")])
    with pytest.raises(ValueError, match="duplicate"):
        BackendTable("toy", [Backend("xla", object()), Backend("xla", object())])
    table = BackendTable("toy", [Backend("xla", "xla-kernels")])
    assert table.kernels("xla") == "xla-kernels" and "xla" in table and "cuda" not in table
    with pytest.raises(ValueError, match=r"toy: no backend 'cuda'; expected one of \['xla'\]"):
        table.kernels("cuda")


@dataclasses.dataclass(frozen=True)
class _Scale:
    """y = factor · x · w, with a hand-written backward (a `core.vjp` rule)."""

    factor: float

    def forward(self, x, w):
        return self.factor * x * w, (x, w)

    def backward(self, residuals, dy):
        x, w = residuals
        return self.factor * dy * w, None if w is None else self.factor * dy * x


def test_vjp_apply_differentiates_with_the_rule():
    x, w = jnp.arange(1.0, 4.0), jnp.full((3,), 2.0)
    loss = lambda x, w: jnp.sum(vjp.apply(_Scale(3.0), x, w) ** 2)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    y = 3.0 * x * w
    np.testing.assert_allclose(dx, 2 * y * 3.0 * w)
    np.testing.assert_allclose(dw, 2 * y * 3.0 * x)
    np.testing.assert_allclose(jax.jit(loss)(x, w), jnp.sum(y ** 2))


@dataclasses.dataclass(frozen=True)
class _ScaleWithPrimal(_Scale):
    """`_Scale` whose undifferentiated call runs ``primal`` (it counts its calls)."""

    calls: list = dataclasses.field(default_factory=list, hash=False, compare=False)

    def primal(self, x, w):
        self.calls.append("primal")
        return self.factor * x * w


def test_vjp_at_differentiates_only_the_chosen_arguments():
    f = lambda x, y, z: x * y + z
    out, pullback = vjp.vjp_at(f, (2.0, 3.0, 5.0), (0, 2))
    assert out == 11.0 and pullback(1.0) == (3.0, 1.0)  # d/dx = y, d/dz = 1; y held fixed


def test_vjp_apply_runs_the_primal_only_when_nothing_differentiates():
    x, w = jnp.arange(1.0, 4.0), jnp.full((3,), 2.0)
    rule = _ScaleWithPrimal(3.0)
    np.testing.assert_allclose(vjp.apply(rule, x, w), 3.0 * x * w)
    assert rule.calls == ["primal"]
    dx = jax.grad(lambda x: jnp.sum(vjp.apply(rule, x, w)))(x)
    assert rule.calls == ["primal"]  # the gradient went through forward / backward
    np.testing.assert_allclose(dx, 3.0 * w)


_TOY_KERNELS = '''
"""A toy norm backend: the family's kernel entry points written in jnp, counting its calls."""
import jax.numpy as jnp

calls = []


def norm_forward(x, residual, scale, offset, *, epsilon, subtract_mean, config):
    calls.append("forward")
    h = x.astype(jnp.float32) if residual is None else x.astype(jnp.float32) + residual
    mean = jnp.mean(h, axis=-1) if subtract_mean else jnp.zeros(h.shape[:1], jnp.float32)
    centered = h - mean[:, None]
    rstd = 1.0 / jnp.sqrt(jnp.mean(centered * centered, axis=-1) + epsilon)
    y = centered * rstd[:, None] * (1.0 if scale is None else scale) + (0.0 if offset is None else offset)
    return y.astype(x.dtype), None if residual is None else h.astype(x.dtype), mean, rstd


def norm_backward(dy, x, scale, offset, mean, rstd, dh, *, subtract_mean, config):
    calls.append("backward")
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dy * (1.0 if scale is None else scale)
    c = jnp.mean(g * xhat, axis=-1, keepdims=True)
    dx = (g - xhat * c - (jnp.mean(g, axis=-1, keepdims=True) if subtract_mean else 0.0)) * rstd[:, None]
    if dh is not None:
        dx = dx + dh
    dscale = None if scale is None else jnp.sum(dy * xhat, axis=0)
    doffset = None if offset is None else jnp.sum(dy, axis=0)
    return dx.astype(x.dtype), dscale, doffset
'''


def test_a_new_backend_is_one_kernel_file_and_one_row(tmp_path, monkeypatch):
    path = tmp_path / "toy_norm.py"
    path.write_text(_TOY_KERNELS)
    spec = importlib.util.spec_from_file_location("toy_norm", path)
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    row = Backend("toy", toy)  # the one row
    table = BackendTable("norm", (row, *norm_api.BACKENDS.rows))
    for op, implementations in ((norm_api.layer_norm_op, table.forward(norm_api._run_forward)),
                                (norm_api.layer_norm_backward_op, table.backward(norm_api._run_backward))):
        monkeypatch.setattr(op, "implementations", {impl.name: impl for impl in implementations})

    x = jax.random.normal(jax.random.key(0), (6, 16), jnp.float32)
    scale = jnp.linspace(0.5, 1.5, 16)
    loss = lambda x, scale, impl: jnp.sum(jnp.sin(norm_api.layer_norm(x, scale, implementation=impl)))
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, scale, "toy")
    assert toy.calls == ["forward", "backward"]  # both passes ran the toy kernels
    expected_value, expected_grads = jax.value_and_grad(loss, argnums=(0, 1))(x, scale, "xla")
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


#: Files still building a `jax.custom_vjp` inside a function (one per call): none since issue 36; an
#: entry here must still build one (the test fails on a stale entry).
_PER_CALL_VJP_ALLOWED: set[str] = set()


def _per_call_custom_vjps(path: pathlib.Path) -> list[int]:
    tree = ast.parse(path.read_text())
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in fn.body:  # a decorator of a module-level function is built once
                for node in ast.walk(statement):
                    if isinstance(node, ast.Attribute) and node.attr in ("custom_vjp", "custom_jvp"):
                        lines.append(node.lineno)
    return lines


def test_no_op_builds_a_custom_vjp_per_call():
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        lines = _per_call_custom_vjps(path)
        if lines and rel not in _PER_CALL_VJP_ALLOWED:
            found[rel] = lines
    assert not found, f"custom_vjp built inside a function (use stellax.core.vjp.apply): {found}"
    stale = sorted(rel for rel in _PER_CALL_VJP_ALLOWED if not _per_call_custom_vjps(SRC / rel))
    assert not stale, f"remove from the allow-list, they no longer build per-call VJPs: {stale}"
