"""Tensor parallelism: `state.py` (process groups under torchrun, `ParallelState`), `step_plan.py`
(rank 0's step plans, replayed by the other ranks)."""
