"""One name per op for users: the public function's name or the registry's.

The registry names an op after its canonical form (``layer_norm``,
``attention``, ``moe_route``); users know the public functions
(``stellax.rms_norm``, ``stellax.dot_product_attention``, ``stellax.route``).
Everywhere a user names an op (``stellax check OPS``, ``stellax bench --ops``,
``stellax autotune --ops`` and shapes files, ``stellax lab ... --op``, a
plugin's ``OP``, the suites' ``--ops``) either name works: `resolve_op_name`
turns it into the registry name, and `display_name` gives the name to print.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from .core.op import Op, registered_ops

#: Public functions (``stellax.<name>``) that run a registered op of another name.
#: A public function whose name is its op's (``layer_norm``, ``ragged_dot``,
#: ``paged_attention``, ...) needs no row; one that picks among several ops by its
#: arguments (``ragged_dot_general``: ``ragged_dot`` or ``ragged_dot_tgmm``) or
#: composes several (``quantized_linear``, ``moe_mlp_shard``) has none either.
OP_ALIASES: dict[str, str] = {
    "dot_product_attention": "attention",
    "dot_product_attention_varlen": "attention",
    "rms_norm": "layer_norm",
    "route": "moe_route",
}

#: The name printed for a registered op whose name no public function has.
_PUBLIC: dict[str, str] = {"attention": "dot_product_attention", "moe_route": "route"}


class UnknownOpError(ValueError):
    """A name that is neither a registered op nor a public function's name for one."""


def valid_names(ops: Mapping[str, Op] | None = None) -> list[str]:
    """The names `resolve_op_name` accepts: registered ops and the aliases of those, sorted."""
    ops = registered_ops() if ops is None else ops
    return sorted(set(ops) | {alias for alias, name in OP_ALIASES.items() if name in ops})


def resolve_op_name(name: str, ops: Mapping[str, Op] | None = None) -> str:
    """The registry name of the op ``name`` names (a registered op's name, or a
    public function's: ``rms_norm`` -> ``layer_norm``).

    Raises:
      UnknownOpError: ``name`` names no op; the message lists the valid names.
    """
    ops = registered_ops() if ops is None else ops
    if name in ops:
        return name
    target = OP_ALIASES.get(name)
    if target is not None and target in ops:
        return target
    raise UnknownOpError(f"no registered op {name!r}; expected one of {valid_names(ops)}")


def resolve_op_names(names: Iterable[str], ops: Mapping[str, Op] | None = None) -> list[str]:
    """`resolve_op_name` of each name, in order, without repeats."""
    return list(dict.fromkeys(resolve_op_name(n, ops) for n in names))


def is_op_name(name: str, ops: Mapping[str, Op] | None = None) -> bool:
    """Whether `resolve_op_name` accepts ``name``."""
    ops = registered_ops() if ops is None else ops
    return name in ops or OP_ALIASES.get(name) in ops


def display_name(name: str) -> str:
    """The name to print for the registered op ``name``: ``"attention (dot_product_attention)"``
    where no public function is called ``name``, else ``name``."""
    public = _PUBLIC.get(name)
    return f"{name} ({public})" if public else name
