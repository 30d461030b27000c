"""Tensor parallelism: `state.py` (process groups under torchrun, `ParallelState`), `step_plan.py`
(rank 0's step plans and their publisher), `follower.py` (the other ranks, which replay them)."""
