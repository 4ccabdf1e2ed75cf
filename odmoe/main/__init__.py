"""Main: the decode loop and the data path to the workers.

Main holds everything of the model but the routed experts (embeddings, attention and its K/V cache,
norms, routers, shared experts, lm_head) and runs every request's forward passes. `engine` is the
loop: it admits requests (`request_queue`), prefills them, and decodes every running request one
token per iteration in lockstep (`odmoe.lockstep`), each exactly as if it ran alone (`request_run`: its
tokens, sampling and stop strings; `sampling`, `stop_strings`). At each MoE layer the model calls
`remote_experts.RemoteExperts`: split the rows by expert, place them on the workers the shadow's
prediction preloaded (`placement` rules, over the live workers `membership` tracks), send, take,
combine — the same sums transformers would make. Observers (`exchange_observers`) count what it
cost (`expert_traffic`, reported by `run_stats`) without touching it. `shadow_link` is main's end
of the shadow: predictions in (`recall` scores them), tokens and K/V rows out on the alignment
plan (`alignment`). `inprocess` builds the same engine with workers in this process (tests).
"""
