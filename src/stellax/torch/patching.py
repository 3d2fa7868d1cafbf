"""`apply_kernels`: put stellax kernels into a Hugging Face transformers model.

One call, like Liger-Kernel's ``apply_liger_kernel_to_*``, that walks a model
and rebinds what stellax runs faster to stellax, in place::

    report = st.apply_kernels(model)
    print(report)            # what was patched, and why anything was not

* ``norm``: RMSNorms → `rms_norm` (`hf_layers.patch_rms_norm`);
* ``mlp``: SwiGLU / GeGLU MLPs → `gated_linear_unit` (`hf_layers.patch_mlp`);
* ``attention``: the model's attention implementation → the stellax backend
  (`register_transformers_attention`, ``model.set_attn_implementation``);
* ``moe``: softmax top-k routers → `route`, and the experts → stellax
  `permute` / `ragged_dot_general` / `unpermute` through transformers'
  ``ExpertsInterface`` (``model.set_experts_implementation``);
* ``linear_attention``: Qwen3-Next Gated DeltaNet, Kimi Linear KDA and Mamba2
  mixers → stellax's chunked kernels through the mixers' own kernel hooks
  (`hf_linear_attention`), so their caches and padding masks keep working;
* ``loss``: the causal-LM loss → ``stellax.torch.linear_cross_entropy`` when
  it is available (reported as not patched, with the reason, until then).

Every patch runs on the module's own parameters (nothing is copied), so
training the patched model trains the model. Patching twice is a no-op.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from torch import nn

from . import hf_layers, hf_linear_attention

__all__ = ["PatchReport", "apply_kernels"]


@dataclasses.dataclass
class PatchReport:
    """What `apply_kernels` did. ``patched``: ``(module path, kind, stellax
    kernel)`` rows; ``skipped``: ``(module path or "", kind, reason)`` rows."""

    model: str
    patched: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    def count(self, kind: str) -> int:
        """How many modules of ``kind`` (``"norm"``, ``"mlp"``, ...) were patched."""
        return sum(1 for _, k, _ in self.patched if k == kind)

    def reasons(self, kind: str) -> list[str]:
        """Why modules of ``kind`` were not patched."""
        return [why for _, k, why in self.skipped if k == kind]

    def __str__(self) -> str:
        lines = [f"stellax.torch.apply_kernels({self.model}):"]
        for (kind, what), n in sorted(Counter((k, w) for _, k, w in self.patched).items()):
            lines.append(f"  patched {kind:<17} {n:>3} x {what}")
        for (kind, why), n in sorted(Counter((k, w) for _, k, w in self.skipped).items()):
            lines.append(f"  not patched {kind:<13} {n:>3} x {why}")
        return "\n".join(lines)


def _modules_named(model: nn.Module, predicate):
    return [(path, m) for path, m in model.named_modules() if predicate(m)]


def _patch_each(report, kind, modules, patch):
    for path, module in modules:
        if hf_layers.is_patched(module):
            report.skipped.append((path, kind, f"{type(module).__name__}: already patched"))
            continue
        why = patch(module)
        if why is None:
            report.patched.append((path, kind, module._stellax_patched))
        else:
            report.skipped.append((path, kind, why))


def _is_rms_norm(m):
    return type(m).__name__.endswith("RMSNorm") or type(m).__name__.endswith("RMSNormGated")


def _is_gated_mlp(m):
    return all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(m, "act_fn")


def _is_experts(m):
    return hasattr(m, "_apply_gate") and hasattr(m, "is_transposed") and hasattr(m, "num_experts")


def _patch_attention(model, report, implementation):
    from .hf import register_transformers_attention

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        report.skipped.append(("", "attention", f"{type(model).__name__} is not a transformers PreTrainedModel"))
        return
    layers = _modules_named(model, lambda m: type(m).__name__.endswith("Attention") and hasattr(m, "config"))
    if not layers:
        report.skipped.append(("", "attention", f"{type(model).__name__} has no attention layers"))
        return
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        report.skipped.append(("", "attention", f"attention_dropout = {dropout} > 0: stellax attention has no "
                                                "dropout (set config.attention_dropout = 0.0 to patch it)"))
        return
    if not model._can_set_attn_implementation():
        report.skipped.append(("", "attention", f"{type(model).__name__} does not dispatch attention through "
                                                "transformers' AttentionInterface"))
        return
    name = register_transformers_attention("stellax", implementation=implementation)
    model.set_attn_implementation(name)
    for path, _ in layers:
        report.patched.append((path, "attention", "stellax attention backend"))


def _patch_moe(model, report):
    routers = _modules_named(model, lambda m: type(m).__name__.endswith(("TopKRouter", "TopkRouter")))
    _patch_each(report, "moe router", routers, hf_layers.patch_router)
    experts = _modules_named(model, _is_experts)
    if not experts:
        return
    if not hasattr(model, "set_experts_implementation"):
        report.skipped.append(("", "moe experts", f"{type(model).__name__} has no set_experts_implementation"))
        return
    model.set_experts_implementation(hf_layers.register_experts())
    for path, module in experts:
        if module.config._experts_implementation == hf_layers.EXPERTS_NAME:
            report.patched.append((path, "moe experts", "permute + ragged_dot_general + unpermute"))
        else:
            report.skipped.append((path, "moe experts", f"{type(module).__name__}: its config kept experts "
                                                        f"implementation {module.config._experts_implementation!r}"))


def _patch_linear_attention(model, report):
    mixers = _modules_named(model, lambda m: type(m).__name__ in hf_linear_attention.MIXERS)
    for path, module in mixers:
        if hf_layers.is_patched(module):
            report.skipped.append((path, "linear attention", f"{type(module).__name__}: already patched"))
            continue
        why, what = hf_linear_attention.patch_mixer(module)
        if why is None:
            report.patched.append((path, "linear attention", what))
        else:
            report.skipped.append((path, "linear attention", why))


def _patch_loss(model, report):
    from . import loss_patch

    why = loss_patch.patch_causal_lm_loss(model)
    if why is None:
        report.patched.append(("", "loss", model._stellax_patched))
    else:
        report.skipped.append(("", "loss", why))


def apply_kernels(model: nn.Module, *, attention: bool = True, norm: bool = True, mlp: bool = True,
                  moe: bool = True, linear_attention: bool = True, loss: bool = True,
                  attention_implementation: str | None = None) -> PatchReport:
    """Patch a transformers model in place to run stellax kernels; returns a
    `PatchReport` of what was patched and why anything was not.

    Tested families: Llama, Qwen2/3, Mistral, Gemma 2/3, Mixtral,
    Qwen2-MoE/Qwen3-MoE, GPT-OSS, Qwen3-Next, Mamba2 (and Kimi Linear's KDA
    mixers by the same hooks). ``attention_implementation`` pins the stellax
    attention implementation (``None``: the best available).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    report = PatchReport(type(model).__name__)
    if norm:
        _patch_each(report, "norm", _modules_named(model, _is_rms_norm), hf_layers.patch_rms_norm)
    if mlp:
        _patch_each(report, "mlp", _modules_named(model, _is_gated_mlp), hf_layers.patch_mlp)
    if attention:
        _patch_attention(model, report, attention_implementation)
    if moe:
        _patch_moe(model, report)
    if linear_attention:
        _patch_linear_attention(model, report)
    if loss:
        _patch_loss(model, report)
    return report
