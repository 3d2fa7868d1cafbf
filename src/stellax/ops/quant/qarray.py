"""`QArray`: a quantized array (a registered JAX pytree).

Layout (what a kernel reads):

* ``values``: the element codes. 8-bit formats keep the logical ``shape``
  (``int8`` codes, or ``float8_e4m3fn`` / ``float8_e5m2``). 4-bit formats
  (``int4``, ``int4_asym``, ``mxfp4``, ``nvfp4``) are ``uint8`` with two codes
  per byte along ``axis`` (low nibble = even index), so ``values.shape[axis]
  == ceil(shape[axis] / 2)``.
* ``scales``: one scale per block, shape ``ceil(shape / block_shape)``
  elementwise: the scale of element ``idx`` is ``scales[idx // block_shape]``
  (``//`` per dimension). dtype float32 (or the ``scale_dtype`` asked for),
  ``float8_e8m0fnu`` for MX formats, ``float8_e4m3fn`` for NVFP4.
* ``zero_points``: ``int8`` with the shape of ``scales`` (asymmetric formats)
  or ``None``.
* ``tensor_scale``: a float32 scalar (NVFP4) or ``None``.

The value of an element is ``(code - zero_point) * scale * tensor_scale``
(in float32; absent terms drop out). A trailing partial block (an axis length
that the block does not divide) is quantized as if zero-padded; ``values``
are not padded beyond the nibble pair.

Static (aux) data: ``format`` (name), ``shape`` (logical), ``block_shape``,
``axis`` (the quantized axis: 4-bit packing runs along it and the default
1-D blocks lie along it) and ``rotation`` (the Hadamard block size applied
along ``axis`` before quantizing, or ``None``; see `hadamard_transform`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, registered_ops
from ...core.pallas import cdiv, nbytes
from .formats import Format, get_format


def scale_shape(shape, block_shape) -> tuple[int, ...]:
    """Shape of the per-block scales: ``ceil(shape / block_shape)`` per dimension."""
    return tuple(cdiv(int(s), int(b)) for s, b in zip(shape, block_shape))


def packed_shape(shape, axis: int, packed: bool) -> tuple[int, ...]:
    """Shape of ``values``: ``shape`` with ``axis`` halved (rounded up) when 4-bit codes are packed."""
    if not packed:
        return tuple(shape)
    out = list(shape)
    out[axis] = cdiv(out[axis], 2)
    return tuple(out)


_FLOAT_VALUE_DTYPES = (jnp.float32,)  # decoded elements (exact for 8-bit float formats)


@jax.tree_util.register_pytree_node_class
class QArray:
    """A quantized array; see the module docstring for the layout.

    Construct with `stellax.quantize`, or by hand (validated): wrong shapes
    and dtypes raise ``ValueError``/``TypeError`` naming the field.
    """

    __slots__ = ("values", "scales", "zero_points", "tensor_scale", "format", "shape", "block_shape",
                 "axis", "rotation")

    def __init__(self, values, scales, zero_points=None, tensor_scale=None, *, format: str,
                 shape, block_shape, axis: int, rotation: int | None = None, _validate: bool = True):
        fmt = get_format(format)
        self.values = values
        self.scales = scales
        self.zero_points = zero_points
        self.tensor_scale = tensor_scale
        self.format = fmt.name
        self.shape = tuple(int(s) for s in shape)
        self.block_shape = tuple(int(b) for b in block_shape)
        self.axis = int(axis)
        self.rotation = None if rotation is None else int(rotation)
        if _validate:
            self.validate()

    # -- pytree ------------------------------------------------------------
    def tree_flatten(self):
        children = (self.values, self.scales, self.zero_points, self.tensor_scale)
        aux = (self.format, self.shape, self.block_shape, self.axis, self.rotation)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        fmt, shape, block_shape, axis, rotation = aux
        return cls(*children, format=fmt, shape=shape, block_shape=block_shape, axis=axis,
                   rotation=rotation, _validate=False)

    # -- properties --------------------------------------------------------
    @property
    def spec(self) -> Format:
        return get_format(self.format)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        """The storage dtype of ``values`` (for summaries; not a float dtype)."""
        return self.values.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return sum(nbytes(a) for a in (self.values, self.scales, self.zero_points, self.tensor_scale))

    def __repr__(self) -> str:
        return (f"QArray(format={self.format!r}, shape={self.shape}, block_shape={self.block_shape}, "
                f"axis={self.axis}, values={np.dtype(self.values.dtype).name}{tuple(self.values.shape)}, "
                f"scales={np.dtype(self.scales.dtype).name}{tuple(self.scales.shape)}"
                + (", zero_points" if self.zero_points is not None else "")
                + (", tensor_scale" if self.tensor_scale is not None else "")
                + (f", rotation={self.rotation}" if self.rotation else "") + ")")

    def dequantize(self, dtype=jnp.float32):
        """`stellax.dequantize` of this array: ``(code - zero_point) * scale * tensor_scale`` in ``dtype``."""
        arrays, options = qarray_fields(self)
        return registered_ops()["dequantize"](*arrays.values(), **options, dtype=np.dtype(dtype).name)

    # -- validation --------------------------------------------------------
    def validate(self) -> None:
        fmt = self.spec
        ndim = len(self.shape)
        if ndim < 1:
            raise ValueError(f"QArray.shape: expected rank >= 1, got {self.shape}")
        if any(s < 1 for s in self.shape):
            raise ValueError(f"QArray.shape: expected positive sizes, got {self.shape}")
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"QArray.axis: expected an axis in [{-ndim}, {ndim}), got {self.axis}")
        self.axis = self.axis % ndim
        if len(self.block_shape) != ndim or any(b < 1 for b in self.block_shape):
            raise ValueError(f"QArray.block_shape: expected {ndim} positive sizes (one per dimension of "
                             f"shape {self.shape}), got {self.block_shape}")
        if any(b > s for b, s in zip(self.block_shape, self.shape)):
            raise ValueError(f"QArray.block_shape: expected each block size <= the dimension "
                             f"({self.shape}), got {self.block_shape}")
        for name in ("values", "scales"):
            value = getattr(self, name)
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise TypeError(f"QArray.{name}: expected an array, got {type(value).__name__}")
        want = packed_shape(self.shape, self.axis, fmt.packed)
        if tuple(self.values.shape) != want:
            what = " (4-bit codes packed two per byte along axis)" if fmt.packed else ""
            raise ValueError(f"QArray.values: expected shape {want}{what} for format {fmt.name} and "
                             f"shape {self.shape}, got {tuple(self.values.shape)}")
        value_dtypes = [np.dtype(fmt.storage_dtype)]
        if fmt.element.kind == "float" and not fmt.packed:
            value_dtypes.append(np.dtype(jnp.float32))
        if np.dtype(self.values.dtype) not in value_dtypes:
            raise TypeError(f"QArray.values: expected dtype {value_dtypes[0].name} for format {fmt.name}, "
                            f"got {np.dtype(self.values.dtype).name}")
        want_scales = scale_shape(self.shape, self.block_shape)
        if tuple(self.scales.shape) != want_scales:
            raise ValueError(f"QArray.scales: expected shape {want_scales} (ceil(shape / block_shape) = "
                             f"ceil({self.shape} / {self.block_shape})), got {tuple(self.scales.shape)}")
        sdt = np.dtype(self.scales.dtype)
        if fmt.scale == "float":
            allowed = [np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e8m0fnu)]
        else:
            allowed = [np.dtype(fmt.scale_storage_dtype), np.dtype(jnp.float32)]
        if sdt not in allowed:
            raise TypeError(f"QArray.scales: expected dtype in {[d.name for d in allowed]} for format "
                            f"{fmt.name}, got {sdt.name}")
        if fmt.zero_point:
            if self.zero_points is None:
                raise ValueError(f"QArray.zero_points: format {fmt.name} needs zero points (shape {want_scales})")
            if tuple(self.zero_points.shape) != want_scales:
                raise ValueError(f"QArray.zero_points: expected shape {want_scales} (the shape of scales), "
                                 f"got {tuple(self.zero_points.shape)}")
            if np.dtype(self.zero_points.dtype) not in (np.dtype(np.int8), np.dtype(np.int32)):
                raise TypeError(f"QArray.zero_points: expected dtype int8, got {np.dtype(self.zero_points.dtype).name}")
        elif self.zero_points is not None:
            raise ValueError(f"QArray.zero_points: format {fmt.name} is symmetric and takes no zero points")
        if fmt.tensor_scale:
            if self.tensor_scale is None:
                raise ValueError(f"QArray.tensor_scale: format {fmt.name} needs a float32 per-tensor scale")
            if tuple(self.tensor_scale.shape) != ():
                raise ValueError(f"QArray.tensor_scale: expected a scalar (shape ()), got {tuple(self.tensor_scale.shape)}")
            if np.dtype(self.tensor_scale.dtype) != np.dtype(jnp.float32):
                raise TypeError(f"QArray.tensor_scale: expected float32, got {np.dtype(self.tensor_scale.dtype).name}")
        elif self.tensor_scale is not None:
            raise ValueError(f"QArray.tensor_scale: format {fmt.name} takes no per-tensor scale")
        if fmt.blocks is not None:
            block = self.block_along_axis()
            ok = any(_block_matches(self, b) for b in fmt.blocks)
            if not ok:
                raise ValueError(f"QArray.block_shape: format {fmt.name} needs blocks of {list(fmt.blocks)} "
                                 f"along axis {self.axis}, got {self.block_shape} (axis block {block})")

    def block_along_axis(self) -> int:
        return self.block_shape[self.axis]

    def with_rotation(self, rotation):
        return QArray(self.values, self.scales, self.zero_points, self.tensor_scale, format=self.format,
                      shape=self.shape, block_shape=self.block_shape, axis=self.axis, rotation=rotation,
                      _validate=False)


def _block_matches(q: QArray, b: Any) -> bool:
    """Does ``q.block_shape`` realize the format block ``b`` (int: 1-D along
    the axis; tuple: 2-D over the last two dimensions)?"""
    ndim = len(q.shape)
    if isinstance(b, int):
        want = [1] * ndim
        want[q.axis] = min(b, q.shape[q.axis])
        return list(q.block_shape) == want
    if ndim < 2 or q.axis < ndim - 2:
        return False
    want = [1] * (ndim - 2) + [min(b[0], q.shape[-2]), min(b[1], q.shape[-1])]
    return list(q.block_shape) == want


def is_qarray(x) -> bool:
    return isinstance(x, QArray)


def qarray_fields(q: QArray, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``q`` as named `Call` entries ``(arrays, options)``.

    Arrays (in this order): ``{prefix}values``, ``{prefix}scales``,
    ``{prefix}zero_points``, ``{prefix}tensor_scale`` (``None`` when absent);
    options: ``{prefix}format``, ``{prefix}shape``, ``{prefix}block_shape``,
    ``{prefix}axis``, ``{prefix}rotation``. `qarray_from_call` is the inverse.
    """
    arrays = {prefix + "values": q.values, prefix + "scales": q.scales, prefix + "zero_points": q.zero_points,
              prefix + "tensor_scale": q.tensor_scale}
    options = {prefix + "format": q.format, prefix + "shape": q.shape, prefix + "block_shape": q.block_shape,
               prefix + "axis": q.axis, prefix + "rotation": q.rotation}
    return arrays, options


def qarray_from_call(call: Call, prefix: str = "") -> QArray:
    """The `QArray` whose fields `qarray_fields` put into ``call`` under ``prefix`` (not re-validated)."""
    a, o = call.arrays, call.options
    return QArray(a[prefix + "values"], a[prefix + "scales"], a[prefix + "zero_points"], a[prefix + "tensor_scale"],
                  format=o[prefix + "format"], shape=o[prefix + "shape"], block_shape=o[prefix + "block_shape"],
                  axis=o[prefix + "axis"], rotation=o.get(prefix + "rotation"), _validate=False)
