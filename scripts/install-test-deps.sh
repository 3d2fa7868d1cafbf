#!/usr/bin/env bash
# Install everything the default test tier needs into the active virtual
# environment (`.ci/run` and the README's test command both call this).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
# The CPU build of torch first (a plain `torch` requirement would pull a CUDA build).
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test,torch,transformers,bench,lab,tpu-check]"
# The integration extras (torchax, Flax NNX, Tunix) without moving the pins of
# jax, torch and transformers: Tunix pins safetensors<0.8, which would
# downgrade transformers, so these go in without their dependencies and the
# runtime dependencies their imports need are added under constraints.
python -m pip install --quiet --no-deps torchax==0.0.13 flax==0.12.8 google-tunix==0.1.7 google-metrax==0.2.4 \
  clu qwix
pins="$(mktemp)"
python - > "$pins" <<'PY'
import importlib.metadata as md
for name in ("jax", "jaxlib", "torch", "transformers"):
    print(f"{name}=={md.version(name)}")
PY
python -m pip install --quiet -c "$pins" msgpack optax orbax-checkpoint tensorstore PyYAML treescope tensorboardx \
  ml_collections wrapt "etils[epath]" jaxtyping sentencepiece perfetto pandas
rm -f "$pins"
