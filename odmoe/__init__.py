"""odmoe: lossless distributed Mixture-of-Experts inference on edge clusters (OD-MoE).

Public API: `Client` (talk to a running cluster) and `LocalCluster` (start one on this machine).
"""

__all__ = ["Client", "GenerateResult", "LocalCluster", "Piece"]


def __getattr__(name: str):
    # Loaded on first use so that `import odmoe.<anything>` stays light: a Ray actor importing
    # odmoe.launch.ray_node must not pay for torch (odmoe.serving.client's sampling imports it).
    # LocalCluster lives in odmoe.launch (it owns processes and reads Hydra configs, which library
    # code must not), so imports still flow one way.
    if name in ("Client", "GenerateResult", "Piece"):
        from odmoe.serving import client

        return getattr(client, name)
    if name == "LocalCluster":
        from odmoe.launch.local_cluster import LocalCluster

        return LocalCluster
    raise AttributeError(name)
