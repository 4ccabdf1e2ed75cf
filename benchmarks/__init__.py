"""odmoe's benchmark suites: the odmoe-bench distribution beside odmoe (benchmarks/pyproject.toml,
`pip install -e ./benchmarks`; import name `odmoe_bench`), run with `odmoe-bench suite=NAME`.

Every performance claim of odmoe comes from here: each suite prints its figures, writes them to JSON
under `results_dir` and draws the picture people read. The two scripts beside this file that no suite
covers (`simulate.py`, `netns_lan.py`, which needs root) run as plain scripts.
"""
