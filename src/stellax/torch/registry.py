"""Registering stellax (JAX) functions as PyTorch custom ops.

`define_op` turns a JAX function over arrays into ``stellax::<name>``, a
`torch.library.custom_op` with

* a forward that crosses the tensors to JAX over DLPack (`bridge`), runs a
  jitted JAX function taken from a cache keyed by (op, input shapes/dtypes,
  options), and crosses the outputs back;
* a schema derived from the JAX function's annotations (`signature`):
  arrays are tensors, keyword options are static options, `QArray` /
  `QuantizedPages` operands and outputs cross as their tensors and statics
  (`structs`);
* a fake (meta) implementation from ``jax.eval_shape`` of the same function
  (`fake`), so `torch.compile(fullgraph=True)` and `torch.library.opcheck`
  trace through it without running JAX;
* autograd through `torch.library.register_autograd`: the backward is a
  second custom op, ``stellax::<name>_backward``, which runs the JAX VJP
  (``jax.vjp`` of the same function with respect to the inputs autograd asks
  for, jitted and cached the same way). The
  VJP recomputes the forward inside the backward's XLA program (as
  FlashAttention does) instead of carrying JAX residuals across the bridge,
  so nothing but the inputs is saved for backward.

Checked mode (`stellax.checked()` or ``STELLAX_CHECKS=1``, issue 43): the
forward runs the JAX function under ``checkify`` (a function of its own in the
cache) and raises ``ValueError("stellax::<name>: <check message>")`` naming
the argument and the bad value (``cu_seqlens_q[0]: expected 0, got 1``,
``lengths[1] = 33``, ``expert_ids[1, 0]: ... got 3``, ``g: ... largest value of
30.0``) before any output crosses back. Without checks the ops return the
documented result for bad data (NaN rows, dropped copies). The backward runs
with checks off: the forward has already checked the same inputs.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import checkify

from ..core.runtime_checks import checked, checks_enabled
from ..core.vjp import vjp_at
from . import bridge
from .compiled import _cache, _cached, cache_info, clear_cache  # noqa: F401  (part of this module's API)
from .fake import fake_shapes
from .signature import Signature, derive, explicit

__all__ = ["ForwardOnlyError", "TorchOp", "define_op", "cache_info", "clear_cache"]

NAMESPACE = "stellax"

# -- op definition -----------------------------------------------------------------------
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

    def __init__(self, name: str, jax_fn: Callable, *, signature: Signature, differentiable: bool = True,
                 forward_only_reason: str | None = None, jit: bool = True):
        self.name = name
        self.jax_fn = jax_fn
        self.jit = bool(jit)
        self.forward_only_reason = forward_only_reason
        self.signature = signature
        self.tensors = signature.tensors
        self.options = dict(signature.options)
        self.outputs = signature.n_outputs
        self.n_tensors = len(self.tensors)
        self._own = signature.own_options
        self.schema = signature.schema()
        params = self.schema[1:self.schema.index(") -> ")].split(", ")
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
        """Call with the JAX function's arguments (structured operands as their
        torch twins, options positionally or by name)."""
        flat = self.flatten(*args, **kwargs)
        if "torchax" in sys.modules:  # torchax tensors run the JAX function on their arrays (stellax.torch.torchax)
            from .torchax import call
            out = call(self, flat)
            if out is not NotImplemented:
                return out
        return self.op(*flat)

    def flatten(self, *args, **kwargs) -> tuple:
        """The custom op's flat arguments for the JAX function's arguments:
        each structured operand (`QTensor`, `QuantizedPages`) becomes its
        tensors, and its statics go in front of the options."""
        names = [op.name for op in self.signature.operands] + self._own
        if len(args) > len(names):
            raise TypeError(f"stellax::{self.name}: expected at most {len(names)} arguments, got {len(args)}")
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names or key in values:
                raise TypeError(f"stellax::{self.name}: unexpected or repeated argument {key!r}")
            values[key] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"stellax::{self.name}: missing arguments {missing}")
        tensors, statics = [], []
        for op in self.signature.operands:
            if op.struct is None:
                tensors.append(values[op.name])
            else:
                parts, opts = op.struct.flatten(values[op.name], op.name, dense=op.dense)
                tensors += parts
                statics += opts
        return (*tensors, *statics, *[values[n] for n in self._own])

    # -- helpers -------------------------------------------------------------------
    def _split(self, args):
        tensors = list(args[: self.n_tensors])
        opts = dict(zip(self.options, args[self.n_tensors: self.n_tensors + len(self.options)]))
        return tensors, opts

    @staticmethod
    def _opts_key(opts: dict) -> tuple:
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items())

    def _call_jax(self, present: list[int], opts: dict):
        """``f(*present_arrays) -> flat outputs``: the user function with the
        absent optional tensors filled with None, the structured operands
        rebuilt, the options bound and structured outputs flattened."""
        n = self.n_tensors
        jax_fn, sig = self.jax_fn, self.signature
        own = {k: opts[k] for k in self._own}

        def f(*arrays):
            full = [None] * n
            for i, a in zip(present, arrays):
                full[i] = a
            args, start = [], 0
            for op in sig.operands:
                part = full[start:start + len(op.tensors)]
                start += len(op.tensors)
                args.append(part[0] if op.struct is None else op.struct.to_jax(part, [opts[o] for o in op.options]))
            out = jax_fn(*args, **own)
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            if len(outs) != len(sig.outputs):
                raise TypeError(f"stellax::{self.name}: the JAX function returned {len(outs)} outputs, its "
                                f"signature declares {len(sig.outputs)}")
            flat = []
            for struct, o in zip(sig.outputs, outs):
                flat += [o] if struct is None else struct.outputs(o)
            return tuple(flat)
        return f

    def _diff_positions(self, tensors) -> list[int]:
        return [i for i, (a, t) in enumerate(zip(self.tensors, tensors))
                if a.differentiable and t is not None and _is_grad_dtype(t.dtype)]

    def _maybe_jit(self, fn):
        return jax.jit(fn) if self.jit else fn

    def _checked_fn(self, fn):
        """``fn`` under ``checkify`` (its checked-mode checks functionalized), jitted like ``fn``."""
        return self._maybe_jit(checkify.checkify(fn))

    def raise_failed_check(self, err) -> None:
        """Raise the first failed checked-mode check of a ``checkify`` error as a ``ValueError``
        naming the op (nothing when every check passed)."""
        message = err.get()
        if message is not None:
            raise ValueError(f"stellax::{self.name}: {message}")

    def run_jax(self, key: tuple, build: Callable[[], Callable], arrays) -> tuple:
        """Run the cached function ``build()`` on ``arrays``; in checked mode the ``checkify`` form
        of it (cached under its own key) instead, raising on a failed check."""
        if not checks_enabled():
            return _cached(key, lambda: self._maybe_jit(build()))(*arrays)
        err, outs = _cached(key + ("checked",), lambda: self._checked_fn(build()))(*arrays)
        self.raise_failed_check(err)
        return outs

    @staticmethod
    def _outputs_to_torch(outs, inputs) -> list[torch.Tensor]:
        result = []
        ptrs = {t.data_ptr() for t in inputs if t is not None and t.numel()}
        for o in outs:
            t = bridge.to_torch(o)
            if isinstance(t, bridge.PackedTensor):
                t = t.data  # formats torch lacks cross as their packed bytes (as the fake says)
            if t.numel() and t.data_ptr() in ptrs:
                t = t.clone()  # XLA forwarded an input buffer: a custom op's output must not alias
            result.append(t)
        return result

    # -- forward -----------------------------------------------------------------------
    def _check_devices(self, tensors) -> None:
        """Every tensor operand on one device (a ``meta`` tensor next to a CPU
        weight would otherwise silently dispatch to the fake)."""
        first = None
        for arg, t in zip(self.tensors, tensors):
            if t is None:
                continue
            if first is None:
                first = (arg.name, t.device)
            elif t.device != first[1]:
                raise ValueError(f"{arg.name}: expected a tensor on {first[1]} (the device of {first[0]}), "
                                 f"got one on {t.device}")

    def _forward_impl(self, *args):
        tensors, opts = self._split(args)
        self._check_devices(tensors)
        present = [i for i, t in enumerate(tensors) if t is not None]
        key = (self.name, "fwd", tuple(_signature(t) for t in tensors), self._opts_key(opts))
        outs = self.run_jax(key, lambda: self._call_jax(present, opts), [bridge.to_jax(tensors[i]) for i in present])
        result = self._outputs_to_torch(outs, tensors)
        return result[0] if self.outputs == 1 else tuple(result)

    def _eval_shape(self, present, shapes, dtypes, opts):
        """Output ``(shape, torch dtype)`` of the JAX function at concrete
        input shapes (cached by the abstract signature)."""
        key = (self.name, "shape", tuple(shapes), tuple(dtypes), self._opts_key(opts))

        def build():
            structs = [jax.ShapeDtypeStruct(s, np.int32 if d == torch.int64 else bridge.jax_dtype(d))
                       for s, d in zip(shapes, dtypes)]
            outs = jax.eval_shape(self._call_jax(present, opts), *structs)
            return [bridge.torch_struct(o.shape, o.dtype) for o in outs]
        return _cached(key, build)

    def _abstract_outputs(self, tensors, opts):
        """Output ``(shape, dtype)`` from ``jax.eval_shape`` (see `fake_shapes`)."""
        present = [i for i, t in enumerate(tensors) if t is not None]
        dtypes = [tensors[i].dtype for i in present]

        def evaluate(shapes):
            return self._eval_shape(present, shapes, dtypes, opts)
        return fake_shapes([tuple(tensors[i].shape) for i in present], evaluate)

    def _forward_fake(self, *args):
        tensors, opts = self._split(args)
        self._check_devices(tensors)
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
                outs, pullback = vjp_at(f, arrays, diff_slots)
                # Integer outputs (ids) and fp8 / E8M0 data outputs have no gradient.
                cts = tuple(c.astype(o.dtype) if np.dtype(o.dtype) in _JAX_GRAD_DTYPES
                            else np.zeros(o.shape, jax.dtypes.float0)
                            for c, o in zip(cotangents, outs))
                return pullback(cts)
            return self._maybe_jit(vjp)

        fn = _cached(key, build)
        arrays = tuple(bridge.to_jax(tensors[i]) for i in present)
        cts = tuple(bridge.to_jax(g) for g in grads)
        with checked(False):  # the forward checked these inputs; a staged check here could not be raised
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


def define_op(name: str, jax_fn: Callable, *, no_grad: Sequence[str] = (), differentiable: bool = True,
              forward_only_reason: str | None = None, jit: bool = True, tensors: Sequence[str] | None = None,
              options: dict[str, str] | None = None, outputs: int = 1) -> TorchOp:
    """Register ``jax_fn`` as the torch custom op ``stellax::<name>``.

    Args:
      name: the op name inside the ``stellax`` namespace.
      jax_fn: ``jax_fn(*operands, **options) -> output(s)``, annotated: the
        schema (tensors, structured operands, option types, outputs) is
        derived from its signature (`stellax.torch.signature`); absent
        optional operands arrive as ``None``.
      no_grad: floating-point tensors (schema names) that are data and get
        no gradient (integer, boolean and fp8 tensors never do).
      differentiable: register the VJP backward.
      forward_only_reason: with ``differentiable=False``: register a backward
        that raises `ForwardOnlyError` with this explanation (the op is an
        inference op: a gradient through it is a user error, not a silent
        None). Without it, torch's generic "no autograd formula" error applies.
      jit: wrap the forward and the VJP in ``jax.jit`` (default). ``False`` for
        functions that place arrays on other devices themselves (the
        expert- and context-parallel front ends jit their SPMD core and move
        the inputs onto the mesh eagerly).
      tensors, options, outputs: an explicit schema instead of the derived
        one, for unannotated functions: tensor specs ``"x"``, ``"scale?"``
        (optional), ``"ids!"`` (no gradient), options ``{name: schema type}``
        and the number of outputs.

    The fake (meta) implementation is always derived: ``jax.eval_shape`` of
    ``jax_fn`` (cached by the abstract signature; see `fake_shapes`). Only
    float32/float16/bfloat16/float64 tensors are differentiated; fp8 and
    E8M0 tensors (quantized codes and scales) are data, like integers.

    Returns:
      The `TorchOp`; call it with the JAX function's arguments (`TorchOp.flatten`).
    """
    if name in _OPS:
        return _OPS[name]
    if tensors is not None:
        signature = explicit(tensors, options or {}, outputs)
    else:
        signature = derive(jax_fn, no_grad=no_grad, where=f"stellax::{name}")
    op = TorchOp(name, jax_fn, signature=signature, differentiable=differentiable,
                 forward_only_reason=forward_only_reason, jit=jit)
    _OPS[name] = op
    return op


def registered_torch_ops() -> dict[str, TorchOp]:
    """Every ``stellax::`` custom op defined so far, by name."""
    return dict(_OPS)
