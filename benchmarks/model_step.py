"""Training steps of a dense and a hybrid-MoE decoder on one chip: stellax's kernels against plain JAX.

The benchmark is `stellax.bench.model_train` (its docstring has the models, the FLOP count and the
options); this script runs it from a source checkout, as ``stellax bench model train`` does when
installed:

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/model_step.py --out $OUT/model_step.json
"""

import sys

from stellax.bench.model_train import main

if __name__ == "__main__":
    sys.exit(main())
