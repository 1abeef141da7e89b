"""mstb-sidecar: mindformers training logs to per-rank TensorBoard runs, out of process."""

__version__ = "0.1.0"
