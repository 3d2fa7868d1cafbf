"""Framework integrations: stellax kernels inside other JAX frameworks'
models (`stellax.integrations.tunix`). Each is an optional extra and imports
its framework only when used."""
