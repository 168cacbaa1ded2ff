"""Small in-repo models (random weights) and the demo; used by tests and benchmarks too."""
