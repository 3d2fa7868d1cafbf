"""Structured operands: JAX pytrees (`QArray`, `QuantizedPages`) crossing a custom op.

A torch custom op takes only tensors and scalar options, so a pytree operand
is flattened: its array children become tensors (``None`` for an absent
child) and its static fields become options; the forward rebuilds the JAX
pytree from them. Each pytree type is described once, by a `Struct`:

* ``QARRAY``: `stellax.QArray` <-> `stellax.torch.QTensor`. Tensors
  ``{p}_values, {p}_scales, {p}_zero_points, {p}_tensor_scale``; options
  ``{p}_format: str, {p}_shape: int[], {p}_block_shape: int[], {p}_axis: int,
  {p}_rotation: int?``.
* ``PAGES``: `stellax.QuantizedPages` <-> `stellax.torch.QuantizedPages`.
  Tensors ``{p}_pages, {p}_scale, {p}_zero, {p}_signs, {p}_window``; options
  ``{p}_quant: str`` (the `KVQuant` as JSON) and ``{p}_head_dim: int``.

A parameter typed ``Struct | Array`` also takes a dense tensor: it goes in
the first tensor slot and the options are ``None``. As outputs, a pytree
crosses as its children with an empty ``[0]`` float32 placeholder for each
absent child (a custom op returns a fixed number of tensors).

Everything here is plain Python over constants and tensors, so
``torch.compile(fullgraph=True)`` traces the flattening without a break.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from stellax import KVQuant, QArray, QuantizedPages
from stellax.ops.quant import get_format

__all__ = ["PAGES", "QARRAY", "Struct", "decode_kvquant", "encode_kvquant", "register_twin", "struct_of"]


@dataclasses.dataclass(frozen=True)
class Struct:
    """How one JAX pytree type crosses a custom op (see the module docstring).

    Attributes:
      name: the JAX class name (for messages).
      fields: the twin's tensor fields, in the pytree's child order.
      tensor_names: their schema names (``{prefix}_{name}``).
      required: how many leading tensors the schema requires (when the
        operand is given and is not dense).
      options: static option name -> schema type (``{prefix}_{name}``).
      twin_statics: the twin's static fields, after its tensor fields in its
        constructor (``QTensor(*tensors, *statics)``).
      option_values: ``twin -> tuple`` of option values, in ``options`` order.
      build_jax: ``(children, option values) -> JAX pytree``.
      present: ``twin statics -> tuple[bool]``: which children exist.
      jax_type: the JAX pytree class.
      torch_type: a zero-argument function giving the twin class (the twins
        live in the front-end modules, which import this one and bind their
        twin with `register_twin`).
    """

    name: str
    fields: tuple[str, ...]
    tensor_names: tuple[str, ...]
    required: int
    options: dict[str, str]
    twin_statics: tuple[str, ...]
    option_values: Callable[[Any], tuple]
    build_jax: Callable[[list, tuple], Any]
    present: Callable[[tuple], tuple]
    jax_type: type
    torch_type: Callable[[], type]

    @property
    def n_tensors(self) -> int:
        return len(self.fields)

    # -- torch side ---------------------------------------------------------------
    def flatten(self, value, arg: str, *, dense: bool) -> tuple[list, list]:
        """A twin (or, with ``dense``, a tensor; or None) -> (tensors, option values)."""
        if value is None or (dense and isinstance(value, torch.Tensor)):
            return [value] + [None] * (self.n_tensors - 1), [None] * len(self.options)
        if isinstance(value, self.torch_type()):
            return [getattr(value, f) for f in self.fields], list(self.option_values(value))
        kinds = "a torch.Tensor or " if dense else ""
        raise TypeError(f"{arg}: expected {kinds}a stellax.torch.{self.torch_type().__name__}, "
                        f"got {type(value).__name__}")

    def to_torch(self, tensors: Sequence, statics: Sequence | None):
        """Op outputs (``n_tensors`` tensors, placeholders included) and the
        twin's statics -> the twin (absent children None); ``statics=None``:
        the dense tensor in the first slot."""
        if statics is None:
            return tensors[0]
        parts = [t if keep else None for t, keep in zip(tensors, self.present(tuple(statics)))]
        return self.torch_type()(*parts, *statics)

    def like(self, tensors: Sequence, template):
        """`to_torch` with the statics of ``template`` (a twin; a tensor or None: dense)."""
        if not isinstance(template, self.torch_type()):
            return tensors[0]
        return self.to_torch(tensors, [getattr(template, f) for f in self.twin_statics])

    # -- JAX side ------------------------------------------------------------------
    def to_jax(self, arrays: Sequence, options: Sequence):
        """Children and option values -> the JAX pytree (the dense array, or
        None, when the options are None)."""
        if all(o is None for o in options):
            return arrays[0]
        return self.build_jax(list(arrays), tuple(options))

    def outputs(self, value) -> list:
        """A JAX pytree / dense array / None -> ``n_tensors`` arrays (placeholders for absent children)."""
        empty = jnp.zeros((0,), jnp.float32)
        if value is None:
            return [empty] * self.n_tensors
        if not isinstance(value, self.jax_type):
            return [value] + [empty] * (self.n_tensors - 1)
        children = jax.tree_util.tree_leaves(value, is_leaf=lambda x: x is None)
        return [empty if c is None else c for c in children]


#: JAX class name -> its torch twin, bound by the module defining the twin
#: (`stellax.torch.quant`: `QTensor`, `stellax.torch.paged`: `QuantizedPages`).
_TWINS: dict[str, type] = {}


def register_twin(struct: "Struct", twin: type) -> None:
    """Bind ``twin``, the torch class a ``struct`` operand crosses as."""
    _TWINS[struct.name] = twin


def _twin(name: str) -> Callable[[], type]:
    def torch_type() -> type:
        try:
            return _TWINS[name]
        except KeyError:
            raise RuntimeError(f"no torch twin of {name} registered (import stellax.torch)") from None
    return torch_type


def _qarray_present(statics):
    fmt = get_format(statics[0])
    return True, True, fmt.zero_point, fmt.tensor_scale


QARRAY = Struct(
    name="QArray",
    fields=("values", "scales", "zero_points", "tensor_scale"),
    tensor_names=("values", "scales", "zero_points", "tensor_scale"), required=2,
    options={"format": "str", "shape": "int[]", "block_shape": "int[]", "axis": "int", "rotation": "int?"},
    twin_statics=("format", "shape", "block_shape", "axis", "rotation"),
    option_values=lambda q: (q.format, list(q.shape), list(q.block_shape), int(q.axis), q.rotation),
    build_jax=lambda c, o: QArray.tree_unflatten((o[0], tuple(o[1]), tuple(o[2]), o[3], o[4]), c),
    present=_qarray_present, jax_type=QArray, torch_type=_twin("QArray"),
)


def _pages_present(statics):
    spec = statics[0]
    return True, True, not spec.symmetric, bool(spec.rotation), bool(spec.window)


def encode_kvquant(spec) -> str:
    """A `KVQuant` as the JSON string a custom-op option carries (static, part of the cache key)."""
    d = dataclasses.asdict(spec)
    d["scale_dtype"] = np.dtype(d["scale_dtype"]).name
    d["window_dtype"] = np.dtype(d["window_dtype"]).name
    return json.dumps(d, sort_keys=True)


_SPECS: dict[str, KVQuant] = {}


def decode_kvquant(text: str | None) -> KVQuant | None:
    """Inverse of `encode_kvquant` (cached: the forward decodes on every call)."""
    if text is None:
        return None
    spec = _SPECS.get(text)
    if spec is None:
        d = json.loads(text)
        for key in ("scale_dtype", "window_dtype"):
            d[key] = getattr(jnp, d[key])
        spec = _SPECS[text] = KVQuant(**d)
    return spec


def _jax_pages(children, options):
    return QuantizedPages(*children, decode_kvquant(options[0]), int(options[1]))


PAGES = Struct(
    name="QuantizedPages",
    fields=("data", "scale", "zero", "signs", "window"),
    tensor_names=("pages", "scale", "zero", "signs", "window"), required=1,
    options={"quant": "str", "head_dim": "int"},
    twin_statics=("spec", "head_dim", "quant"),
    option_values=lambda p: (p.quant, int(p.head_dim)),
    build_jax=_jax_pages, present=_pages_present, jax_type=QuantizedPages, torch_type=_twin("QuantizedPages"),
)


def struct_of(cls) -> Struct | None:
    """The `Struct` of a JAX pytree class used in an annotation, or None."""
    for s in (QARRAY, PAGES):
        if cls is s.jax_type:
            return s
    return None
