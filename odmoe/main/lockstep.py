"""Moved to `odmoe.lockstep`: the shadow's predictor (odmoe/shadow/predictor.py) steps its requests
with it too, and odmoe.shadow may not import odmoe.main (odmoe.main imports odmoe.worker, which
imports odmoe.shadow). This name stays until odmoe/main/remote_experts.py imports from there."""

from odmoe.lockstep import Failed, Finished, Lockstep, NotInTask, Outcome, Parked, in_task, park

__all__ = ["Failed", "Finished", "Lockstep", "NotInTask", "Outcome", "Parked", "in_task", "park"]
