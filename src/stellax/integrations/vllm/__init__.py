"""stellax as a vLLM attention backend (``pip install 'stellax[vllm]'``).

Installing stellax with the ``vllm`` extra registers a ``vllm.general_plugins``
entry point (`plugin.register`); select the backend the way vLLM selects any:

    LLM(model, attention_backend="STELLAX")          # or: vllm serve ... --attention-backend STELLAX

The backend (`backend.StellaxAttentionBackend`) runs vLLM's paged KV cache
through `stellax.ragged_paged_attention` without copying it: see
docs/integrations.md ("vLLM"). What it supports and refuses at start-up is
in `support`; the step metadata and the cache view in `metadata`.

Importing this package does not import vLLM; `support` and `metadata` run
without it.
"""

from .support import MAX_VERSION, MIN_VERSION, UnsupportedByStellax, check_version, supported_range

__all__ = ["MAX_VERSION", "MIN_VERSION", "UnsupportedByStellax", "check_version", "register", "supported_range"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see `plugin.register`)."""
    from .plugin import register as _register

    _register()
