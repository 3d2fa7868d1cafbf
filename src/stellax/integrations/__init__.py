"""Framework hooks: stellax inside other frameworks' engines.

* `stellax.integrations.vllm`: stellax as a vLLM attention backend (``attention_backend="STELLAX"``).

Subpackages import their framework lazily; importing this package imports none.
"""
