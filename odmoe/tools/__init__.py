"""Tools: making models, measuring, emulating.

`model_factory` and `training` make the small checkpoints the tests, the demo (`demo_corpus`) and
the benchmarks run on; `model_names` resolves the names odmoe makes (demo, tiny, trained...) to
directories. `profiling` records routers' statistics for the lossy policies and the cache;
`pipeline_sim` models the decode pipeline's timing; `trace` writes the timeline spans; `faults`
makes a node fail at an exact point (tests); `memory` parses sizes and reads peak memory.
"""
