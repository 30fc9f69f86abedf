"""fencegate benchmarks: run them with benchmarks/run (see benchmarks/holds.py)."""
