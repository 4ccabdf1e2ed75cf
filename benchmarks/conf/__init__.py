# odmoe-bench's Hydra config root (its own, so its keys never collide with odmoe-launch's groups).
