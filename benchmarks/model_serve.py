"""Serving the dense model on one chip: prefill and greedy decode with stellax's paged KV cache
against plain JAX with a dense KV cache.

The benchmark is `stellax.bench.model_serve` (its docstring has the cases and the options); this
script runs it from a source checkout, as ``stellax bench model serve`` does when installed:

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/model_serve.py --out $OUT/model_serve.json
"""

import sys

from stellax.bench.model_serve import main

if __name__ == "__main__":
    sys.exit(main())
