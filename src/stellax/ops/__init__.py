"""Op families. Each folder: api (public functions), reference (golden), xla, kernels, configs."""
