"""The user-facing layer: the `remote_accelerator` device, LazyTensor capture,
factory kernels and materialization. It hands encoded ops to genie.runtime."""
