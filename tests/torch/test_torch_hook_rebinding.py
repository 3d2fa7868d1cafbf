"""`hf_linear_attention.rebind_globals`: how a mixer's kernel hooks are found —
in its forward, one call down in a module-level function (transformers >= 5.25
moved Mamba2's hooks into ``mamba2_scan_forward``), or behind the ``nn.Module``
wrapper the ``kernels`` package makes of a decorated function — and that the
copy leaves the original module untouched."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="pip install 'torch==2.13.0'")

from stellax.torch.hf_linear_attention import rebind_globals  # noqa: E402

_MODEL_SOURCE = '''
import torch

def chunk_hook(x):
    return x + 1

def scan_forward(x):
    return chunk_hook(x) * 10


def forward_direct(x):
    return chunk_hook(x)

def forward_nested(x):
    return scan_forward(x)
'''


def _fake_model_module(kernels_wrapped=False):
    module = types.ModuleType("fake_modeling_mixer")
    exec(compile(_MODEL_SOURCE, "fake_modeling_mixer.py", "exec"), module.__dict__)
    if kernels_wrapped:  # an nn.Module in place of the function, closing over it, as kernels' Func does
        original = module.scan_forward

        class Func(torch.nn.Module):
            def forward(self, *args):
                return original(*args)

        module.scan_forward = Func()
    return module


def _stellax_hook(x):
    return x - 1


@pytest.mark.parametrize("forward, kernels_wrapped",
                         [("forward_direct", False), ("forward_nested", False), ("forward_nested", True)])
def test_hook_is_rebound_where_the_forward_reaches_it(forward, kernels_wrapped):
    module = _fake_model_module(kernels_wrapped)
    x = torch.tensor(5.0)
    original = getattr(module, forward)
    before = float(original(x))
    patched = rebind_globals(original, {"chunk_hook": _stellax_hook})
    direct = forward == "forward_direct"
    assert float(patched(x)) == (4.0 if direct else 40.0)
    assert before == (6.0 if direct else 60.0)
    assert float(original(x)) == before, "the model's own function must stay unpatched"
    assert float(module.scan_forward(x)) == 60.0


def test_a_hook_found_nowhere_is_named():
    module = _fake_model_module()
    with pytest.raises(LookupError, match=r"forward_nested does not call \['missing_hook'\]"):
        rebind_globals(module.forward_nested, {"chunk_hook": _stellax_hook, "missing_hook": _stellax_hook})


def test_depth_zero_does_not_look_into_callees():
    module = _fake_model_module()
    with pytest.raises(LookupError, match="chunk_hook"):
        rebind_globals(module.forward_nested, {"chunk_hook": _stellax_hook}, depth=0)
