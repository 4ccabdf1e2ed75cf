"""odmoe's benchmark suites (installed as `odmoe.benchmarks`, run with `odmoe-bench suite=NAME`).

Every performance claim of odmoe comes from here: each suite prints its figures, writes them to JSON
under `results_dir` and draws the picture people read. The single-purpose scripts beside this file
(`prefill.py`, `decode_vs_reference.py`, `simulate.py`, `netns_lan.py`, `plot_alignment.py`) run as
plain scripts.
"""
