"""Every stellax op call leaves its identity in the program it emits.

While a traced op call runs (inside `jax.jit`, `jax.grad`, ...), every XLA operation it emits carries
the frontend attribute
``stellax="v1.<payload>"`` (`jax.experimental.xla_metadata`): the payload is
base64url of zlib-compressed compact JSON

    {"op": "attention", "impl": "xla_chunked", "config": {...} | null,
     "arrays": [["query", [1, 128, 4, 64], "float32"], null, ...],
     "options": {"is_causal": true, "local_window_size": [null, null], ...}}

It survives lowering (StableHLO ``mhlo.frontend_attributes``), optimization
(HLO ``frontend_attributes={...}``, fusions included), XLA dumps and the HLO
protos a `jax.profiler` trace stores, so tools can rebuild each call without
the model's code (`stellax autotune --from-hlo / --from-trace`). Base64 keeps
the value free of quotes and escapes in every text format; ``v1`` versions
the payload.

Option values round-trip through JSON: lists come back as tuples (checked
options are tuples); dtypes and stellax dataclasses (mask descriptions) are
tagged and rebuilt; a Python callable option keeps only its name (such a call
can be named, not re-run).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import importlib
import json
import re
import zlib
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata

from .call import Call, signature_from_json, signature_to_json

ATTRIBUTE = "stellax"
VERSION = "v1"
_VALUE = re.compile(r"stellax\s*=\s*\"(v\d+)\.([A-Za-z0-9_\-]+=*)\"")


class MetadataError(ValueError):
    """An annotation that cannot be decoded (unknown version or corrupt payload)."""


def _encode_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_encode_value(v) for v in value]
    if isinstance(value, Mapping):
        return {"__dict__": [[str(k), _encode_value(v)] for k, v in value.items()]}
    if isinstance(value, (np.dtype, type)) and _is_dtype(value):
        return {"__dtype__": np.dtype(value).name}
    if isinstance(value, jax.lax.Precision):
        return {"__precision__": value.name}
    if dataclasses.is_dataclass(value) and type(value).__module__.startswith("stellax."):
        fields = {f.name: _encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__dataclass__": f"{type(value).__module__}:{type(value).__qualname__}", "fields": fields}
    if callable(value):
        return {"__callable__": getattr(value, "__qualname__", repr(value))}
    return {"__repr__": repr(value)}


def _is_dtype(value) -> bool:
    try:
        np.dtype(value)
    except TypeError:
        return False
    return True


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode_value(v) for v in value)
    if isinstance(value, dict):
        if "__dict__" in value:
            return {k: _decode_value(v) for k, v in value["__dict__"]}
        if "__dtype__" in value:
            return np.dtype(value["__dtype__"])
        if "__precision__" in value:
            return jax.lax.Precision[value["__precision__"]]
        if "__dataclass__" in value:
            return _dataclass(value["__dataclass__"], value["fields"])
        return OpaqueOption(value.get("__callable__") or value.get("__repr__", "?"))
    return value


def _dataclass(path: str, fields: dict):
    """A stellax dataclass option (a mask description, ...) rebuilt from its module path and fields."""
    module_name, _, qualname = path.partition(":")
    if not module_name.startswith("stellax."):
        raise MetadataError(f"stellax annotation: option class {path!r} is not a stellax class")
    cls = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls(**{k: _decode_value(v) for k, v in fields.items()})


@dataclasses.dataclass(frozen=True)
class OpaqueOption:
    """An option that was a Python callable (or another object JSON cannot hold): only its name survives."""

    name: str


def encode_call(op_name: str, implementation: str, config: Any, call: Call) -> str:
    """The annotation value for one op call (see the module docstring)."""
    arrays = [None if v is None else [k, [int(d) for d in v.shape], np.dtype(v.dtype).name]
              for k, v in call.arrays.items()]
    names = [k for k in call.arrays]
    payload = {
        "op": op_name, "impl": implementation, "signature": signature_to_json(call.signature()),
        "config": None if config is None else _encode_value(config.to_dict()),
        "arrays": arrays, "names": names,
        "options": {k: _encode_value(v) for k, v in call.options.items()},
    }
    text = json.dumps(payload, separators=(",", ":"), sort_keys=True)
    return f"{VERSION}.{base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()}"


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One stellax op call rebuilt from its annotation.

    Attributes:
      op, implementation: the op and implementation names.
      config: the config as a dict (``None`` for implementations without one).
      arrays: name → `jax.ShapeDtypeStruct` (``None`` for absent operands), in the op's order.
      options: the checked static options.
      signature: the call's `Call.signature()` as cache keys hold it (values JSON cannot hold as their repr).
    """

    op: str
    implementation: str
    config: dict | None
    arrays: dict
    options: dict
    signature: tuple

    def call(self) -> Call:
        """The abstract `Call` (arrays as shape structs)."""
        return Call(dict(self.arrays), dict(self.options))

    @property
    def rebuildable(self) -> str | None:
        """Why this call cannot be re-run (an opaque option), or ``None``."""
        opaque = [k for k, v in self.options.items() if _holds_opaque(v)]
        return f"option(s) {opaque} were Python objects; only their names are known" if opaque else None

    def describe(self) -> str:
        return f"{self.op}/{self.implementation} {self.call().describe()}"


def _holds_opaque(value) -> bool:
    if isinstance(value, OpaqueOption):
        return True
    if isinstance(value, tuple):
        return any(_holds_opaque(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_opaque(v) for v in value.values())
    return False


def decode_call(value: str) -> CallRecord:
    """A `CallRecord` from an annotation value ``v1.<payload>``."""
    version, _, payload = value.partition(".")
    if version != VERSION:
        raise MetadataError(f"stellax annotation: expected version {VERSION!r}, got {version!r} "
                            f"(written by another stellax version?)")
    try:
        data = json.loads(zlib.decompress(base64.urlsafe_b64decode(payload.encode())).decode())
        arrays = {}
        for name, entry in zip(data["names"], data["arrays"]):
            arrays[name] = None if entry is None else jax.ShapeDtypeStruct(tuple(entry[1]), np.dtype(entry[2]))
        options = {k: _decode_value(v) for k, v in data["options"].items()}
        config = data["config"]
        if config is not None:
            config = {k: _decode_value(v) for k, v in config.items()}
        return CallRecord(data["op"], data["impl"], config, arrays, options,
                          signature_from_json(data["signature"]))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, ImportError, zlib.error) as e:
        raise MetadataError(f"stellax annotation: corrupt payload ({type(e).__name__}: {e})") from None


def annotate(op_name: str, implementation: str, config: Any, call: Call):
    """Context manager: operations emitted inside carry this call's annotation.

    Only a traced call (some operand is a tracer: inside `jax.jit`, `jax.grad`, ...) is annotated:
    that is where a program exists to carry it. An eager call runs each operation as its own tiny
    program, and the annotation would only make JAX recompile them per call (measured: eager
    `layer_norm` calls ~1.6× slower)."""
    if not any(isinstance(v, jax.core.Tracer) for v in call.arrays.values()):
        return contextlib.nullcontext()
    return set_xla_metadata(**{ATTRIBUTE: encode_call(op_name, implementation, config, call)})


def annotations_in_text(text: str) -> list[str]:
    """Distinct annotation values in an HLO / StableHLO text, in order of appearance."""
    seen: dict[str, None] = {}
    for match in _VALUE.finditer(text):
        seen.setdefault(f"{match.group(1)}.{match.group(2)}")
    return list(seen)


def calls_in_text(text: str) -> list[CallRecord]:
    """The stellax calls of a program from its HLO or StableHLO text (distinct, in order)."""
    return [decode_call(v) for v in annotations_in_text(text)]


def distinct(records: Iterable[CallRecord]) -> list[CallRecord]:
    """Records deduplicated by (op, implementation, call signature), first occurrence kept."""
    seen: dict[tuple, CallRecord] = {}
    for r in records:
        seen.setdefault((r.op, r.implementation, r.signature), r)
    return list(seen.values())
