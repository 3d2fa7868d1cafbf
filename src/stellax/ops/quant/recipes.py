"""Low-precision training recipes: which format, block and rounding each
operand of a linear layer's three GEMMs uses (see `training.quantized_linear`).

A linear layer ``y = x · w`` (``x [M, K]`` tokens × features, ``w [K, N]``)
runs three GEMMs per training step, each on quantized operands:

=========  ===============  ===========================================
GEMM       product          quantized along (the contraction axis)
=========  ===============  ===========================================
forward    ``y  = x · w``    ``x``: K (rows of 1×b), ``w``: K
dgrad      ``dx = dy · wᵀ``  ``dy``: N, ``wᵀ``: N
wgrad      ``dw = xᵀ · dy``  ``xᵀ``: M (tokens), ``dy``: M
=========  ===============  ===========================================

``"nvfp4"`` (NVIDIA's NVFP4 pre-training recipe): E2M1 elements, E4M3 block
scales and one FP32 per-tensor scale; 1×16 blocks for activations and
gradients, 16×16 blocks for the weight (the 16×16 scales are the same for
``w`` and ``wᵀ``, so one quantized weight serves the forward and the dgrad
GEMM); a 16-point random Hadamard transform (one set of random signs, applied
along the token axis to both wgrad operands: ``(xᵀ Hᵀ)(H dy) = xᵀ dy``);
stochastic rounding for the gradient ``dy``, round-to-nearest-even elsewhere.

``"mxfp8"``: E4M3 elements with E8M0 (power-of-two) scales, 1×32 blocks
along the contraction axis of every operand of all three GEMMs (the weight is
quantized twice, once along K for the forward and once along N for dgrad),
round-to-nearest-even.

``None`` / ``"bf16"``: no quantization (bfloat16 operands, float32 accumulation).

Per-layer opt-out: the NVFP4 recipe keeps the first and last blocks of the
network in higher precision; `QuantRecipe.for_layer` returns ``None`` (bf16)
for the layers a recipe opts out.
"""

from __future__ import annotations

import dataclasses

from . import formats as F

RECIPE_NAMES = ("nvfp4", "mxfp8", "bf16")


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """A low-precision training recipe (frozen, hashable: a static argument).

    Attributes:
      name: a label (``"nvfp4"``, ``"mxfp8"`` or your own).
      format: the quantization format of every operand (``"nvfp4"`` or
        ``"mxfp8_e4m3"``; ``"mxfp8"`` is accepted as an alias).
      block: the 1-D block length along the contraction axis of activations
        and gradients (16 for NVFP4, 32 for MXFP8).
      weight_block: ``(16, 16)`` (2-D: one quantized weight for forward and
        dgrad; NVFP4 only) or an int (1-D along the contraction axis; the
        weight is quantized separately for forward and dgrad).
      hadamard: the block of the random Hadamard transform applied along the
        token axis to both wgrad operands (a power of two, e.g. 16), or ``None``.
      random_signs: draw the Hadamard signs from the key (else plain Hadamard).
      stochastic_rounding: round the gradient ``dy`` stochastically (both
        gradient GEMMs); round-to-nearest-even elsewhere.
      bf16_first, bf16_last: how many of the first / last layers `for_layer`
        keeps in bf16 (the recipe's opt-out).
      bf16_layers: further layer indices or names kept in bf16.
    """

    name: str
    format: str
    block: int
    weight_block: object
    hadamard: int | None = None
    random_signs: bool = True
    stochastic_rounding: bool = False
    bf16_first: int = 0
    bf16_last: int = 0
    bf16_layers: tuple = ()

    def __post_init__(self):
        fmt = F.get_format(self.format)
        if fmt.name not in ("nvfp4", "mxfp8_e4m3", "mxfp8_e5m2"):
            raise ValueError(f"QuantRecipe.format: expected 'nvfp4', 'mxfp8_e4m3' or 'mxfp8_e5m2', got {self.format!r}")
        object.__setattr__(self, "format", fmt.name)
        allowed = [b for b in fmt.blocks if isinstance(b, int)]
        if self.block not in allowed:
            raise ValueError(f"QuantRecipe.block: format {fmt.name} takes blocks of {allowed}, got {self.block!r}")
        wb = tuple(self.weight_block) if isinstance(self.weight_block, (tuple, list)) else self.weight_block
        if wb not in fmt.blocks:
            raise ValueError(f"QuantRecipe.weight_block: format {fmt.name} takes {list(fmt.blocks)}, got {wb!r}")
        if isinstance(wb, tuple) and wb[0] != wb[1]:
            raise ValueError(f"QuantRecipe.weight_block: 2-D weight blocks must be square (the transposed weight "
                             f"reuses them), got {wb}")
        object.__setattr__(self, "weight_block", wb)
        if self.hadamard is not None:
            h = self.hadamard
            if isinstance(h, bool) or not isinstance(h, int) or h < 2 or h & (h - 1):
                raise ValueError(f"QuantRecipe.hadamard: expected None or a power of two >= 2, got {h!r}")
        for field in ("bf16_first", "bf16_last"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"QuantRecipe.{field}: expected an int >= 0, got {v!r}")
        object.__setattr__(self, "bf16_layers", tuple(self.bf16_layers))

    @property
    def weight_2d(self) -> bool:
        """One 2-D-block quantized weight serves forward and dgrad."""
        return isinstance(self.weight_block, tuple)

    @property
    def weight_tile(self) -> int:
        """The weight's block length along either axis."""
        return self.weight_block[0] if self.weight_2d else self.weight_block

    @property
    def token_multiple(self) -> int:
        """What the token count ``M`` must be a multiple of (the wgrad blocks and the Hadamard)."""
        return max(self.block, self.hadamard or 1)

    @property
    def needs_key(self) -> bool:
        """Stochastic rounding or random Hadamard signs consume a PRNG key."""
        return self.stochastic_rounding or (self.hadamard is not None and self.random_signs)

    def replace(self, **changes) -> "QuantRecipe":
        return dataclasses.replace(self, **changes)

    def for_layer(self, layer, num_layers: int | None = None) -> "QuantRecipe | None":
        """This recipe, or ``None`` (bf16) where it opts layer ``layer`` out.

        Args:
          layer: the layer's index (0-based) or name.
          num_layers: the number of layers (needed for ``bf16_last`` with an index).
        """
        if layer in self.bf16_layers:
            return None
        if isinstance(layer, int) and not isinstance(layer, bool):
            if layer < self.bf16_first:
                return None
            if self.bf16_last:
                if num_layers is None:
                    raise ValueError(f"num_layers: recipe {self.name} keeps the last {self.bf16_last} layers in bf16; "
                                     f"pass num_layers to place layer {layer}")
                if layer >= num_layers - self.bf16_last:
                    return None
        return self


NVFP4 = QuantRecipe("nvfp4", "nvfp4", 16, (16, 16), hadamard=16, random_signs=True, stochastic_rounding=True,
                    bf16_first=1, bf16_last=1)
MXFP8 = QuantRecipe("mxfp8", "mxfp8_e4m3", 32, 32)


def get_recipe(recipe) -> QuantRecipe | None:
    """``recipe`` → a `QuantRecipe`, or ``None`` for no quantization.

    Accepts ``None``, ``"bf16"``, ``"nvfp4"``, ``"mxfp8"`` or a `QuantRecipe`;
    anything else raises ``ValueError`` / ``TypeError`` naming ``recipe``.
    """
    if recipe is None or isinstance(recipe, QuantRecipe):
        return None if recipe is None else recipe
    if not isinstance(recipe, str):
        raise TypeError(f"recipe: expected None, a recipe name or a QuantRecipe, got {type(recipe).__name__}")
    named = {"nvfp4": NVFP4, "mxfp8": MXFP8, "bf16": None}
    if recipe.lower() not in named:
        raise ValueError(f"recipe: expected one of {list(RECIPE_NAMES)}, None or a QuantRecipe, got {recipe!r}")
    return named[recipe.lower()]


__all__ = ["MXFP8", "NVFP4", "QuantRecipe", "get_recipe"]
