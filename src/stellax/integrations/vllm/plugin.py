"""The ``vllm.general_plugins`` entry point: registers ``STELLAX`` with vLLM.

vLLM loads general plugins in every process it starts (engine core,
workers) before it parses its configuration. `register`:

1. registers the backend class under a new `AttentionBackendEnum` member
   ``STELLAX`` (`vllm.v1.attention.backends.registry.register_backend`), so
   ``LLM(..., attention_backend="STELLAX")`` / ``--attention-backend
   STELLAX`` parse;
2. wraps the current platform's ``get_attn_backend_cls``: vLLM's CPU platform
   returns its own ``CPU_ATTN`` whatever the user selected, so a selected
   ``STELLAX`` is answered here (after the version and option checks) and
   every other selection goes to the platform unchanged: installing the plugin
   changes nothing for users who do not select it.

Safe to call more than once (vLLM may load plugins repeatedly).
"""

from __future__ import annotations

import logging

from . import support

logger = logging.getLogger("stellax.integrations.vllm")

BACKEND_PATH = "stellax.integrations.vllm.backend.StellaxAttentionBackend"
NAME = "STELLAX"
_WRAPPED = "_stellax_wrapped"


def register() -> None:
    """Register the ``STELLAX`` attention backend (the plugin's entry point)."""
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, BACKEND_PATH)
    _wrap_platform(getattr(vllm, "__version__", "unknown"))


def _wrap_platform(version: str) -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.get_attn_backend_cls
    if getattr(original, _WRAPPED, False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if getattr(selected_backend, "name", None) != NAME:
            return original(selected_backend, attn_selector_config, num_heads=num_heads)
        support.check_version(version)
        check_selection(attn_selector_config)
        logger.info("vLLM attention backend: %s (%s)", NAME, BACKEND_PATH)
        return BACKEND_PATH

    setattr(get_attn_backend_cls, _WRAPPED, True)
    # A classmethod on the platform class: every use of current_platform sees it.
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def check_selection(config) -> None:
    """Refuse, at backend selection, what vLLM's `AttentionSelectorConfig` says the
    layer needs and the backend lacks (each message names the option)."""
    from .backend import StellaxAttentionBackend

    if config.use_mla:
        raise support.UnsupportedByStellax("use_mla: multi-head latent attention (DeepSeek-style MLA) is not "
                                           "supported by the STELLAX vLLM backend yet; choose another "
                                           "--attention-backend")
    if config.use_sparse:
        raise support.UnsupportedByStellax("use_sparse: sparse attention is not supported by the STELLAX backend")
    support.check_dtype(str(config.dtype).removeprefix("torch."))
    if config.kv_cache_dtype is not None:
        support.check_kv_cache_dtype(config.kv_cache_dtype)
    named = {"use_mm_prefix": "multimodal prefix-LM attention", "use_per_head_quant_scales":
             "per-head KV quantization scales", "use_non_causal": "non-causal decoder attention",
             "use_pcp": "prefill context parallelism", "use_dcp": "decode context parallelism",
             "use_rswa": "R-SWA attention", "use_batch_invariant": "VLLM_BATCH_INVARIANT",
             "use_kv_connector": "KV transfer connectors (they may repack pages in CPU_ATTN's order)"}
    for field, what in named.items():
        if getattr(config, field, False):
            raise support.UnsupportedByStellax(f"{field}: {what} is not supported by the STELLAX vLLM backend")
    if str(getattr(config.attn_type, "value", config.attn_type)) != "decoder":
        raise support.UnsupportedByStellax(f"attn_type: the STELLAX backend runs decoder attention, got "
                                           f"{getattr(config.attn_type, 'value', config.attn_type)!r}")
    if not StellaxAttentionBackend.supports_block_size(config.block_size):
        raise support.UnsupportedByStellax(f"block_size: the STELLAX backend needs a multiple of 16, got "
                                           f"{config.block_size}")
