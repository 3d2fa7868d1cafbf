"""Checked mode: an op's data-dependent preconditions as `jax.experimental.checkify` checks.

Argument checks (`core.checks`) see shapes, dtypes and static options. What depends on the values
— sequence offsets, group sizes, expert ids, permutations, page tables, decay signs — cannot be
checked on the host under `jax.jit`. Each op documents what it does with such bad values (a well
defined result, or NaN in exactly the affected rows); in checked mode it also states them as
``checkify`` checks::

    with stellax.checked():                      # or STELLAX_CHECKS=1 in the environment
        out = stellax.ragged_dot(lhs, rhs, sizes)          # eager: raises naming the argument
        err, out = checkify.checkify(jax.jit(f))(...)      # under jit: functionalized
        err.throw()

Off (the default), `require` adds nothing to the program: the jaxpr is the same as without it.
On, a jitted function calling an op must be wrapped in `checkify.checkify` (JAX refuses to stage a
check otherwise: "Cannot abstractly evaluate a checkify.check which was not functionalized").
Whether checks are on is read when the op is traced; a `checked` block is part of `jax.jit`'s cache
key, so a function jitted outside one is traced again inside it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import jax
from jax.experimental import checkify

#: The environment variable that turns checked mode on for the whole process.
ENV = "STELLAX_CHECKS"
_ON = ("1", "true", "on", "yes")
_OFF = ("", "0", "false", "off", "no")

#: The innermost `checked` block's setting (None outside any). Part of jit's cache key, so a function
#: jitted with checks off is traced again when called with checks on (and the other way round).
_CHECKED = jax.make_user_context(default_value=None)


def _from_environment() -> bool:
    value = os.environ.get(ENV, "")
    if value.strip().lower() in _ON:
        return True
    if value.strip().lower() in _OFF:
        return False
    raise ValueError(f"{ENV}: expected one of {list(_ON)} (checks on) or {list(_OFF)} (off), got {value!r}")


def checks_enabled() -> bool:
    """Whether ops state their data-dependent preconditions as checks here (innermost `checked`
    block, else `STELLAX_CHECKS`)."""
    inner = _CHECKED.value
    return _from_environment() if inner is None else inner


@contextlib.contextmanager
def checked(enabled: bool = True):
    """Context manager: ops traced inside state their data-dependent preconditions as ``checkify``
    checks (``enabled=False`` turns them off inside an enclosing block). Blocks nest."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    with _CHECKED(enabled):
        yield


def require(predicate: Callable[[], Any], message: str, **values: Callable[[], Any]) -> None:
    """In checked mode, ``checkify.check(predicate(), message, **{k: v() for k, v in values})``;
    otherwise nothing: the predicate and the values are thunks, so with checks off not even their
    computation enters the program.

    ``message`` names the argument and what was expected; ``{name}`` fields are filled with the
    traced ``values`` (e.g. the first bad index), as in `checkify.check`."""
    if checks_enabled():
        checkify.check(predicate(), message, **{name: value() for name, value in values.items()})
