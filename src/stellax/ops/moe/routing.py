"""Routing: top-k expert selection and the router's auxiliary losses.

``route(logits [T, E], k)`` (float32 math):

    scores  = softmax(logits) | sigmoid(logits)
    choice  = scores + bias                       (bias: selection only)
    group-limited (DeepSeek-V3): group score = sum of the top-2 choice scores
        of each of ``num_groups`` expert groups (the max when a group has one
        expert); keep the ``top_k_groups`` best groups, mask the others
    ids     = top_k(choice, k)                    ties → the lower expert id
    weights = scores[ids] (/ sum when normalize_weights) * routed_scaling

Selection uses ``jax.lax.top_k``, whose ties go to the lower index (for
experts and for groups), so routing is deterministic. ``weights`` are
differentiable w.r.t. ``logits``; ``expert_ids`` are not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.runtime_checks import require
from .base import BACKENDS
from .checks import reject_expert_ids
from .examples import route_examples

_SCORINGS = ("softmax", "sigmoid")


def _scores(logits, scoring: str):
    logits = logits.astype(jnp.float32)
    return jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)


def check_route(logits, top_k, *, scoring="softmax", bias=None, num_groups=None, top_k_groups=None,
                 normalize_weights=True, routed_scaling=1.0) -> Call:
    """`moe_route`: ``logits [T, E]`` float, ``1 ≤ top_k ≤ E``, the scoring, an optional selection ``bias [E]``
    and group-limited routing (``num_groups`` dividing E, ``top_k_groups``) options."""
    logits = checks.require_float("logits", logits)
    checks.require_ndim("logits", logits, 2)
    experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected a value in [1, {experts}] (logits.shape[1], the number of experts), "
                         f"got {top_k}")
    checks.require_choice("scoring", scoring, _SCORINGS)
    if bias is not None:
        bias = checks.require_float("bias", bias)
        checks.require_shape("bias", bias, (experts,), "logits.shape[1]")
    if (num_groups is None) != (top_k_groups is None):
        raise ValueError("num_groups, top_k_groups: give both (group-limited routing) or neither, got "
                         f"num_groups={num_groups!r}, top_k_groups={top_k_groups!r}")
    if num_groups is not None:
        for name, value in (("num_groups", num_groups), ("top_k_groups", top_k_groups)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if experts % num_groups:
            raise ValueError(f"num_groups: expected a divisor of the number of experts {experts}, got {num_groups}")
        if top_k_groups > num_groups:
            raise ValueError(f"top_k_groups: expected a value in [1, {num_groups}] (num_groups), got {top_k_groups}")
        if top_k > top_k_groups * (experts // num_groups):
            raise ValueError(f"top_k: expected at most top_k_groups * experts per group = "
                             f"{top_k_groups * (experts // num_groups)}, got {top_k}")
    if not isinstance(normalize_weights, bool):
        raise TypeError(f"normalize_weights: expected a bool, got {type(normalize_weights).__name__}")
    if isinstance(routed_scaling, bool) or not isinstance(routed_scaling, (int, float, np.floating, np.integer)):
        raise TypeError(f"routed_scaling: expected a float, got {type(routed_scaling).__name__}")
    return Call({"logits": logits, "bias": bias},
                {"top_k": int(top_k), "scoring": scoring, "num_groups": num_groups, "top_k_groups": top_k_groups,
                 "normalize_weights": normalize_weights, "routed_scaling": float(routed_scaling)})


def compute_route(call: Call):
    """Golden and XLA `moe_route` (see the module doc): ``(weights [T, k] float32, expert_ids [T, k] int32)``."""
    scores = _scores(call.logits, call.scoring)
    choice = scores if call.bias is None else scores + call.bias.astype(jnp.float32)[None, :]
    choice = jax.lax.stop_gradient(choice)
    if call.num_groups is not None:
        tokens, experts = choice.shape
        grouped = choice.reshape(tokens, call.num_groups, experts // call.num_groups)
        best = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0]
        _, keep = jax.lax.top_k(jnp.sum(best, axis=-1), call.top_k_groups)
        group_mask = jnp.zeros((tokens, call.num_groups), jnp.bool_).at[
            jnp.arange(tokens)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, experts // call.num_groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, call.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if call.normalize_weights:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * call.routed_scaling, ids.astype(jnp.int32)


def _run(row, call: Call, config):
    del row, config
    return compute_route(call)


#: The family's ``xla`` row only, untuned: elementwise scores and a top-k, no kernel pays here.
route_op = BACKENDS.retuned({}).op(
    "moe_route", _run, only=("xla",), check=check_route, reference=compute_route,
    flops=lambda call: 8.0 * float(np.prod(call.logits.shape)),
    examples=route_examples, differentiable=("logits",))


def route(logits, top_k, *, scoring="softmax", bias=None, num_groups=None, top_k_groups=None,
          normalize_weights=True, routed_scaling=1.0):
    """Top-k routing → ``(weights [T, k] float32, expert_ids [T, k] int32)``.

    Args:
      logits: ``[T, E]`` router logits.
      top_k: experts per token.
      scoring: ``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3).
      bias: ``[E]`` added to the scores for *selection only* (aux-loss-free
        load balancing); the weights use the unbiased scores.
      num_groups, top_k_groups: DeepSeek group-limited routing — experts in
        ``num_groups`` equal groups, only the ``top_k_groups`` best groups
        (by the sum of their two best scores) are eligible.
      normalize_weights: divide the k weights by their sum.
      routed_scaling: multiply the weights by this factor.

    Ties are broken towards the lower expert (and group) index. One implementation, ``"xla"``
    (elementwise scores and a top-k: no kernel pays here); ``route`` takes no ``implementation``.
    """
    return route_op(logits, top_k, scoring=scoring, bias=bias, num_groups=num_groups, top_k_groups=top_k_groups,
                    normalize_weights=normalize_weights, routed_scaling=routed_scaling)


def load_balancing_loss(router_logits, expert_ids, *, scoring="softmax"):
    """The auxiliary load-balancing loss (Switch Transformer / GShard / Mixtral):

        f_e = (tokens routed to e) / (T·k),   P_e = mean_t p[t, e]
        loss = E · Σ_e f_e · P_e              (1.0 for perfectly uniform routing)

    ``p`` is the softmax of the logits (``scoring="softmax"``) or the sigmoid
    scores normalized per token (``"sigmoid"``, as DeepSeek-V3's
    sequence-wise balance loss). Differentiable w.r.t. ``router_logits``
    through ``P``.

    Data-dependent check: ``expert_ids`` in ``[0, E)`` (eagerly a `ValueError`; under ``jit`` a
    ``checkify`` check in checked mode). Without checks a copy with an id outside ``[0, E)``
    (``-1`` included: not wrapped) counts for no expert, as `permute` drops it.
    """
    router_logits = checks.require_float("router_logits", router_logits)
    checks.require_ndim("router_logits", router_logits, 2)
    expert_ids = checks.require_int("expert_ids", expert_ids)
    checks.require_ndim("expert_ids", expert_ids, 2)
    checks.require_shape("expert_ids", expert_ids, (router_logits.shape[0], None), "logits.shape[0], k")
    checks.require_choice("scoring", scoring, _SCORINGS)
    tokens, experts = router_logits.shape
    reject_expert_ids(expert_ids, experts, "router_logits.shape[1]")
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    outside = lambda: (flat < 0) | (flat >= experts)
    first = lambda: jnp.argmax(outside())
    top_k = expert_ids.shape[1]
    require(lambda: ~jnp.any(outside()),
            f"expert_ids[{{token}}, {{slot}}]: expected an expert in [0, {experts}) (router_logits.shape[1]), "
            f"got {{value}}", token=lambda: first() // top_k, slot=lambda: first() % top_k,
            value=lambda: flat[first()])
    probs = _scores(router_logits, scoring)
    if scoring == "sigmoid":
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    counts = jnp.zeros((experts,), jnp.float32).at[jnp.where(outside(), experts, flat)].add(1.0, mode="drop")
    fraction = counts / expert_ids.size
    return experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def router_z_loss(router_logits):
    """ST-MoE router z-loss: ``mean_t logsumexp(logits[t])²`` (float32)."""
    router_logits = checks.require_float("router_logits", router_logits)
    checks.require_ndim("router_logits", router_logits, 2)
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(z * z)
