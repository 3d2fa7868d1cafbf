"""The causal-LM loss of a transformers model through the fused
`stellax.torch.linear_cross_entropy`: a training forward with labels never
builds the ``[tokens, vocab]`` logits.

`patch_causal_lm_loss` rebinds the ``forward`` of a ``*ForCausalLM`` with the
standard signature (``input_ids, attention_mask, position_ids, cache,
inputs_embeds, labels, use_cache, [output_router_logits,] logits_to_keep``,
a base ``model`` and a bias-free ``lm_head``). In training mode with
``labels`` (or ``shift_labels``) it runs the base model and computes

    loss = linear_cross_entropy(h[:, :-1], lm_head.weight, labels[:, 1:])

(``transpose_w=True``: the weight stays the ``[V, D]`` parameter;
Gemma's ``final_logit_softcapping`` becomes ``logit_soft_cap``; with
``num_items_in_batch`` the sum over it, as transformers' ``ForCausalLMLoss``;
MoE models add ``router_aux_loss_coef`` times their own load-balancing loss when
router logits are requested) and returns the model's output class with
``logits=None``. Evaluation, generation and calls without labels run the
original forward unchanged.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["patch_causal_lm_loss"]

_STANDARD = ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "labels", "use_cache",
             "logits_to_keep")
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _fused_loss():
    from .loss import linear_cross_entropy

    return linear_cross_entropy


def _token_loss(self, hidden, labels, shift_labels, kwargs):
    """The mean (or sum / num_items_in_batch) next-token cross-entropy of ``hidden [B, T, D]``."""
    ignore_index = kwargs.get("ignore_index", -100)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items = kwargs.get("num_items_in_batch")
    loss = _fused_loss()(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                         shift_labels.reshape(-1).to(hidden.device), ignore_index=ignore_index,
                         logit_soft_cap=getattr(self.config, "final_logit_softcapping", None),
                         reduction="mean" if num_items is None else "sum", transpose_w=True)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return loss


def _fused_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                   labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    if "past_key_values" in kwargs:  # transformers' deprecated name of `cache`
        cache = kwargs.pop("past_key_values")
    shift_labels = kwargs.get("shift_labels")
    if not self.training or (labels is None and shift_labels is None) or kwargs.get("return_dict") is False:
        return self._stellax_unfused_forward(input_ids=input_ids, attention_mask=attention_mask,
                                             position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                             labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                             **kwargs)
    model_kwargs = {k: v for k, v in kwargs.items() if k not in _LOSS_KWARGS}
    moe = self._stellax_moe_loss is not None
    if moe:
        router = model_kwargs.pop("output_router_logits", None)
        model_kwargs["output_router_logits"] = self.config.output_router_logits if router is None else router
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **model_kwargs)
    loss = _token_loss(self, outputs.last_hidden_state, labels, shift_labels, kwargs)
    fields = dict(loss=loss, logits=None, cache=getattr(outputs, "cache", None),
                  hidden_states=getattr(outputs, "hidden_states", None),
                  attentions=getattr(outputs, "attentions", None))
    if moe:
        aux = None
        if model_kwargs["output_router_logits"]:
            aux = self._stellax_moe_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                         attention_mask)
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        fields.update(loss=loss, aux_loss=aux, router_logits=getattr(outputs, "router_logits", None))
    return self._stellax_output_type(**fields)


def patch_causal_lm_loss(model: nn.Module) -> str | None:
    """Patch ``model``'s causal-LM loss, or say why not (see the module docstring)."""
    name = type(model).__name__
    if _fused_loss() is None:
        return "stellax.torch.linear_cross_entropy is not available; the loss stays transformers' (logits, then CE)"
    if getattr(model, "_stellax_patched", False):
        return f"{name}: already patched"
    head, base = getattr(model, "lm_head", None), getattr(model, "model", None)
    if not isinstance(head, nn.Linear) or not isinstance(base, nn.Module):
        return f"{name}: not a causal LM with a base `model` and an `lm_head` linear"
    if head.bias is not None:
        return f"{name}: lm_head has a bias (linear_cross_entropy takes a weight only)"
    forward = inspect.unwrap(type(model).forward)
    params = list(inspect.signature(forward).parameters)[1:]
    if [p for p in params if p not in ("output_router_logits", "kwargs")] != list(_STANDARD):
        return f"{name}: forward signature {params} is not the standard causal-LM one; the loss stays transformers'"
    output_type = inspect.signature(forward).return_annotation
    if not isinstance(output_type, type):
        return f"{name}: cannot tell the output class from its forward ({output_type!r})"
    moe_loss = None
    if "output_router_logits" in params:
        moe_loss = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if moe_loss is None or not hasattr(model, "router_aux_loss_coef"):
            return f"{name}: a MoE model without the usual load_balancing_loss_func / router_aux_loss_coef"
    model._stellax_unfused_forward = model.forward
    model._stellax_moe_loss = moe_loss
    model._stellax_output_type = output_type
    model.forward = types.MethodType(_fused_forward, model)
    model._stellax_patched = "linear_cross_entropy (no logits in a training forward with labels)"
    return None
