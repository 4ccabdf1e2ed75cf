"""Models: a Hugging Face MoE checkpoint as odmoe reads it and main runs it.

`families` is the one table of what differs between model families (expert key names, renames);
`open_model` opens whatever a path names: a safetensors directory (`checkpoint`, its files read by
`safetensors_file` with plain preads) or a GGUF file set (`gguf_checkpoint`; `gguf_files` finds its
tensors, `gguf_blocks` dequantizes them); either hands out main's tensors or one expert's, never the
whole file. Quantized releases are read as published: block-wise FP8 (`fp8`) and gpt-oss's MXFP4
(`mxfp4`). `load_dtypes` gives each tensor the dtype from_pretrained would. `checkpoint_index` lists
every file's and tensor's bytes and hash, which `share_pull` uses to fetch only a node's share from
a box that has the checkpoint. `main_model` builds transformers' own model without its routed
experts, whose calls go to the workers (`cache_argument`: the name of a forward's K/V cache
argument); `expert_math` is the expert MLP and the top-k combine, bit-exact to transformers'
kernels, used by the workers and main alike. `kv_rows` reads and writes a request's cache rows (what
aligning a shadow copies, per layer kind).
"""
