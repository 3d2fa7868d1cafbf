"""Fake (meta) output shapes of a custom op from ``jax.eval_shape``.

`fake_shapes` runs the op's JAX function abstractly (``evaluate``, cached
by the caller) at the inputs' sizes. Under ``torch.compile`` with dynamic
shapes some input sizes are symbols (`torch.SymInt`); JAX needs integers,
so the function is evaluated twice: at the symbols' hints and at twice the
hints (every symbolic size doubled, the static ones kept). Then for each
output size ``a`` (hint run) and ``b`` (doubled run):

* ``a == b``: a constant, independent of the symbols;
* ``b == 2a`` and ``a`` is the hint of an input symbol: that symbol (when
  several symbols share the hint, they are guarded equal, so the graph is
  only reused while the choice stays right);
* anything else (``n - 1``, ``T * k``, a doubled run that fails the op's
  checks): the symbolic inputs are specialized to their hints (guards:
  torch recompiles for other sizes), and the hint run's sizes are used.

So a fake shape is never wrong for a graph torch reuses; at worst it costs
a recompilation where a hand-written shape function would have stayed
symbolic.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["fake_shapes"]


def _hint(d) -> int:
    if isinstance(d, torch.SymInt):
        node = d.node
        return int(node.hint) if node.has_hint() else int(d)
    return int(d)


def _specialize(shapes) -> None:
    for shape in shapes:
        for d in shape:
            if isinstance(d, torch.SymInt):
                int(d)  # guards the symbol to its hint


def fake_shapes(shapes: Sequence[tuple], evaluate: Callable[[list[tuple]], list[tuple]]) -> list[tuple]:
    """Output ``(shape, dtype)`` pairs for inputs of ``shapes`` (ints or
    `torch.SymInt`), given ``evaluate(concrete shapes) -> [(shape, dtype)]``
    (see the module docstring). ``evaluate`` raising ``ValueError`` /
    ``TypeError`` for the doubled sizes means "specialize"."""
    hints = [tuple(_hint(d) for d in shape) for shape in shapes]
    outs = evaluate(hints)
    symbols: dict[int, list] = {}
    for shape in shapes:
        for d in shape:
            if isinstance(d, torch.SymInt):
                group = symbols.setdefault(_hint(d), [])
                if all(d.node.expr != s.node.expr for s in group):
                    group.append(d)
    if not symbols:
        return outs
    doubled = [tuple(2 * h if isinstance(d, torch.SymInt) else h for d, h in zip(shape, hint))
               for shape, hint in zip(shapes, hints)]
    try:
        probe = evaluate(doubled)
    except (ValueError, TypeError):
        _specialize(shapes)
        return outs
    result = []
    for (shape, dtype), (shape2, _) in zip(outs, probe):
        if len(shape) != len(shape2):
            _specialize(shapes)
            return outs
        dims = []
        for a, b in zip(shape, shape2):
            if a == b:
                dims.append(a)
            elif b == 2 * a and a in symbols:
                first, *others = symbols[a]
                for other in others:
                    bool(first == other)  # guards the equality the choice relies on
                dims.append(first)
            else:
                _specialize(shapes)
                return outs
        result.append((tuple(dims), dtype))
    return result
