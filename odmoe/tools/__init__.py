"""Tools: making models, measuring, emulating.

`model_factory` and `training` make the small checkpoints the tests, the demo (`demo_corpus`, built
from `corpora`) and the benchmarks run on; `gguf_export` writes them as GGUF files, `fp8_checkpoint`
and `mxfp4_checkpoint` as the quantized releases are stored (both through `rewrite_checkpoint`);
`model_names` resolves the names odmoe makes (demo, tiny, trained...) to directories. `profiling`
records routers' statistics for the lossy policies and the cache; `pipeline_sim` models the decode
pipeline's timing; `trace` writes the timeline spans; `faults` makes a node fail at an exact point
and `link_relay` makes its link slow, jittery or silent (tests, benchmarks); `memory` parses sizes
and reads peak memory.
"""
