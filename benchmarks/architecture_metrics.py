"""Architecture metrics of the source tree (the numbers the architecture issue tracks).

    python benchmarks/architecture_metrics.py [--json]

* hops: the stellax function frames on the stack between the public
  ``stellax.dot_product_attention`` and the Triton forward kernel body (run in
  interpret mode on a tiny input), the distinct files they live in, and the
  hops outside the toolkit's launch frames in ``core/pallas.py``;
* in-function imports: ``import`` statements inside function bodies under
  ``src/stellax`` and under ``src/stellax/ops``;
* long functions: functions over 80 lines, overall and in kernel modules
  (``triton*.py``, ``mosaic*.py``, ``core/pallas.py``);
* ``refs.pop(0)`` calls (positional kernel-operand bookkeeping).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stellax"


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def source_metrics() -> dict:
    imports_all = imports_ops = pops = 0
    long_all, long_kernels = [], []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        pops += text.count("refs.pop(0)")
        tree = ast.parse(text)
        nested = set()
        for fn in _functions(tree):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    nested.add(id(node))
            length = fn.end_lineno - fn.lineno + 1
            if length > 80:
                long_all.append(f"{rel}:{fn.name} ({length})")
                if path.name.startswith(("triton", "mosaic")) or rel.endswith("core/pallas.py"):
                    long_kernels.append(f"{rel}:{fn.name} ({length})")
        imports_all += len(nested)
        if "/ops/" in rel:
            imports_ops += len(nested)
    return {"in_function_imports": imports_all, "in_function_imports_ops": imports_ops,
            "functions_over_80_lines": long_all, "kernel_functions_over_80_lines": long_kernels,
            "refs_pop_calls": pops}


def attention_hops() -> dict:
    """Stack of stellax frames when the Triton attention forward kernel body runs."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    import stellax

    src = str(SRC)
    seen: list[list[tuple[str, str]]] = []

    def stack_of(frame):
        frames = []
        while frame is not None:
            if frame.f_code.co_filename.startswith(src):
                frames.append((frame.f_code.co_filename, frame.f_code.co_name))
            frame = frame.f_back
        return frames[::-1]

    def profiler(frame, event, arg):
        if event != "call" or seen:
            return
        path = frame.f_code.co_filename
        if path.startswith(src) and "/ops/attention/" in path and "triton" in os.path.basename(path) \
                and "kernel" in frame.f_code.co_name and "call" not in frame.f_code.co_name:
            seen.append(stack_of(frame))

    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 2, 16), jnp.float32)
    with stellax.interpret_mode():
        sys.setprofile(profiler)
        try:
            stellax.dot_product_attention(q, q, q, is_causal=True, implementation="triton")
        finally:
            sys.setprofile(None)
    if not seen:
        raise RuntimeError("the Triton attention kernel body was never entered")
    stack = seen[0]
    start = next(i for i, (_, name) in enumerate(stack) if name == "dot_product_attention")
    chain = stack[start:]
    files = sorted({p for p, _ in chain})
    # The toolkit's launch frames (core/pallas.py: kernel_call and the name binding) stand where
    # pl.pallas_call's own frames stand for a bare Pallas kernel; counted apart.
    launch = [link for link in chain if link[0].endswith("core/pallas.py")]
    return {"hops": len(chain) - 1, "files": len(files), "hops_outside_launch": len(chain) - 1 - len(launch),
            "chain": [f"{pathlib.Path(p).relative_to(ROOT)}:{n}" for p, n in chain]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = {"attention": attention_hops(), **source_metrics()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    a = result["attention"]
    print(f"stellax.dot_product_attention -> Triton kernel: {a['hops']} hops in {a['files']} files "
          f"({a['hops_outside_launch']} outside the core/pallas.py launch frames)")
    for link in a["chain"]:
        print(f"    {link}")
    print(f"in-function imports: {result['in_function_imports']} in src/stellax, "
          f"{result['in_function_imports_ops']} in src/stellax/ops")
    print(f"functions over 80 lines: {len(result['functions_over_80_lines'])} "
          f"({len(result['kernel_functions_over_80_lines'])} in kernel modules)")
    for f in result["functions_over_80_lines"]:
        print(f"    {f}")
    print(f"refs.pop(0) calls: {result['refs_pop_calls']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
