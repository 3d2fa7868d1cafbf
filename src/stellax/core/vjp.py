"""One `jax.custom_vjp` for every op: a kernel and its backward as a frozen rule object.

A forward implementation whose gradients come from a backward op describes the pair as a rule, a
frozen (hashable) dataclass holding everything static — the kernel module, the config, the checked
options — with two methods::

    rule.forward(*operands)  -> (outputs, residuals)
    rule.backward(residuals, cotangents) -> one cotangent per operand (None: zero)
    rule.primal(*operands)   -> outputs   (optional: the undifferentiated call, when cheaper)

and calls ``apply(rule, *operands)``. The ``custom_vjp`` is defined once, here, with the rule as its
static argument, so no op builds a new differentiable function on every call.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax


class VjpRule(Protocol):
    """What `apply` differentiates (see the module docstring)."""

    def forward(self, *operands) -> tuple[Any, Any]: ...

    def backward(self, residuals, cotangents) -> tuple: ...


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def apply(rule: VjpRule, *operands):
    """``rule.forward(*operands)[0]``, differentiated with ``rule.backward``. A rule may also
    define ``primal(*operands) -> outputs``: what runs when nothing differentiates the call
    (a forward that computes gradients ahead, like the fused cross-entropy sweep, skips them)."""
    primal = getattr(rule, "primal", None)
    return primal(*operands) if primal is not None else rule.forward(*operands)[0]


def _apply_forward(rule: VjpRule, *operands):
    return rule.forward(*operands)


def _apply_backward(rule: VjpRule, residuals, cotangents):
    return tuple(rule.backward(residuals, cotangents))


apply.defvjp(_apply_forward, _apply_backward)


def vjp_at(fn, args, argnums):
    """``jax.vjp`` of ``fn(*args)`` with respect to ``args[i]`` for ``i`` in ``argnums`` only (the other
    arguments held fixed): ``(outputs, pullback)``, the pullback giving one cotangent per ``argnums``."""
    def partial_fn(*diff_args):
        full = list(args)
        for i, a in zip(argnums, diff_args):
            full[i] = a
        return fn(*full)

    return jax.vjp(partial_fn, *[args[i] for i in argnums])
