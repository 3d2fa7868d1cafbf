"""The custom-op signature of a JAX function, derived from its annotations.

`derive(fn)` reads ``fn(*arrays, *, **options) -> outputs``:

* each positional parameter is an operand. ``jax.Array`` is one tensor,
  ``jax.Array | None`` an optional one; a pytree class with a `Struct`
  (``QArray``, ``QuantizedPages``) expands to its tensors and static
  options (``QArray | jax.Array`` also takes a dense tensor, see
  `stellax.torch.structs`);
* each keyword-only parameter is a static option; its annotation gives the
  schema type: ``bool``, ``int``, ``float``, ``str``, ``list[int]``,
  ``list[float]``, each optionally ``| None``;
* the return annotation gives the outputs: ``jax.Array``, a `Struct` class
  (``| jax.Array``, ``| None``), or a ``tuple[...]`` of those.

What the annotations cannot say is given explicitly: ``no_grad``, the
floating-point tensors that are data (selection biases, quantization
scales); integer, boolean and fp8 tensors never get gradients anyway.

The schema lists the tensors in parameter order, then the options of the
structured operands (in parameter order), then the function's own options.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Callable, Sequence

import jax

from .structs import Struct, struct_of

__all__ = ["TensorArg", "Operand", "Signature", "derive", "explicit"]

_OPTION_TYPES = {bool: "bool", int: "int", float: "float", str: "str", list[int]: "int[]", list[float]: "float[]"}


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """One tensor of the custom-op schema."""

    name: str
    optional: bool = False
    differentiable: bool = True


@dataclasses.dataclass(frozen=True)
class Operand:
    """One positional parameter of the JAX function.

    ``struct`` is None for a plain tensor; ``dense``: a struct parameter that
    also takes a plain tensor; ``options``: the schema names of its statics."""

    name: str
    tensors: tuple[TensorArg, ...]
    struct: Struct | None = None
    dense: bool = True
    options: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Signature:
    """Operands, options (schema name -> type) and outputs of a custom op.

    ``outputs`` holds one entry per JAX output: None for a tensor, or the
    `Struct` whose tensors it crosses as."""

    operands: tuple[Operand, ...]
    options: dict[str, str]
    outputs: tuple[Struct | None, ...]

    @property
    def tensors(self) -> list[TensorArg]:
        return [t for op in self.operands for t in op.tensors]

    @property
    def own_options(self) -> list[str]:
        """The function's keyword options (the options not owned by a structured operand)."""
        owned = {o for op in self.operands for o in op.options}
        return [o for o in self.options if o not in owned]

    @property
    def n_outputs(self) -> int:
        return sum(1 if s is None else s.n_tensors for s in self.outputs)

    def schema(self) -> str:
        params = [f"Tensor{'?' if t.optional else ''} {t.name}" for t in self.tensors]
        params += [f"{typ} {name}" for name, typ in self.options.items()]
        n = self.n_outputs
        returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
        return "(" + ", ".join(params) + ") -> " + returns


def _members(hint) -> tuple[list, bool]:
    """``X | Y | None`` -> ([X, Y], optional)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = list(typing.get_args(hint))
    else:
        args = [hint]
    optional = type(None) in args
    return [a for a in args if a is not type(None)], optional


def _operand(where: str, name: str, hint, no_grad: set) -> Operand:
    members, optional = _members(hint)
    dense = jax.Array in members
    structs = [s for s in (struct_of(m) for m in members) if s is not None]
    if len(members) != dense + len(structs) or len(structs) > 1 or not members:
        raise TypeError(f"{where}: parameter {name!r}: expected jax.Array, a QArray/QuantizedPages class or their "
                        f"union (| None), got {hint!r}")
    if not structs:
        return Operand(name, (TensorArg(name, optional, name not in no_grad),))
    s = structs[0]
    required = 1 if dense else s.required  # a dense tensor fills the first slot only
    tensors = tuple(TensorArg(f"{name}_{t}", optional or i >= required, f"{name}_{t}" not in no_grad)
                    for i, t in enumerate(s.tensor_names))
    return Operand(name, tensors, s, dense, tuple(f"{name}_{o}" for o in s.options))


def _option_type(where: str, name: str, hint) -> str:
    members, optional = _members(hint)
    if len(members) != 1 or members[0] not in _OPTION_TYPES:
        raise TypeError(f"{where}: option {name!r}: expected bool, int, float, str, list[int] or list[float] "
                        f"(| None), got {hint!r}")
    return _OPTION_TYPES[members[0]] + ("?" if optional else "")


def _outputs(where: str, hint) -> tuple[Struct | None, ...]:
    items = typing.get_args(hint) if typing.get_origin(hint) is tuple else (hint,)
    outs = []
    for item in items:
        members, _ = _members(item)
        structs = [s for s in (struct_of(m) for m in members) if s is not None]
        if not structs and members != [jax.Array]:
            raise TypeError(f"{where}: return annotation: expected jax.Array, a QArray/QuantizedPages class or a "
                            f"tuple of them, got {item!r}")
        outs.append(structs[0] if structs else None)
    return tuple(outs)


def derive(fn: Callable, *, no_grad: Sequence[str] = (), where: str = "") -> Signature:
    """The `Signature` of ``fn`` from its annotations (see the module docstring)."""
    where = where or getattr(fn, "__qualname__", repr(fn))
    hints = typing.get_type_hints(fn)
    operands, own = [], {}
    for p in inspect.signature(fn).parameters.values():
        if p.name not in hints:
            raise TypeError(f"{where}: parameter {p.name!r} has no annotation")
        if p.kind is p.KEYWORD_ONLY:
            own[p.name] = _option_type(where, p.name, hints[p.name])
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            operands.append(_operand(where, p.name, hints[p.name], set(no_grad)))
        else:
            raise TypeError(f"{where}: parameter {p.name!r}: *args/**kwargs cannot be derived")
    if "return" not in hints:
        raise TypeError(f"{where}: no return annotation")
    options = {}
    for op in operands:
        if op.struct is None:
            continue
        optional = op.dense or op.tensors[0].optional  # a dense tensor or None has no statics
        for o, typ in zip(op.options, op.struct.options.values()):
            options[o] = typ + "?" if optional and not typ.endswith("?") else typ
    options.update(own)
    known = {t.name for t in (t for op in operands for t in op.tensors)}
    unknown = set(no_grad) - known
    if unknown:
        raise ValueError(f"{where}: no_grad: {sorted(unknown)} are not tensors of the op (tensors: {sorted(known)})")
    return Signature(tuple(operands), options, _outputs(where, hints["return"]))


def _parse_tensor(spec: str) -> TensorArg:
    """``"x"``, ``"scale?"`` (optional), ``"segment_ids?!"``/``"lengths!"`` (``!``: not differentiable)."""
    diff = not spec.endswith("!")
    spec = spec.rstrip("!")
    optional = spec.endswith("?")
    return TensorArg(spec.rstrip("?"), optional, diff)


def explicit(tensors: Sequence[str], options: dict[str, str], outputs: int) -> Signature:
    """A `Signature` from explicit lists (tensor specs ``"x"``, ``"x?"``, ``"x!"``)."""
    operands = tuple(Operand(a.name, (a,)) for a in map(_parse_tensor, tensors))
    return Signature(operands, dict(options), (None,) * int(outputs))
