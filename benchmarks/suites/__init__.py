"""One module per `odmoe-bench` suite; each exposes `run(cfg, model_path, results_dir)`."""
