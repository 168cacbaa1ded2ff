"""Genie's benchmarks: small CLIs that print a table and write JSON under bench/results/."""
