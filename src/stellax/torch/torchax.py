"""stellax ops on torchax tensors: PyTorch code running on JAX, calling the JAX ops directly.

`torchax <https://github.com/google/torchax>`_ runs PyTorch programs on JAX:
a ``torchax.tensor.Tensor`` wraps a ``jax.Array`` (``t.jax()``), and every
aten op on it is a JAX function. On a TPU this is how PyTorch models run
natively. Every `stellax.torch` front end accepts torchax tensors: the
`TorchOp` call path (`stellax.torch.registry.TorchOp.__call__`) notices them
and, instead of the ``stellax::`` custom op (DLPack, host-side dispatch),
runs the op's JAX function on the wrapped arrays and wraps the results as
torchax tensors of the same environment. Nothing is copied, and because the
call is plain JAX it traces under ``torchax.interop.jax_jit`` and
differentiates under ``torchax.interop.jax_value_and_grad`` (the JAX ops'
own custom VJPs), which is torchax's functional training path.

Mixing a torchax tensor with an ordinary (CPU/CUDA) torch tensor in one
call is an error naming the argument: move it with ``t.to("jax")`` inside
the environment first.

Compatibility with torch 2.13
-----------------------------
torchax 0.0.13 (the newest release) names aten overloads of named-tensor
(``Dimname``) variants in its decomposition list and autocast table, e.g.
``torch.ops.aten.prod.dim_Dimname``; torch 2.13 removed them, so
``import torchax`` raises ``AttributeError`` at import. `install_compat`
fills each missing overload in with an inert placeholder (`RemovedOverload`)
before torchax is imported. The placeholders are only ever used by torchax as
dictionary keys: ``torch._decomp.get_decompositions`` skips anything that is
not an operator, and an autocast entry for an op torch can no longer dispatch
is never looked up. Overloads that torch still has are left untouched, so
the shim is a no-op on a torch that torchax supports. `import_torchax`
installs it and imports torchax; import stellax's module first::

    import stellax.torch.torchax as stx   # installs the shim, then imports torchax
    torchax = stx.import_torchax()
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Sequence

import jax
import torch

__all__ = ["MISSING_OVERLOADS", "RemovedOverload", "call", "import_torchax", "install_compat", "is_torchax_tensor",
           "jax_array"]

#: ``(op, overload)`` pairs torchax 0.0.13 refers to at import time that
#: torch 2.13 no longer has (named-tensor variants). Found by scanning
#: torchax's sources for ``aten.<op>.<overload>`` (the test does it again).
MISSING_OVERLOADS: tuple[tuple[str, str], ...] = (
    ("all", "dimname"), ("all", "dimname_out"),
    ("index_add", "dimname"),
    ("index_copy", "dimname"), ("index_copy_", "dimname"),
    ("index_fill", "Dimname_Scalar"), ("index_fill", "Dimname_Tensor"),
    ("index_fill_", "Dimname_Scalar"), ("index_fill_", "Dimname_Tensor"),
    ("norm", "names_ScalarOpt_dim"), ("norm", "names_ScalarOpt_dim_dtype"), ("norm", "names_dtype_out"),
    ("norm", "names_out"),
    ("prod", "dim_Dimname"),
    ("std", "correction_names"), ("std", "correction_names_out"), ("std", "names_dim"), ("std", "names_out"),
    ("std_mean", "correction_names"), ("std_mean", "names_dim"),
    ("unbind", "Dimname"),
)


class RemovedOverload:
    """Stands in for an aten overload the installed torch removed.

    Hashable and comparable by identity; not an operator, so torch's
    decomposition lookup ignores it and nothing can dispatch to it. Calling
    it raises, naming the overload.
    """

    def __init__(self, qualified_name: str):
        self.qualified_name = qualified_name

    def __repr__(self) -> str:
        return f"RemovedOverload({self.qualified_name})"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.qualified_name} does not exist in torch {torch.__version__}; it is a "
                           "placeholder stellax.torch.torchax installed so that torchax imports")


def install_compat(overloads: Sequence[tuple[str, str]] = MISSING_OVERLOADS) -> list[str]:
    """Give every ``torch.ops.aten.<op>.<overload>`` in ``overloads`` that the
    installed torch lacks a `RemovedOverload` placeholder.

    Idempotent. Returns the qualified names that were filled in (empty on a
    torch that still has them all).
    """
    filled = []
    for op_name, overload in overloads:
        packet = getattr(torch.ops.aten, op_name)
        try:
            getattr(packet, overload)
            continue
        except AttributeError:
            pass
        name = f"aten.{op_name}.{overload}"
        setattr(packet, overload, RemovedOverload(name))
        filled.append(name)
    return filled


def import_torchax():
    """Install the compatibility shim (`install_compat`) and import torchax.

    Raises:
      ImportError: with the install line, when torchax is not installed.
    """
    if "torchax" not in sys.modules:
        install_compat()
    try:
        module = importlib.import_module("torchax")
    except ImportError as e:
        raise ImportError("stellax.torch.torchax needs torchax: pip install 'stellax[torchax]' "
                          "(torchax==0.0.13)") from e
    _fix_device_module()
    return module


def _fix_device_module() -> None:
    """torchax registers itself as torch's ``privateuse1`` device with a
    ``set_rng_state(new_state, device)`` that requires ``device``; torch calls
    every device module's ``set_rng_state(state)`` when it restores RNG state
    (AOT dispatch, ``torch.random.fork_rng``), so after importing torchax every
    ``opcheck`` / ``torch.compile`` in the process failed. Its function does
    nothing; give ``device`` a default."""
    from torchax import device_module

    original = device_module.set_rng_state
    if getattr(original, "__stellax_fixed__", False):
        return

    def set_rng_state(new_state, device=None):
        return original(new_state, device)

    set_rng_state.__stellax_fixed__ = True
    device_module.set_rng_state = set_rng_state


def _classes():
    """torchax's tensor and view classes, or ``()`` when torchax is not loaded."""
    if "torchax" not in sys.modules:
        return ()
    from torchax.tensor import Tensor
    from torchax.view import View
    return (Tensor, View)


def is_torchax_tensor(x: Any) -> bool:
    """Whether ``x`` is a torchax tensor (or a torchax view of one)."""
    classes = _classes()
    return bool(classes) and isinstance(x, classes)


def jax_array(x):
    """The ``jax.Array`` a torchax tensor wraps (a view is materialized by torchax); no copy."""
    return x.jax()


def _environment(tensors):
    for t in tensors:
        env = getattr(t, "_env", None)
        if env is not None:
            return env
    return importlib.import_module("torchax").default_env()


def call(op, flat: tuple):
    """Run the `TorchOp` ``op`` on torchax tensors: its JAX function on the
    wrapped arrays, the outputs wrapped as torchax tensors.

    ``flat`` is the custom op's flat argument list (`TorchOp.flatten`):
    ``op.n_tensors`` tensors (or None), then the options. Returns
    ``NotImplemented`` when no tensor is a torchax tensor (the caller then
    runs the custom op).

    Raises:
      TypeError: a torchax tensor mixed with an ordinary torch tensor, naming
        the argument and its device.
    """
    from .compiled import _cached  # the compiled-function cache the custom ops use

    tensors, opts = op._split(flat)
    if not any(is_torchax_tensor(t) for t in tensors):
        return NotImplemented
    for spec, t in zip(op.tensors, tensors):
        if isinstance(t, torch.Tensor) and not is_torchax_tensor(t):
            where = [s.name for s, u in zip(op.tensors, tensors) if is_torchax_tensor(u)]
            raise TypeError(
                f"stellax::{op.name}: argument {spec.name!r} is a torch tensor on {t.device}, while "
                f"{', '.join(repr(w) for w in where)} are torchax tensors; move it into the torchax environment "
                f"first (t.to('jax') inside `with torchax.default_env():`)")
    present = [i for i, t in enumerate(tensors) if t is not None]
    key = (op.name, "torchax", tuple(present), op._opts_key(opts))
    arrays = [jax_array(tensors[i]) for i in present]
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        # Inside a torchax jit: run in the caller's trace (in checked mode its checks are staged there, for
        # the caller's checkify, as in JAX).
        outs = _cached(key, lambda: op._maybe_jit(op._call_jax(present, opts)))(*arrays)
    else:  # concrete arrays: checked mode raises here, naming the argument, as the custom op does
        outs = op.run_jax(key, lambda: op._call_jax(present, opts), arrays)
    env = _environment(tensors)
    from torchax.tensor import Tensor
    result = [Tensor(o, env) for o in outs]
    return result[0] if op.outputs == 1 else tuple(result)
