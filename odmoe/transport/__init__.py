"""Transport: what travels between nodes, and who may send it.

`messages` are the typed messages of the data and control planes; `codec` turns one into ZeroMQ
frames (a msgpack header and raw tensor frames) and back, refusing anything malformed — every
frame is untrusted, and what does not decode is dropped with a rate-limited line (`dropped`).
`security` gives nodes CurveZMQ keys and clients TLS and a token; `heartbeat` notices a peer that
died or froze, and main's UDP `beats` to each worker, judged by `suspicion` (phi accrual), notice a
silent link; `announce` is how a (re)started worker or shadow tells main where it now serves.
`join_link` is the one line a box joins by, `lan_discovery` finds main by mDNS instead, and
`share_server` serves a checkpoint's bytes to the nodes that lack them.
"""
