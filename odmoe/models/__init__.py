"""Models: a Hugging Face MoE checkpoint as odmoe reads it and main runs it.

`families` is the one table of what differs between model families (expert key names, renames);
`checkpoint` reads the config and hands out main's tensors or one expert's, never the whole file;
`load_dtypes` gives each tensor the dtype from_pretrained would. `main_model` builds transformers'
own model without its routed experts, whose calls go to the workers; `expert_math` is the expert
MLP and the top-k combine, bit-exact to transformers' kernels, used by the workers and main alike.
`kv_rows` reads and writes a request's cache rows (what aligning a shadow copies, per layer kind).
"""
