"""Main: the decode loop and the data path to the workers.

Main holds everything of the model but the routed experts (embeddings, attention and its K/V cache,
norms, routers, shared experts, lm_head) and runs every request's forward passes. `engine` is the
loop: it admits requests (`request_queue`, checked against `request_limits`), and asks the pure
planner `tick_plan` who prefills, who decodes and what is admitted each tick; it decodes every
running request one token per iteration, in lockstep (`odmoe.lockstep`) or as one batched pass
(`batched_decode`), each exactly as if it ran alone (`request_run`: its tokens, sampling and stop
strings; `sampling`, `stop_strings`). At each MoE layer the model calls
`remote_experts.RemoteExperts`: split the rows by expert, place them on the workers the shadow's
prediction preloaded (`placement` rules, over the live workers `membership` tracks), exchange,
combine — the same sums transformers would make. `worker_calls` sends a layer's calls, waits and
sends again what a lost, silent or late call owed (`late_calls` says when); the records of an
exchange are `exchange_records`. Observers (`exchange_observers`) count what it cost
(`expert_traffic`, reported by `run_stats`) without touching it; `stragglers` judges which workers
are consistently slow and `straggler_steering` moves decode work away from them. `shadow_link` is
main's end of the shadow: predictions in (`recall` scores them), tokens and K/V rows out on the
alignment plan (`alignment`). `admission` is main's side of the join link (boxes handed their role,
keys and settings). `inprocess` builds the same engine with workers in this process (tests).
"""
