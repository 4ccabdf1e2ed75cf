"""odmoe: lossless distributed Mixture-of-Experts inference on edge clusters (OD-MoE).

Public API: `Client` (talk to a running cluster) and `LocalCluster` (start one on this machine).
"""

from odmoe.client import Client, GenerateResult, Piece

__all__ = ["Client", "GenerateResult", "LocalCluster", "Piece"]


def __getattr__(name: str):
    # LocalCluster lives in odmoe.launch (it owns processes and reads Hydra configs, which library
    # code must not); it is loaded lazily so `import odmoe` stays light and imports flow one way.
    if name == "LocalCluster":
        from odmoe.launch.local_cluster import LocalCluster

        return LocalCluster
    raise AttributeError(name)
