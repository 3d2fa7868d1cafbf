"""A Hugging Face transformers attention backend running `stellax.dot_product_attention`.

`register_transformers_attention(name)` registers two things under ``name``:

* an attention function in ``transformers.AttentionInterface``: it gets
  query ``[B, N, T, D]``, key/value ``[B, K, S, D]`` (not repeated for GQA),
  the mask built below, ``scaling`` and ``dropout``, and returns
  ``([B, T, N, D], None)``. Causality comes from ``module.is_causal`` (or an
  ``is_causal`` keyword the model passes);
* a mask builder in ``transformers.masking_utils.AttentionMaskInterface``.
  Without one, transformers builds no padding mask for an unknown backend and
  padded batches would silently attend to padding.

The mask builder keeps the structure instead of materializing ``T x S``:

* plain causal / bidirectional attention without padding -> ``None``
  (stellax gets ``is_causal``);
* plain causal / bidirectional attention with a 2-D padding mask -> the key
  padding mask as a boolean ``[B, 1, 1, S]`` tensor. The attention function
  maps it to segment ids (``kv_segment_ids`` = 1 for real tokens, 0 for
  padding; ``q_segment_ids`` = 1), which works for left and right padding,
  keeps ``is_causal`` and lets the kernels skip blocks;
* everything else (sliding windows, chunked / packed / custom mask functions,
  static caches with offsets) -> the dense boolean ``[B, 1, T, S]`` mask from
  transformers' own SDPA builder, passed as stellax's ``mask``.

A float (additive) 4-D mask passed directly by a caller becomes ``bias``.
"""

from __future__ import annotations

import torch

from .attention import dot_product_attention

__all__ = ["register_transformers_attention", "stellax_attention_forward", "stellax_attention_mask"]

_IMPLEMENTATION: dict[str, str | None] = {}
_BUCKET_KV: dict[str, bool] = {}


def _is_tracing(t) -> bool:
    try:
        from transformers.utils.import_utils import is_tracing
    except ImportError:  # pragma: no cover - transformers versions without it
        return torch.compiler.is_compiling()
    return bool(is_tracing(t))


def stellax_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                           mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """The `AttentionMaskInterface` entry (see the module docstring)."""
    from transformers import masking_utils as mu

    mask_function = mask_function or mu.causal_mask_function
    plain_causal = mask_function is mu.causal_mask_function
    plain = plain_causal or mask_function is mu.bidirectional_mask_function
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int) and kv_offset == 0
               and (not plain_causal or q_offset == kv_length - q_length))
    if plain and aligned:
        if attention_mask is None:
            return None
        padding = mu.prepare_padding_mask(attention_mask, kv_length, 0)[:, :kv_length].to(torch.bool)
        if not _is_tracing(padding) and bool(padding.all()):
            return None
        return padding[:, None, None, :]
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    kwargs.pop("dtype", None)
    kwargs.pop("config", None)
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def kv_bucket(length: int) -> int:
    """The key length a call is padded to: a power of two up to 128 (at least
    16), then a multiple of 128 — so a decode loop compiles one XLA program
    per bucket instead of one per step."""
    if length <= 16:
        return 16
    if length <= 128:
        return 1 << (length - 1).bit_length()
    return -(-length // 128) * 128


def _pad_keys_to_bucket(q, k, v, extra):
    """Left-pad keys/values to `kv_bucket` with masked-out entries. Padding on
    the left keeps the bottom-right causal alignment (and sliding windows)
    exact; the padded keys get segment id 0, which no query has."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if not isinstance(s, int):  # a symbolic (dynamic-shape) length under torch.compile: leave it
        return k, v
    pad = kv_bucket(s) - s
    if pad <= 0:
        return k, v
    k = torch.nn.functional.pad(k, (0, 0, 0, 0, pad, 0))
    v = torch.nn.functional.pad(v, (0, 0, 0, 0, pad, 0))
    seg = extra.get("kv_segment_ids")
    if seg is None:
        seg = torch.ones((b, s), dtype=torch.int32, device=q.device)
    extra["kv_segment_ids"] = torch.nn.functional.pad(seg, (pad, 0))
    extra.setdefault("q_segment_ids", torch.ones((b, t), dtype=torch.int32, device=q.device))
    return k, v


def stellax_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              implementation: str | None = None, **kwargs):
    """The `AttentionInterface` entry: ``[B, N, T, D]`` in, ``([B, T, N, D], None)`` out."""
    if dropout and dropout > 0.0:
        raise NotImplementedError("stellax attention has no attention dropout; set attention_dropout=0.0 "
                                  "(or call model.eval()) to use attn_implementation='stellax'")
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("stellax attention does not return attention weights (output_attentions=True)")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("stellax attention: position_bias is not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    b, t = q.shape[0], q.shape[1]
    extra: dict = {}
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.ndim == 2:  # a raw key padding mask (flash-attention style)
            attention_mask = attention_mask[:, None, None, :]
        if attention_mask.ndim != 4:
            raise ValueError(f"attention_mask: expected None, [B, S] or [B|1, 1|N, T|1, S], got {tuple(attention_mask.shape)}")
        s = k.shape[1]
        attention_mask = attention_mask[..., :s]
        if attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1 \
                and attention_mask.shape[0] == b:
            extra["q_segment_ids"] = torch.ones((b, t), dtype=torch.int32, device=q.device)
            extra["kv_segment_ids"] = attention_mask[:, 0, 0, :].to(torch.int32)
        elif attention_mask.dtype == torch.bool:
            mask, causal = attention_mask, False
        else:
            bias, causal = attention_mask.to(q.dtype), False
    window = kwargs.get("sliding_window")
    if window is not None and mask is None and bias is None:
        extra["local_window_size"] = (int(window) - 1, 0)  # HF: keep keys with q - k < sliding_window
    sinks = kwargs.get("s_aux")
    softcap = kwargs.get("softcap")
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    impl = implementation if implementation is not None else _IMPLEMENTATION.get(name)
    if mask is None and bias is None and _BUCKET_KV.get(name, True):
        k, v = _pad_keys_to_bucket(q, k, v, extra)
    out = dot_product_attention(q, k, v, bias, mask, scale=scaling, is_causal=bool(causal) and t > 1,
                                logits_soft_cap=softcap, sinks=sinks, implementation=impl, **extra)
    return out, None


def register_transformers_attention(name: str = "stellax", *, implementation: str | None = None,
                                    bucket_kv: bool = True) -> str:
    """Register stellax attention with transformers under ``name``.

    After it, ``AutoModel.from_pretrained(path, attn_implementation=name)``
    (or ``model.set_attn_implementation(name)``) runs every attention layer of
    the model through `stellax.dot_product_attention`, with the matching mask
    builder. ``implementation`` pins the stellax implementation (``None``:
    the best available). ``bucket_kv`` left-pads keys/values to `kv_bucket`
    lengths (masked out, results unchanged) so generation compiles one XLA
    program per bucket rather than one per decode step. Returns ``name``.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover
        raise ImportError("register_transformers_attention needs transformers (pip install transformers)") from e
    _IMPLEMENTATION[name] = implementation
    _BUCKET_KV[name] = bool(bucket_kv)
    AttentionInterface.register(name, stellax_attention_forward)
    AttentionMaskInterface.register(name, stellax_attention_mask)
    return name
