"""odmoe's benchmark suites (installed as `odmoe.benchmarks`, run with `odmoe-bench suite=NAME`).

Every performance claim of odmoe comes from here: each suite prints its figures, writes them to JSON
under `results_dir` and draws the picture people read. The older one-off scripts beside this file
(`shadow.py`, `prefill.py`, `decode_vs_reference.py`, `simulate.py`) still run as plain scripts.
"""
