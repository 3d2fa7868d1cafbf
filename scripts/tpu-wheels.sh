#!/usr/bin/env bash
# Download, into a folder (default .whl-tpu), the pure-Python wheels a TPU machine without a package
# index needs to run stellax from a checkout, and with --peers those of the optional peers the chip
# benchmarks compare against (tokamax and its dependencies). Python 3.11, manylinux x86_64.
# On the TPU machine:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl-tpu/*.whl
#   export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD/src      # append: the machine's jax stays first
# flax and optax (stellax.nn and benchmarks/model_step.py; tokamax's qwix needs flax and opt_einsum) are in
# a TPU VM's own index when it has one: pip install --target /tmp/site2 flax optax opt_einsum, then
# /tmp/site2 last on PYTHONPATH, so that the jax pip brings along stays hidden.
set -euo pipefail
dest=.whl-tpu
peers=0
for arg in "$@"; do
  case "$arg" in
    --peers) peers=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) dest="$arg" ;;
  esac
done
names=(rich markdown-it-py mdurl pygments flatbuffers)
if [ "$peers" = 1 ]; then
  names+=(tokamax==0.0.12 absl-py einshape jaxtyping wadler-lindig pydantic pydantic-core annotated-types
          typing-inspection qwix tqdm typeguard==2.13.3 immutabledict tensorboardx protobuf typing_extensions)
fi
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${names[@]}"
ls "$dest"
