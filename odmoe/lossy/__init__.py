"""Lossy miss policies: opt-in, never the default.

By default a wrong prediction is repaired by loading the right expert (exact). A user may instead
let main compute a resident expert in place of a missed one (`miss_policy`: BuddyMoE's buddies or
importance-driven low-score swaps, within a per-token budget); `substitution` decides per layer
on the router's scores. Every response computed so says exact=false and how many substitutions.
"""
