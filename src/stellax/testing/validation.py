"""Validate an op's implementations against its golden on built-in examples
(what `stellax check` runs, and what op tests can reuse)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import inspect
import threading
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.extend  # noqa: F401  (jax.extend.core in _evaluate_only; `import jax` does not load it)
import jax.numpy as jnp
import numpy as np

from ..core import Example, Op, current_platform, interpret_enabled, interpret_mode, use_configs
from .numerics import ErrorSummary, compare, contract_tolerance, golden, random_array, upcast


@dataclasses.dataclass(frozen=True)
class CheckResult:
    op: str
    implementation: str
    dtype: str
    example: str
    passed: bool
    worst: ErrorSummary | None
    detail: str = ""
    skipped: str = ""


@functools.lru_cache(maxsize=None)
def examples_of(op: Op, dtype_name: str) -> tuple[Example, ...]:
    """``op.examples(dtype)``, built once per op and dtype name in a process, by one
    compiled program (`compiled_examples`)."""
    return tuple(compiled_examples(lambda: op.examples(jnp.dtype(dtype_name))))


def compiled_examples(make: Callable[[], list[Example]], count: int | None = None) -> list[Example]:
    """``make()``'s examples (its first ``count``) with every array computed by one compiled
    program: ``make`` is traced once (`jax.make_jaxpr`) and the trace run under `jax.jit`.
    With ``count``, only those examples' arrays are computed (dead-code elimination drops the
    rest: an op's later benchmark shapes can be far larger than its first).

    Run eagerly, a builder dispatches its random numbers and reference outputs op
    by op, each a program compiled on first use: `attention_backward`'s two
    examples compiled 130 of them (35 s of a loaded 2-core CPU), and on a TPU the
    memory sampled during a quick check peaked while the examples were built. Same values as
    eagerly for the random numbers (the same threefry bits); derived values (a
    reference output an example carries) up to XLA's fusion. A builder that needs
    concrete values (``np.asarray``, ``int(...)`` of an array it made) is built eagerly."""
    trace = _trace_examples(make, lambda x: True, count)
    if trace is None:
        return list(make())[:count]
    box, values = trace

    def settle(x):
        return values[id(x)] if isinstance(x, jax.core.Tracer) else x

    return [Example(e.label, *jax.tree_util.tree_map(settle, (e.args, e.kwargs))) for e in box[:count]]


def _trace_examples(make: Callable[[], list[Example]], wanted: Callable,
                    count: int | None = None) -> tuple[list[Example], dict[int, Any]] | None:
    """``make()`` traced once (`jax.make_jaxpr`): its examples (arrays as tracers) and the values
    of the traced arrays that ``wanted`` picks in its first ``count`` examples, by the tracer's
    ``id``, computed by one compiled program of only what they depend on (`_evaluate_only`); an
    array that several examples share is computed once. None for a builder that needs concrete
    values (``np.asarray``, ``int(...)``)."""
    box: list[Example] = []
    picked: dict[int, Any] = {}

    def build():
        box[:] = make()
        picked.clear()
        for x in _leaves(box[:count]):
            if isinstance(x, jax.core.Tracer) and wanted(x):
                picked.setdefault(id(x), x)
        return list(picked.values())

    try:
        values = _evaluate_only(jax.make_jaxpr(build)())
    except jax.errors.JAXTypeError:
        return None
    return box, dict(zip(picked, values))


def abstract_examples(make: Callable[[], list[Example]]) -> list[Example]:
    """``make()``'s examples with their float arrays, and their 1-byte integer
    arrays (quantized payloads: int8 values, packed fp4 / fp8 codes), as
    `jax.ShapeDtypeStruct`s; the other integer and boolean operands (group sizes,
    ``cu_seqlens``, block tables, masks: what checks read) concrete.

    ``make`` is traced once (`jax.make_jaxpr`); the trace is cut down to what
    those concrete operands depend on (dead-code elimination drops the random
    numbers of the float arrays, and any kernel that quantizes them) and that
    part is compiled and run. So a 16k-token benchmark call costs a small
    compile, not gigabytes of random numbers computed in the background (which
    also stalled every later computation of the process). A builder that needs
    concrete values (``np.asarray`` of an array it made) is built for real."""
    trace = _trace_examples(make, _is_metadata)
    if trace is None:  # a builder that needs concrete values: build it for real
        return [Example(e.label, _abstract_floats(e.args), _abstract_floats(e.kwargs)) for e in make()]
    box, metadata = trace

    def settle(x):
        traced = isinstance(x, jax.core.Tracer)
        if traced and _is_metadata(x):
            return metadata[id(x)]
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if traced or _is_float(x) else x

    return [Example(e.label, *jax.tree_util.tree_map(settle, (e.args, e.kwargs))) for e in box]


def _evaluate_only(closed) -> list:
    """The outputs of a traced program (`jax.make_jaxpr`), computing only the
    equations they depend on."""
    from jax._src.interpreters import partial_eval as pe  # dead-code elimination of a jaxpr

    if not closed.jaxpr.outvars:
        return []
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)  # constants become leading inputs
    needed, used_inputs = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    consts = [c for c, used in zip(closed.consts, used_inputs) if used]
    return jax.jit(jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(needed, ())))(*consts)


def _leaves(examples) -> list:
    return jax.tree_util.tree_leaves([(e.args, e.kwargs) for e in examples])


def _is_metadata(x) -> bool:
    """An integer or boolean array that is not a 1-byte quantized payload."""
    return not _is_float(x) and (x.dtype == jnp.bool_ or jnp.dtype(x.dtype).itemsize > 1)


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _abstract_floats(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_float(x) else x, tree)


@functools.lru_cache(maxsize=None)
def abstract_examples_of(op: Op, dtype_name: str) -> tuple[Example, ...]:
    """`examples_of` with float arrays as `jax.ShapeDtypeStruct`s (`abstract_examples`):
    what deciding which cases exist needs (checks, support, configs, lowering), built
    without compiling a random-number program (test collection builds every op's)."""
    return tuple(abstract_examples(lambda: op.examples(jnp.dtype(dtype_name))))


def _is_float_tree(a) -> bool:
    leaves = jax.tree_util.tree_leaves(a)
    return bool(leaves) and all(hasattr(l, "dtype") and jnp.issubdtype(l.dtype, jnp.floating) for l in leaves)


def _float_positions(args) -> list[int]:
    """Positions of arguments that are float arrays or pytrees of them."""
    return [i for i, a in enumerate(args) if a is not None and _is_float_tree(a)]


def _grad_positions(op: Op, example: Example) -> list[int]:
    """Positional float args named in ``op.differentiable`` (by the Call's order)."""
    if not op.differentiable:
        return []
    names = list(op.check(*example.args, **example.kwargs).arrays)
    return [i for i in _float_positions(example.args)
            if i < len(names) and names[i] in op.differentiable]


def projected_loss(fn, args, kwargs, positions, cotangents):
    """``loss(*diff) = Σ_i <fn(args with args[positions] = diff)_i, cotangents_i>`` (float32): a random
    projection of every output, whose gradient checks every input's VJP at once."""
    def loss(*diff):
        full = list(args)
        for i, d in zip(positions, diff):
            full[i] = d
        leaves = jax.tree_util.tree_leaves(fn(*full, **kwargs))
        return sum(jnp.sum(l.astype(jnp.float32) * c) for l, c in zip(leaves, cotangents))
    return loss


def _tolerance_dtype(dtype, out):
    """The dtype whose tolerance an output leaf is held to: the example's, or the
    output's own where that is coarser (an op that returns bfloat16 from float32
    inputs, e.g. fp8 attention's default output, cannot meet float32's)."""
    if jnp.issubdtype(out.dtype, jnp.floating) and jnp.finfo(out.dtype).eps > jnp.finfo(dtype).eps:
        return out.dtype
    return dtype


def takes_precision(op: Op) -> bool:
    """Whether ``op`` has a ``precision`` argument (it contracts: `stellax.core.precision`)."""
    try:
        return "precision" in inspect.signature(op.check).parameters
    except (TypeError, ValueError):
        return False


class GoldenCache:
    """The golden outputs and gradients of recently checked examples, shared by
    every implementation checked on them.

    `stellax check` runs each example once per implementation (``mosaic_tpu``,
    ``xla``, ``xla_chunked``, ...) and the golden is the same for all of them;
    compiling and running it is a quarter to a third of a check's time. An entry
    is keyed on the op, the dtype, the example's label, its static arguments
    and the bytes of every array it passes (and of the gradients' cotangents),
    so a changed example is a miss, never a stale hit. Examples whose arrays
    exceed ``max_bytes`` (benchmark shapes) are not kept."""

    def __init__(self, entries: int = 128, max_bytes: int = 1 << 24):
        self.entries, self.max_bytes = entries, max_bytes
        self.hits = self.misses = 0
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def key(self, *parts) -> str | None:
        """A digest of ``parts`` (arrays by dtype, shape and bytes; anything else
        by its repr), or None when their arrays are too large to keep."""
        leaves, structure = jax.tree_util.tree_flatten(parts)
        digest, size = hashlib.sha256(str(structure).encode()), 0
        for leaf in leaves:
            if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
                data = np.asarray(leaf)
                size += data.nbytes
                if size > self.max_bytes:
                    return None
                digest.update(f"{data.dtype}{data.shape}".encode())
                digest.update(np.ascontiguousarray(data).tobytes())
            else:
                digest.update(repr(leaf).encode())
        return digest.hexdigest()

    def get(self, key: str | None, compute: Callable[[], Any]) -> Any:
        """The cached value of ``key``, else ``compute()`` (kept unless ``key`` is None)."""
        if key is None:
            return compute()
        with self._lock:
            if key in self._items:
                self.hits += 1
                self._items.move_to_end(key)
                return self._items[key]
        value = jax.block_until_ready(compute())
        with self._lock:
            self.misses += 1
            self._items[key] = value
            while len(self._items) > self.entries:
                self._items.popitem(last=False)
        return value


#: The goldens `check_example` shares across implementations.
GOLDENS = GoldenCache()


def check_example(op: Op, implementation: str, example: Example, dtype, *, gradients: bool = True,
                  config: Any = None, precision: str | None = "highest") -> CheckResult:
    """Run one example with one implementation and compare (forward and, for
    differentiable ops, the gradients of a random projection of the output).

    ``precision`` is passed to ops that contract (`takes_precision`) and sets the
    float32 tolerance (`stellax.testing.numerics.contract_tolerance`): the
    default ``"highest"`` holds float32 results to 1e-5 of the golden on every
    device, a TPU included; ``None`` leaves the op's own default and the float32
    tolerance. The golden is always float32 at ``HIGHEST``.

    ``config`` pins the implementation's kernel config (default: the one
    dispatch resolves, the heuristic unless a cache or context says otherwise);
    the backward op, when there is one, resolves its own."""
    if config is not None:
        with use_configs({(op.name, implementation): config}):
            return check_example(op, implementation, example, dtype, gradients=gradients, precision=precision)
    dtype_name = np.dtype(dtype).name
    contract = {"precision": precision} if precision is not None and takes_precision(op) else {}
    example = Example(example.label, example.args, {**example.kwargs, **contract})  # the check's precision wins
    call = op.check(*example.args, **example.kwargs)
    impl = op.implementations[implementation]
    support = impl.supported(call)
    if not support:
        return CheckResult(op.name, implementation, dtype_name, example.label, True, None,
                           skipped=support.reason)

    array_kwargs = {k: v for k, v in example.kwargs.items() if hasattr(v, "dtype")}
    static_kwargs = {k: v for k, v in example.kwargs.items() if k not in array_kwargs}

    def run(*args, **kw):
        return op(*args, implementation=implementation, **kw, **static_kwargs)

    def ref(*args, **kw):
        return op.reference(*args, **kw, **{k: v for k, v in static_kwargs.items() if k not in contract})

    def tolerance_of(leaf_dtype, gradient=False):
        return contract_tolerance(leaf_dtype, contract.get("precision"), gradient=gradient)

    out = jax.jit(run)(*example.args, **array_kwargs)
    identity = (op.name, dtype_name, example.label, sorted(static_kwargs.items(), key=lambda kv: kv[0]))
    expected = GOLDENS.get(GOLDENS.key("forward", identity, example.args, array_kwargs),
                           lambda: golden(jax.jit(ref), *example.args, **array_kwargs))
    worst = None
    out_leaves = jax.tree_util.tree_leaves(out)
    ref_leaves = jax.tree_util.tree_leaves(expected)
    if len(out_leaves) != len(ref_leaves):
        return CheckResult(op.name, implementation, dtype_name, example.label, False, None,
                           detail=f"{len(out_leaves)} outputs vs {len(ref_leaves)} in the reference")
    summaries = [compare(o, r, dtype=_tolerance_dtype(dtype, o),
                         rel_l2_tolerance=tolerance_of(_tolerance_dtype(dtype, o)))
                 for o, r in zip(out_leaves, ref_leaves)]
    again = jax.tree_util.tree_leaves(jax.jit(run)(*example.args, **array_kwargs))
    deterministic = all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(out_leaves, again))
    positions = _grad_positions(op, example) if gradients else []
    if positions:
        keys = jax.random.split(jax.random.PRNGKey(7), len(out_leaves))
        cots = [random_array(k, l.shape, jnp.float32) for k, l in zip(keys, out_leaves)]
        diff_args = [example.args[i] for i in positions]
        grads = jax.jit(jax.grad(projected_loss(run, example.args, array_kwargs, positions, cots),
                                 argnums=tuple(range(len(positions)))))(*diff_args)
        ref_args, ref_kwargs = upcast(list(example.args)), upcast(array_kwargs)
        ref_grads = GOLDENS.get(
            GOLDENS.key("gradients", identity, positions, example.args, array_kwargs, cots),
            lambda: golden(jax.jit(jax.grad(projected_loss(ref, ref_args, ref_kwargs, positions, cots),
                                            argnums=tuple(range(len(positions))))), *diff_args))
        summaries += [compare(g, r, dtype=dtype, gradient=True, rel_l2_tolerance=tolerance_of(dtype, gradient=True))
                      for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads))]
    worst = max(summaries, key=lambda s: (not s.passed, s.rel_l2 / max(s.tolerance, 1e-30)))
    passed = all(s.passed for s in summaries) and deterministic
    detail = "" if deterministic else "non-deterministic: two runs differ"
    return CheckResult(op.name, implementation, dtype_name, example.label, passed, worst, detail=detail)


def iter_checks(op: Op, *, implementations: Iterable[str] | None = None,
                dtypes: Iterable = (jnp.float32, jnp.bfloat16), gradients: bool = True,
                examples: int | None = None) -> Iterator[CheckResult]:
    """Check every (implementation, dtype, example) of ``op`` on this device,
    yielding each result as it finishes (``examples``: only the first that
    many examples of each dtype).

    On a CPU, kernel implementations run interpreted (interpret mode is
    switched on for them). A crash is a failed result carrying its message."""
    names = list(implementations) if implementations is not None else list(op.implementations)
    on_cpu = current_platform().backend == "cpu"
    for name in names:
        kernel = op.implementations[name].is_kernel
        for dtype in dtypes:
            interpret = interpret_enabled() or (on_cpu and kernel)
            for example in op.examples(dtype)[:examples]:
                # The switch is set per example, not across a yield: the caller's code runs between rows.
                with interpret_mode(interpret):
                    result = safe_check_example(op, name, example, dtype, gradients=gradients)
                yield result


def safe_check_example(op: Op, implementation: str, example: Example, dtype, *, gradients: bool = True,
                       precision: str | None = "highest") -> CheckResult:
    """`check_example`, with a crash turned into a failed result carrying its message."""
    try:
        return check_example(op, implementation, example, dtype, gradients=gradients, precision=precision)
    except Exception as e:  # a crash is a failure, reported with its message
        return CheckResult(op.name, implementation, np.dtype(dtype).name, example.label, False, None,
                           detail=f"{type(e).__name__}: {e}"[:300])


def check_op(op: Op, *, implementations: Iterable[str] | None = None,
             dtypes: Iterable = (jnp.float32, jnp.bfloat16), gradients: bool = True) -> list[CheckResult]:
    """Check every (implementation, dtype, example) of ``op`` on this device
    (`iter_checks`, collected)."""
    return list(iter_checks(op, implementations=implementations, dtypes=dtypes, gradients=gradients))
