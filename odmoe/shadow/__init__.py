"""Shadow: the quantized copy of the model that runs ahead and says which experts main will need.

`predictor` is the shadow without its sockets: main's Begin / Align / End in, predictions and
reports out through one callback; the process around it is `odmoe.nodes.shadow`. `shadow_model`
builds the whole model at a lower precision (bf16/fp16, INT8, NF4, dynamic INT8; the layers are
`quantized_linear`) and steps it;
`router_tap` reads each MoE layer's router as it runs (the top-k, and near-ties as `hedging`
hedges) — the same tap the lossy policies and benchmarks use — and `choices` makes one prediction
per step from every request's choice. `shadow_batch` keeps one shadow sequence per running request;
`shadow_run` is one request's alignment with main, `speculation` what lets it run ahead without
waiting for main and roll back when main's token differs. Alignment (main's tokens and K/V rows, or
a hybrid layer's recurrent state, given to the shadow) is main's plan (`odmoe.main.alignment`).
`made_wrong` makes the shadow wrong on purpose, for tests and benchmarks only.
"""
