"""`odmoe-launch`: the Hydra entry point for every role.

    odmoe-launch role=local prompt="def f(x):" max_new_tokens=32   # whole cluster on this machine
    odmoe-launch role=worker worker.index=0 model.path=DIR cluster=lan_example
    odmoe-launch role=main model.path=DIR cluster=lan_example

Exit codes: 0 success, 2 bad configuration or input, 1 anything else (the message says which node).
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from odmoe.launch.settings import to_config

log = logging.getLogger("odmoe.launch")


@hydra.main(config_path="pkg://odmoe.conf", config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    try:
        cfg = to_config(raw)
    except ValueError as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    # bitsandbytes warns on every CPU int8 matmul (an int8 shadow) that it casts inputs to fp16
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if cfg.cluster.torch_threads > 0:
        import torch

        torch.set_num_threads(cfg.cluster.torch_threads)
    from odmoe.launch.roles import run_local, run_main, run_shadow, run_worker

    roles = {"local": run_local, "main": run_main, "worker": run_worker, "shadow": run_shadow}
    overrides = list(HydraConfig.get().overrides.task)
    code = roles[cfg.role.name](cfg, overrides)
    if code:  # returning (not exiting) on success lets a -m multirun go on to its next job
        sys.exit(code)


if __name__ == "__main__":
    main()
