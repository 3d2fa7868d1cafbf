"""Backend tables: one row per backend of an op family, the implementations generated from it.

A family declares its backends once::

    BACKENDS = BackendTable("norm", [
        Backend("mosaic_tpu", mosaic_tpu, "mosaic_tpu", Tuning(NormTpuConfig, tpu_heuristic, tpu_space, tpu_req)),
        Backend("triton", triton, "triton", Tuning(NormConfig, heuristic, space, requirements)),
        Backend("xla", xla),
    ])

and builds its ops' implementation lists from it with one run function per op, which takes the row
(its ``kernels`` module and ``name``) as its first argument::

    layer_norm_op = BACKENDS.op("layer_norm", run_forward, check=..., reference=..., ...)
    layer_norm_backward_op = BACKENDS.op("layer_norm_backward", run_backward, backward=True, ...)

(`BackendTable.op` registers ``Op(name, family=..., implementations=BACKENDS.forward(run), ...)``).

A new backend is then a kernel module (``<backend>.py``, ``<backend>_backward.py``) with the entry
points the family's run functions call, plus one row. Lookups by implementation name (which kernels
a backward of a ring step uses, which module a quantized path takes) go through the same table,
``BACKENDS.kernels(name)``, never a chain of ``if name == ...``.

Differentiation goes through `core.vjp`: a run function wraps its kernel in a frozen rule object
whose ``backward`` calls the family's backward op with the implementation chain
`core.op.backward_implementation` gives, and `vjp.apply` (one ``jax.custom_vjp`` for every op) differentiates it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Mapping

from .call import Call
from .op import Implementation, Op, register


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How an implementation picks its config.

    Attributes:
      config_type: the frozen `KernelConfig` subclass (``None``: the implementation has no config).
      heuristic: ``heuristic(call) -> config``, the default config.
      space: ``space(call) -> list[config]``, the autotuning space.
      requirements: ``requirements(call) -> str | None``, why a call cannot run here (or ``None``).
      defers_to_xla: ``defers_to_xla(platform) -> str | None``, why ``implementation=None`` passes this
        kernel over on ``platform`` (measured slower than XLA there), or ``None``.
    """

    config_type: type | None = None
    heuristic: Callable[[Call], Any] | None = None
    space: Callable[[Call], list] | None = None
    requirements: Callable[[Call], str | None] | None = None
    defers_to_xla: Callable[[Any], str | None] | None = None


#: An implementation without a config (XLA paths).
UNTUNED = Tuning()


@dataclasses.dataclass(frozen=True)
class Backend:
    """One row of a family's backend table.

    Attributes:
      name: the implementation name users pass (``"mosaic_tpu"``, ``"triton"``, ``"xla"``, ...).
      kernels: the module (or any object) holding this backend's kernel entry points; the family's
        run functions receive the row and call ``row.kernels.<entry>``.
      backend: ``"xla"`` or a Pallas backend from `core.op.KERNEL_BACKENDS` (decides where it runs).
      tuning: config type, heuristic, space and requirements of the forward op(s).
      backward_tuning: the same for the backward op(s); ``None``: as ``tuning``.
      native: ``False``: ``implementation=None`` never picks it (only on request).
      backward: ``False``: the row has no backward implementation (its forward is differentiated by
        the backward op's default chain).
      writes_float8: see `Implementation.writes_float8`.
    """

    name: str
    kernels: Any
    backend: str = "xla"
    tuning: Tuning = UNTUNED
    backward_tuning: Tuning | None = None
    native: bool = True
    backward: bool = True
    writes_float8: Callable[[Call], bool] | None = None

    def implementation(self, run: Callable[..., Any], tuning: Tuning | None = None) -> Implementation:
        """The `Implementation` of this row whose ``run(call, config)`` is ``run(self, call, config)``."""
        tuning = tuning or self.tuning
        return Implementation(self.name, functools.partial(run, self), backend=self.backend,
                              config_type=tuning.config_type, heuristic=tuning.heuristic, space=tuning.space,
                              requirements=tuning.requirements, native=self.native,
                              writes_float8=self.writes_float8, defers_to_xla=tuning.defers_to_xla)


class BackendTable:
    """A family's backends in dispatch order (fastest first; ``xla`` is always present)."""

    def __init__(self, family: str, rows: Iterable[Backend]):
        self.family = family
        self.rows = tuple(rows)
        names = [row.name for row in self.rows]
        if "xla" not in names:
            raise ValueError(f"backend table {family!r}: every family needs an 'xla' row, got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"backend table {family!r}: duplicate backend names {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(row.name for row in self.rows)

    def __getitem__(self, name: str) -> Backend:
        for row in self.rows:
            if row.name == name:
                return row
        raise ValueError(f"{self.family}: no backend {name!r}; expected one of {list(self.names)}")

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def kernels(self, name: str) -> Any:
        """The kernel module of backend ``name``."""
        return self[name].kernels

    def forward(self, run: Callable[..., Any], *, only: Iterable[str] | None = None) -> list[Implementation]:
        """One forward `Implementation` per row (or per row named in ``only``), running
        ``run(row, call, config)``."""
        return [row.implementation(run) for row in self._rows(only)]

    def backward(self, run: Callable[..., Any], *, only: Iterable[str] | None = None) -> list[Implementation]:
        """One backward `Implementation` per row that has a backward, running ``run(row, call, config)``
        with the row's ``backward_tuning``."""
        return [row.implementation(run, row.backward_tuning or row.tuning) for row in self._rows(only)
                if row.backward]

    def op(self, name: str, run: Callable[..., Any], *, backward: bool = False, only: Iterable[str] | None = None,
           family: str | None = None, **fields: Any) -> Op:
        """The registered `Op` ``name`` whose implementations are this table's rows (those named in
        ``only``) running ``run(row, call, config)``: `forward` (`backward`, with the rows' backward
        tunings, when ``backward``). ``family``: the op's family (default: the table's); ``fields``:
        the other arguments of `Op` (``check``, ``reference``, cost models, examples, ...)."""
        implementations = self.backward(run, only=only) if backward else self.forward(run, only=only)
        return register(Op(name, family=family or self.family, implementations=implementations, **fields))

    def retuned(self, tunings: Mapping[str, Tuning], *, kernels: Mapping[str, Any] | None = None,
                writes_float8: Mapping[str, Callable[[Call], bool]] | None = None) -> "BackendTable":
        """The same backends, in order, for another op of the family: each row's forward tuning is
        ``tunings[name]`` (absent: `UNTUNED`), its kernel module ``kernels[name]`` and its
        ``writes_float8`` ``writes_float8[name]`` where those name it."""
        kernels, writes_float8 = kernels or {}, writes_float8 or {}
        return BackendTable(self.family, [
            dataclasses.replace(row, tuning=tunings.get(row.name, UNTUNED), kernels=kernels.get(row.name, row.kernels),
                                writes_float8=writes_float8.get(row.name, row.writes_float8))
            for row in self.rows])

    def _rows(self, only: Iterable[str] | None) -> tuple[Backend, ...]:
        if only is None:
            return self.rows
        wanted = tuple(only)
        return tuple(self[name] for name in wanted)
