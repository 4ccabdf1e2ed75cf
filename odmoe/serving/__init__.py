"""Serving: how users reach the cluster.

The gRPC door is `odmoe.nodes.main`; `http_api` is the OpenAI-compatible one (completions, chat,
streaming, logprobs shaped by `openai_logprobs`), whose request bodies are `http_bodies`. Both map
errors to statuses through one table (`error_status`) and export Prometheus metrics (`metrics`).
`client` is the Python client of the gRPC door (`odmoe.Client`), with failover along main's
standbys (`main_ring`: which main its threads use). `text_check` refuses text that is not valid
Unicode at both doors. `lm_eval_backend` is the evaluation harness's side: lm-eval's
`local-completions`, summing log-likelihoods as its `hf` does.
"""
