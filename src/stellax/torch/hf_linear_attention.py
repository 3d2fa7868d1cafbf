"""stellax kernels behind the kernel hooks of Hugging Face linear-attention mixers.

transformers' Qwen3-Next Gated DeltaNet, Kimi Linear KDA and Mamba2 mixers
call their kernels through module-level hook functions
(``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``,
``mamba2_chunk_scan``, ...: fla / mamba_ssm when installed, a torch loop
otherwise). `patch_mixer` gives one mixer instance a copy of its class's own
``forward`` whose hooks resolve to stellax instead, so everything else in that
forward — projections, the short convolution, the cache (conv and recurrent
states, decode steps), the padding mask, the gated norm — is the model's own
code, unchanged, on the model's own parameters. The class, the module and
other models are untouched.

The short causal convolution stays the model's (stellax has no conv kernel).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from . import linear_attention as _la

__all__ = ["MIXERS", "patch_mixer", "rebind_globals"]


def rebind_globals(func, replacements: dict, depth: int = 1):
    """A copy of ``func`` whose global names in ``replacements`` resolve to the
    given objects. A name ``func`` does not call itself is looked for, up to
    ``depth`` calls down, in the module-level functions of ``func``'s own module
    that it calls (transformers >= 5.25 moved Mamba2's kernel hooks from the
    mixer's ``forward`` into ``mamba2_scan_forward``); those functions are
    rebound copies too. Decorated functions (a ``functools.wraps`` chain) are
    rebuilt level by level, so the decorators keep working around the copy.
    Raises ``LookupError`` naming the hooks found nowhere."""
    inner = getattr(func, "__wrapped__", None)
    if inner is not None:
        return _rebuild_decorated(func, rebind_globals(inner, replacements, depth))
    code = func.__code__
    direct = {name: obj for name, obj in replacements.items() if name in code.co_names}
    rest = {name: obj for name, obj in replacements.items() if name not in direct}
    found = set(direct)
    if rest and depth > 0:
        for callee_name in code.co_names:
            callee = _plain_function(func.__globals__.get(callee_name), callee_name, func.__module__)
            if callee is None:
                continue
            callee_code = _innermost(callee).__code__
            wanted = {n: o for n, o in rest.items() if n in callee_code.co_names}
            if wanted:
                direct[callee_name] = rebind_globals(callee, wanted, depth - 1)
                found |= set(wanted)
    missing = sorted(set(replacements) - found)
    if missing:
        raise LookupError(f"{func.__qualname__} does not call {missing}")
    scope = dict(func.__globals__)
    scope.update(direct)
    new = types.FunctionType(code, scope, func.__name__, func.__defaults__, func.__closure__)
    new.__kwdefaults__ = func.__kwdefaults__
    new.__qualname__, new.__doc__ = func.__qualname__, func.__doc__
    return new


def _plain_function(obj, name: str, module: str):
    """The Python function behind the global ``name`` of ``module``, or ``None``.
    With the ``kernels`` package installed, transformers' ``use_kernel_forward_from_hub``
    turns a decorated function into an ``nn.Module`` instance whose class's
    ``forward`` calls the original function from its closure; that function is
    returned (the copy then calls it directly, with no hub dispatch: its hooks
    are stellax's)."""
    if isinstance(obj, types.FunctionType):
        return obj if obj.__module__ == module else None
    if isinstance(obj, nn.Module):
        for cell in getattr(type(obj).forward, "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(held, types.FunctionType) and held.__name__ == name and held.__module__ == module:
                return held
    return None


def _innermost(func):
    while getattr(func, "__wrapped__", None) is not None:
        func = func.__wrapped__
    return func


def _rebuild_decorated(func, new_inner):
    """``func`` (a wrapper whose closure holds ``func.__wrapped__``) around ``new_inner`` instead."""
    inner, cells, found = func.__wrapped__, [], False
    for cell in func.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        found = found or held is inner
        cells.append(types.CellType(new_inner) if held is inner else cell)
    if not found:
        raise LookupError(f"{func.__qualname__}: cannot find the wrapped function in its closure")
    new = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(cells))
    new.__dict__.update(func.__dict__)
    new.__wrapped__ = new_inner
    new.__kwdefaults__ = func.__kwdefaults__
    new.__qualname__, new.__doc__ = func.__qualname__, func.__doc__
    return new


# -- the stellax hooks, with the signatures of transformers' torch fallbacks ---------------------
def _packed(kwargs):
    return kwargs.get("cu_seqlens")


def gdn_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """``torch_chunk_gated_delta_rule`` (Qwen3-Next) → `chunk_gated_delta_rule`."""
    return _la.chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=_packed(kwargs))


def gdn_recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
    """``torch_recurrent_gated_delta_rule`` (Qwen3-Next decode) → `fused_recurrent_gated_delta_rule`."""
    return _la.fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                                output_final_state=output_final_state,
                                                use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=_packed(kwargs))


def kda_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """``chunk_kimi_delta_attention`` (Kimi Linear; ``g`` the per-channel log decay) → `chunk_kda`."""
    return _la.chunk_kda(query, key, value, g, beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
                         cu_seqlens=_packed(kwargs))


def kda_recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
    """``recurrent_kimi_delta_attention`` (Kimi Linear decode) → `fused_recurrent_kda`."""
    return _la.fused_recurrent_kda(query, key, value, g, beta, initial_state=initial_state,
                                   output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
                                   cu_seqlens=_packed(kwargs))


def mamba2_fused_training(*args, **kwargs):
    """``mamba2_split_conv1d_scan_combined``: ``None`` sends the mixer down its
    unfused path (whose scan is stellax `ssd`), as its torch fallback does."""
    return None


def mamba2_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
    """``mamba2_chunk_scan`` (``mamba_chunk_scan_combined``) → `ssd`."""
    if kwargs.get("seq_idx") is not None:
        raise NotImplementedError("mamba2 with stellax: seq_idx is not supported; pass cu_seqlens for packed batches")
    return _la.ssd(hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                   dt_limit=tuple(dt_limit), initial_states=initial_states, cu_seqlens=_packed(kwargs),
                   return_final_states=return_final_states)


def mamba2_step(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """``mamba2_selective_state_update`` (tied head dims) → `ssd_step`; the
    state is updated in place, as the hook's contract requires."""
    y, new_state = _la.ssd_step(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                dt_softplus=dt_softplus)
    with torch.no_grad():
        state.copy_(new_state)
    return y


#: mixer class -> (the hook names its forward calls -> stellax replacements, what the report says)
MIXERS = {
    "Qwen3NextGatedDeltaNet": ({"torch_chunk_gated_delta_rule": gdn_chunk,
                                "torch_recurrent_gated_delta_rule": gdn_recurrent},
                               "chunk_gated_delta_rule / fused_recurrent_gated_delta_rule"),
    "KimiLinearDeltaAttention": ({"chunk_kimi_delta_attention": kda_chunk,
                                  "recurrent_kimi_delta_attention": kda_recurrent},
                                 "chunk_kda / fused_recurrent_kda"),
    "Mamba2Mixer": ({"mamba2_split_conv1d_scan_combined": mamba2_fused_training, "mamba2_chunk_scan": mamba2_scan,
                     "mamba2_selective_state_update": mamba2_step}, "ssd / ssd_step"),
}


def patch_mixer(module: nn.Module) -> tuple[str | None, str]:
    """Rebind one linear-attention mixer's forward hooks to stellax.
    Returns ``(None, what)`` when patched, ``(reason, "")`` when not."""
    name = type(module).__name__
    if name not in MIXERS:
        return f"{name}: no stellax hooks for this mixer (known: {sorted(MIXERS)})", ""
    hooks, what = MIXERS[name]
    try:
        forward = rebind_globals(type(module).forward, hooks)
    except LookupError as e:
        return f"{name}: its forward does not call the expected kernel hooks ({e})", ""
    module.forward = types.MethodType(forward, module)
    module._stellax_patched = what
    return None, what
