"""Registering stellax (JAX) functions as PyTorch custom ops.

`define_op` turns a JAX function over arrays into ``stellax::<name>``, a
`torch.library.custom_op` with

* a forward that crosses the tensors to JAX over DLPack (`bridge`), runs a
  jitted JAX function taken from a cache keyed by (op, input shapes/dtypes,
  options), and crosses the outputs back;
* a fake (meta) implementation, so `torch.compile(fullgraph=True)` and
  `torch.library.opcheck` trace through it without running JAX;
* autograd through `torch.library.register_autograd`: the backward is a
  second custom op, ``stellax::<name>_backward``, which runs the JAX VJP
  (``jax.vjp`` of the same function with respect to the inputs autograd asks
  for, jitted and cached the same way). The
  VJP recomputes the forward inside the backward's XLA program (as
  FlashAttention does) instead of carrying JAX residuals across the bridge,
  so nothing but the inputs is saved for backward.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import bridge

__all__ = ["ForwardOnlyError", "TorchOp", "define_op", "cache_info", "clear_cache"]

NAMESPACE = "stellax"

# -- compiled-function cache ----------------------------------------------------------
_CACHE_SIZE = 1024
_cache: "collections.OrderedDict[tuple, Callable]" = collections.OrderedDict()
_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0}


def _cached(key: tuple, build: Callable[[], Callable]) -> Callable:
    fn = _cache.get(key)
    if fn is not None:
        _stats["hits"] += 1
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            _stats["misses"] += 1
            fn = build()
            _cache[key] = fn
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return fn


def cache_info() -> dict:
    """Hits, misses and size of the compiled-function cache."""
    return {**_stats, "size": len(_cache)}


def clear_cache() -> None:
    """Drop every cached compiled function (they are rebuilt on the next call)."""
    with _lock:
        _cache.clear()
        _stats.update(hits=0, misses=0)


# -- op definition -----------------------------------------------------------------------
_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


@dataclasses.dataclass(frozen=True)
class TensorArg:
    name: str
    optional: bool = False
    differentiable: bool = True


def _parse_tensor(spec: str) -> TensorArg:
    """``"x"``, ``"scale?"`` (optional), ``"segment_ids?!"``/``"lengths!"`` (``!``: not differentiable)."""
    diff = not spec.endswith("!")
    spec = spec.rstrip("!")
    optional = spec.endswith("?")
    return TensorArg(spec.rstrip("?"), optional, diff)


def _signature(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.device.type)


#: The dtypes autograd differentiates. Other floating types (fp8 codes and
#: scales, E8M0) are data: no gradient flows into or out of them.
GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


_JAX_GRAD_DTYPES = frozenset(np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64))


def _is_grad_dtype(dtype) -> bool:
    return dtype in GRAD_DTYPES


class ForwardOnlyError(RuntimeError):
    """A gradient was requested through a forward-only (inference) stellax op."""


class TorchOp:
    """A stellax op as a torch custom op; see `define_op`."""

    def __init__(self, name: str, jax_fn: Callable, *, tensors: Sequence[str], options: dict[str, str],
                 outputs: int = 1, fake: Callable | None = None, differentiable: bool = True,
                 forward_only_reason: str | None = None, jit: bool = True):
        self.name = name
        self.jax_fn = jax_fn
        self.jit = bool(jit)
        self.forward_only_reason = forward_only_reason
        self.tensors = [_parse_tensor(s) for s in tensors]
        self.options = dict(options)
        self.outputs = int(outputs)
        self._fake = fake
        self.n_tensors = len(self.tensors)
        params = [f"Tensor{'?' if a.optional else ''} {a.name}" for a in self.tensors]
        params += [f"{typ} {opt}" for opt, typ in self.options.items()]
        returns = "Tensor" if self.outputs == 1 else "(" + ", ".join(["Tensor"] * self.outputs) + ")"
        self.schema = "(" + ", ".join(params) + ") -> " + returns
        qualname = f"{NAMESPACE}::{name}"
        self.op = torch.library.custom_op(qualname, self._forward_impl, mutates_args=(), schema=self.schema)
        self.op.register_fake(self._forward_fake)
        self.backward_op = None
        if differentiable and any(a.differentiable for a in self.tensors):
            grads = [f"Tensor grad_{i}" for i in range(self.outputs)]
            bschema = "(" + ", ".join(params + grads + ["int[] wanted"]) + ") -> Tensor[]"
            self.backward_op = torch.library.custom_op(
                f"{qualname}_backward", self._backward_impl, mutates_args=(), schema=bschema)
            self.backward_op.register_fake(self._backward_fake)
            self.op.register_autograd(self._autograd_backward, setup_context=self._setup_context)
        elif forward_only_reason is not None:
            # Forward runs as usual (outputs require grad when inputs do, so the
            # error comes at backward time, naming the op), backward raises.
            self.op.register_autograd(self._forward_only_backward, setup_context=self._forward_only_context)

    def __repr__(self) -> str:
        return f"TorchOp(stellax::{self.name}{self.schema})"

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    # -- helpers -------------------------------------------------------------------
    def _split(self, args):
        tensors = list(args[: self.n_tensors])
        opts = dict(zip(self.options, args[self.n_tensors: self.n_tensors + len(self.options)]))
        return tensors, opts

    @staticmethod
    def _opts_key(opts: dict) -> tuple:
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items())

    def _call_jax(self, present: list[int], opts: dict):
        """``f(*present_arrays) -> outputs``: the user function with the absent
        optional tensors filled with None and the options bound."""
        n = self.n_tensors
        jax_fn = self.jax_fn

        def f(*arrays):
            full = [None] * n
            for i, a in zip(present, arrays):
                full[i] = a
            out = jax_fn(*full, **opts)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return f

    def _diff_positions(self, tensors) -> list[int]:
        return [i for i, (a, t) in enumerate(zip(self.tensors, tensors))
                if a.differentiable and t is not None and _is_grad_dtype(t.dtype)]

    def _maybe_jit(self, fn):
        return jax.jit(fn) if self.jit else fn

    @staticmethod
    def _outputs_to_torch(outs, inputs) -> list[torch.Tensor]:
        result = []
        ptrs = {t.data_ptr() for t in inputs if t is not None and t.numel()}
        for o in outs:
            t = bridge.to_torch(o)
            if t.numel() and t.data_ptr() in ptrs:
                t = t.clone()  # XLA forwarded an input buffer: a custom op's output must not alias
            result.append(t)
        return result

    # -- forward -----------------------------------------------------------------------
    def _forward_impl(self, *args):
        tensors, opts = self._split(args)
        present = [i for i, t in enumerate(tensors) if t is not None]
        key = (self.name, "fwd", tuple(_signature(t) for t in tensors), self._opts_key(opts))
        fn = _cached(key, lambda: self._maybe_jit(self._call_jax(present, opts)))
        outs = fn(*[bridge.to_jax(tensors[i]) for i in present])
        result = self._outputs_to_torch(outs, tensors)
        return result[0] if self.outputs == 1 else tuple(result)

    def _abstract_outputs(self, tensors, opts):
        """Output ``(shape, dtype)`` from ``jax.eval_shape``. Symbolic (dynamic)
        input sizes are evaluated at their hints, and an output size equal to
        a symbolic input size's hint is given that symbol."""
        present = [i for i, t in enumerate(tensors) if t is not None]
        symbols = {}
        concrete = []
        for i in present:
            dims = []
            for d in tensors[i].shape:
                if isinstance(d, torch.SymInt):
                    hint = d.node.hint if d.node.has_hint() else None
                    value = int(hint) if hint is not None else int(d)
                    symbols.setdefault(value, d)
                    dims.append(value)
                else:
                    dims.append(int(d))
            concrete.append((tuple(dims), tensors[i].dtype))
        key = (self.name, "shape", tuple(concrete), self._opts_key(opts))

        def build():
            structs = [jax.ShapeDtypeStruct(shape, bridge.jax_dtype(dtype) if dtype != torch.int64 else np.int32)
                       for shape, dtype in concrete]
            outs = jax.eval_shape(self._call_jax(present, opts), *structs)
            return [(tuple(o.shape), bridge.torch_dtype(o.dtype)) for o in outs]
        outs = _cached(key, build)
        if not symbols:
            return outs
        return [(tuple(symbols.get(d, d) for d in shape), dtype) for shape, dtype in outs]

    def _forward_fake(self, *args):
        tensors, opts = self._split(args)
        if self._fake is not None:
            return self._fake(*tensors, **opts)
        like = next(t for t in tensors if t is not None)
        outs = [like.new_empty(shape, dtype=dtype) for shape, dtype in self._abstract_outputs(tensors, opts)]
        return outs[0] if self.outputs == 1 else tuple(outs)

    # -- backward -----------------------------------------------------------------------
    def _backward_impl(self, *args):
        """Gradients of the inputs at positions ``wanted`` (the last argument)."""
        tensors, opts = self._split(args)
        grads = list(args[self.n_tensors + len(self.options):-1])
        wanted = [int(i) for i in args[-1]]
        present = [i for i, t in enumerate(tensors) if t is not None]
        key = (self.name, "vjp", tuple(_signature(t) for t in tensors),
               tuple(_signature(g) for g in grads), self._opts_key(opts), tuple(wanted))

        def build():
            f = self._call_jax(present, opts)
            diff_slots = [present.index(i) for i in wanted]

            def vjp(arrays, cotangents):
                arrays = list(arrays)

                def g(*diff_arrays):
                    full = list(arrays)
                    for slot, a in zip(diff_slots, diff_arrays):
                        full[slot] = a
                    return f(*full)
                outs, pullback = jax.vjp(g, *[arrays[s] for s in diff_slots])
                # Integer outputs (ids) and fp8 / E8M0 data outputs have no gradient.
                cts = tuple(c.astype(o.dtype) if np.dtype(o.dtype) in _JAX_GRAD_DTYPES
                            else np.zeros(o.shape, jax.dtypes.float0)
                            for c, o in zip(cotangents, outs))
                return pullback(cts)
            return self._maybe_jit(vjp)

        fn = _cached(key, build)
        arrays = tuple(bridge.to_jax(tensors[i]) for i in present)
        cts = tuple(bridge.to_jax(g) for g in grads)
        outs = fn(arrays, cts)
        return self._outputs_to_torch(outs, tensors + grads)

    def _backward_fake(self, *args):
        tensors, _ = self._split(args)
        return [torch.empty_like(tensors[int(i)]) for i in args[-1]]

    def _setup_context(self, ctx, inputs, output):
        tensors, opts = self._split(inputs)
        present = [i for i, t in enumerate(tensors) if t is not None]
        ctx.present = present
        ctx.opts = opts
        ctx.n = len(tensors)
        ctx.save_for_backward(*[tensors[i] for i in present])
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
        data = [o for o in outs if o.is_floating_point() and not _is_grad_dtype(o.dtype)]
        if data:
            ctx.mark_non_differentiable(*data)

    def _forward_only_context(self, ctx, inputs, output):
        tensors, _ = self._split(inputs)
        ctx.names = [a.name for a, t in zip(self.tensors, tensors) if t is not None and t.requires_grad]

    def _forward_only_backward(self, ctx, *grads):
        raise ForwardOnlyError(
            f"stellax::{self.name} is forward only: {self.forward_only_reason} A gradient was requested with "
            f"respect to {', '.join(ctx.names) or 'its inputs'}; detach them (or run under torch.no_grad()).")

    def _autograd_backward(self, ctx, *grads):
        saved = ctx.saved_tensors
        tensors = [None] * ctx.n
        for i, t in zip(ctx.present, saved):
            tensors[i] = t
        # Only the inputs autograd asks for: XLA drops the rest of the VJP.
        diff = [i for i in self._diff_positions(tensors) if ctx.needs_input_grad[i]]
        result: list[Any] = [None] * (ctx.n + len(self.options))
        if not diff:
            return tuple(result)
        # Unused float outputs arrive as materialized zeros; integer outputs (ids) may arrive as None.
        grads = [torch.zeros(shape, dtype=dtype if _is_grad_dtype(dtype) else torch.float32, device=device)
                 if g is None or not _is_grad_dtype(dtype) else g for g, (shape, dtype, device) in zip(grads, ctx.out_meta)]
        dgrads = self.backward_op(*tensors, *ctx.opts.values(), *grads, diff)
        for i, g in zip(diff, dgrads):
            result[i] = g
        return tuple(result)


_OPS: dict[str, TorchOp] = {}


def define_op(name: str, jax_fn: Callable, *, tensors: Sequence[str], options: dict[str, str] | None = None,
              outputs: int = 1, fake: Callable | None = None, differentiable: bool = True,
              forward_only_reason: str | None = None, jit: bool = True) -> TorchOp:
    """Register ``jax_fn`` as the torch custom op ``stellax::<name>``.

    Args:
      name: the op name inside the ``stellax`` namespace.
      jax_fn: ``jax_fn(*arrays, **options) -> array | tuple of arrays``; absent
        optional tensors arrive as ``None``.
      tensors: the tensor parameters in order: ``"x"``; ``"scale?"`` for an
        optional tensor; a trailing ``"!"`` marks a non-differentiable one
        (integer ids, masks). Only floating-point tensors get gradients.
      options: static parameters ``{name: schema type}`` (``"float"``,
        ``"bool"``, ``"int"``, ``"str?"``, ``"int[]?"``, ...); part of the
        cache key.
      outputs: the number of output tensors.
      fake: ``fake(*tensors, **options)`` building the outputs on the fake /
        meta device; by default the shapes come from ``jax.eval_shape``.
      differentiable: register the VJP backward.
      forward_only_reason: with ``differentiable=False``: register a backward
        that raises `ForwardOnlyError` with this explanation (the op is an
        inference op: a gradient through it is a user error, not a silent
        None). Without it, torch's generic "no autograd formula" error applies.
      jit: wrap the forward and the VJP in ``jax.jit`` (default). ``False`` for
        functions that place arrays on other devices themselves (the
        expert- and context-parallel front ends jit their SPMD core and move
        the inputs onto the mesh eagerly).

    Only float32/float16/bfloat16/float64 tensors are differentiated; fp8 and
    E8M0 tensors (quantized codes and scales) are data, like integers.

    Returns:
      The `TorchOp`; call it with tensors and options positionally.
    """
    if name in _OPS:
        return _OPS[name]
    op = TorchOp(name, jax_fn, tensors=tensors, options=options or {}, outputs=outputs, fake=fake,
                 differentiable=differentiable, forward_only_reason=forward_only_reason, jit=jit)
    _OPS[name] = op
    return op


def registered_torch_ops() -> dict[str, TorchOp]:
    """Every ``stellax::`` custom op defined so far, by name."""
    return dict(_OPS)
