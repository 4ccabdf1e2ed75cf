"""Worker: where the routed experts rest, and how one gets onto the device just in time.

A worker stores the experts of the layers it may serve (`share` decides which, before anything is
read; `expert_store`: in host memory, compressed losslessly per ZipMoE (`compressed_tensor`,
`bitfields`, `expert_pack`, `expert_sources`), or read from disk per load) and a few device slots
(`device_slots` on CUDA). The shadow's predictions say what main will ask for next;
`preload_schedule` decides, as a pure state machine, which prediction to load into which slot and
when (confident ones first, hedges in spare slots), and what to drop when main moves on.
`expert_cache` decides which experts stay on the device after use (the cluster's spare memory as a
cache steered by the same predictions). `executor` applies these decisions to the slots and
computes each request (several requests' rows of one expert in one call: `stacked_segments`),
message in, answer out, with no socket; the socket loop around it is `odmoe.nodes.worker`, and
main's in-process workers run it as is.
"""
