"""stellax kernels inside Tunix models (``pip install 'stellax[tunix]'``).

`apply_kernels(model)` swaps the attention, RMSNorm and MLP modules of a
Tunix model (Llama 3, Qwen 3 dense) for stellax-backed subclasses *of the
same modules*: each module keeps its parameters and submodules (the same
``nnx.Param`` objects, paths and shardings), only its class changes, so

* the attention core (``softmax(s · q kᵀ + mask) v`` over Tunix's boolean
  ``attn_mask [B, T, S]``, GQA without repeating K/V) runs
  `stellax.dot_product_attention` — the projections, RoPE and Tunix's KV
  cache update are Tunix's own code, so LoRA on the projections (qwix) and
  Tunix's sampler work unchanged;
* every RMSNorm runs `stellax.rms_norm` on its own ``w``;
* every gated MLP runs `stellax.gated_linear_unit` on ``(gate_proj.kernel,
  up_proj.kernel)`` (no copy: the pair form) followed by Tunix's
  ``down_proj``. Under qwix (a LoRA model: qwix adapts projections by
  intercepting their calls) or when the gate or up projection carries LoRA
  weights (``kernel_lora_a``), the MLP runs Tunix's own block instead, so
  LoRA on the MLP is never silently dropped (and that MLP is not fused).

A query row with every key masked (a left-padding position) gets Tunix's
result, the mean of the values (Tunix fills masked logits with ``-2.4e38``),
not stellax's zeros: Tunix's SFT loss reads the last padding position's
logits (they predict the first real token).

Qwen 3 MoE layers (``MoELayer``) are left as they are (reported as skipped).
"""

from __future__ import annotations

import importlib
import sys
import threading
import jax
import jax.numpy as jnp

import stellax

__all__ = ["FAMILIES", "apply_kernels", "is_patched"]

#: Tunix model modules `apply_kernels` knows, by family name.
FAMILIES = {"llama3": "tunix.models.llama3.model", "qwen3": "tunix.models.qwen3.model"}

_PATCHED: dict[type, type] = {}


def _family_of(model) -> str:
    module = type(model).__module__
    for name, path in FAMILIES.items():
        if module == path:
            return name
    raise ValueError(f"apply_kernels: model: unknown Tunix model family {type(model).__name__} (from {module}); "
                     f"stellax patches {', '.join(f'{k} ({v})' for k, v in FAMILIES.items())}")


# -- the stellax forwards ---------------------------------------------------------------------
def _attention_block(self, x, segment_pos, cache, attn_mask, segment_ids=None):
    """Tunix's ``Attention.block`` with the softmax core replaced by
    `stellax.dot_product_attention` (projections, q/k norms, RoPE and the KV
    cache update as in Tunix)."""
    family = importlib.import_module(type(self).__mro__[1].__module__)
    seq_len = x.shape[1]
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if hasattr(self, "q_norm"):  # Qwen 3: per-head RMSNorm on q and k
        q, k = self.q_norm(q), self.k_norm(k)
    q = family.apply_rope(q, segment_pos, head_dim=self.head_dim)
    k = family.apply_rope(k, segment_pos, head_dim=self.head_dim)
    if cache is not None:
        start = (0, cache["end_index"][0] % cache["v"].shape[1], 0, 0)
        v = jax.lax.dynamic_update_slice(cache["v"], v, start)
        k = jax.lax.dynamic_update_slice(cache["k"], k, start)
    mask = None if attn_mask is None else attn_mask[:, None, :, :].astype(bool)   # [B, 1, T, S]
    o = stellax.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, scale=float(self.scale))
    if mask is not None:
        # Tunix fills masked logits with -2.4e38, so a row with no visible key
        # (a left-padding position) averages all values; stellax gives zeros.
        # Keep Tunix's semantics: the pad position's logit enters SFT losses
        # (it predicts the first real token).
        group = q.shape[2] // k.shape[2]
        mean_v = jnp.repeat(jnp.mean(v.astype(jnp.float32), axis=1), group, axis=1).astype(o.dtype)  # [B, N, H]
        visible = jnp.any(attn_mask, axis=-1)                                                      # [B, T]
        o = jnp.where(visible[:, :, None, None], o, mean_v[:, None])
    out = self.o_proj(o.astype(v.dtype))
    new_cache = None if cache is None else {"v": v, "k": k, "end_index": cache["end_index"] + seq_len}
    return new_cache, out


def _rms_norm_call(self, x):
    """``w · x / sqrt(mean(x²) + eps)`` in float32 (`stellax.rms_norm`), cast as Tunix does."""
    dtype = getattr(self, "dtype", None) or x.dtype
    out = stellax.rms_norm(x.astype(jnp.float32), self.w[...].astype(jnp.float32), epsilon=float(self.norm_eps))
    return out.astype(dtype)


def _has_lora(linear) -> bool:
    return any(hasattr(linear, name) for name in ("kernel_lora_a", "kernel_lora_b"))


def _under_qwix() -> bool:
    """Whether qwix (LoRA / quantization by op interception) is intercepting
    calls on this thread. qwix finds the projections to adapt by watching
    their ``__call__``; a fused MLP would hide ``gate_proj``/``up_proj`` from it."""
    module = sys.modules.get("qwix._src.interception")
    manager = getattr(module, "interception_manager", None)
    active = getattr(manager, "_intercepted_threads", None)
    if not active:
        return False
    me = threading.get_ident()
    return any(thread == me and enabled for (thread, _), enabled in list(active.items()))


def _mlp_block(self, x):
    """``down_proj(silu(x W_gate) · (x W_up))`` with the gate and up
    projections fused (`stellax.gated_linear_unit` on the two kernels).

    Under qwix (LoRA on the model) or with LoRA weights on ``gate_proj`` /
    ``up_proj``, Tunix's own block runs, so the adapters are found and applied."""
    if _has_lora(self.gate_proj) or _has_lora(self.up_proj) or _under_qwix():
        return type(self).__mro__[1].block(self, x)
    h = stellax.gated_linear_unit(x, (self.gate_proj.kernel[...].astype(x.dtype),
                                      self.up_proj.kernel[...].astype(x.dtype)), activation="silu")
    return self.down_proj(h)


_FORWARDS = {"Attention": {"block": _attention_block}, "RMSNorm": {"__call__": _rms_norm_call},
             "MLP": {"block": _mlp_block}}


def _patched_class(cls: type) -> type:
    """The stellax subclass of a Tunix module class (one per class, cached)."""
    patched = _PATCHED.get(cls)
    if patched is None:
        methods = dict(_FORWARDS[cls.__name__])
        methods["__module__"] = __name__
        methods["__qualname__"] = f"Stellax{cls.__name__}"
        methods["stellax_patched"] = True
        patched = type(f"Stellax{cls.__name__}", (cls,), methods)
        _PATCHED[cls] = patched
    return patched


def is_patched(module) -> bool:
    """Whether `apply_kernels` swapped this module's class."""
    return bool(getattr(type(module), "stellax_patched", False))


def apply_kernels(model) -> dict[str, str]:
    """Swap the attention, RMSNorm and MLP modules of a Tunix Llama 3 / Qwen 3
    model for stellax-backed subclasses sharing their parameters (in place).

    Args:
      model: a ``tunix.models.llama3.model.Llama3`` or
        ``tunix.models.qwen3.model.Qwen3`` (any config; LoRA may be applied
        before or after).

    Returns:
      ``{module path: what runs there}`` — ``"stellax attention"``, ``"stellax
      rms_norm"``, ``"stellax gated_linear_unit"`` or the reason a module was
      left alone.

    Raises:
      ValueError: a model of a family stellax does not know, naming it and the
        known families.
    """
    from flax import nnx

    family = _family_of(model)
    module = importlib.import_module(FAMILIES[family])
    targets = {getattr(module, name): name for name in _FORWARDS}
    report: dict[str, str] = {}
    modules = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
    for path, child in list(modules):
        key = "/".join(str(p) for p in path)
        cls = type(child)
        if is_patched(child):
            report[key] = f"stellax {cls.__mro__[1].__name__} (already patched)"
            continue
        name = targets.get(cls)
        if name is None:
            if cls.__name__ == "MoELayer":
                report[key] = "skipped: stellax does not patch Tunix MoE layers yet"
            continue
        child.__class__ = _patched_class(cls)
        report[key] = {"Attention": "stellax attention", "RMSNorm": "stellax rms_norm",
                       "MLP": "stellax gated_linear_unit"}[name]
    return report

