"""odmoe's benchmark suites (installed as `odmoe.benchmarks`, run with `odmoe-bench suite=NAME`).

Every performance claim of odmoe comes from here: each suite prints its figures, writes them to JSON
under `results_dir` and draws the picture people read. The two scripts beside this file that no suite
covers (`simulate.py`, `netns_lan.py`, which needs root) run as plain scripts.
"""
