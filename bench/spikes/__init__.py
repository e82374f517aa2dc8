"""Spikes: one-off measurements that informed a design decision (not benchmarks kept
green). Run each as ``python -m bench.spikes.<name>``; bench/README.md has what each
measured and the decision it led to."""
