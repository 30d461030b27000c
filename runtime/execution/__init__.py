"""Running a scheduled step on the device: `runner.py` (the model, its KV tensors, execute),
`eager_pass.py` (packed steps and wavefront segments, which the runner inherits), the step's inputs
and attention context, `graphs.py` (captured steps), `loops.py` (depth and early exit),
`sampler.py`, `async_step.py` (tokens read back one step late), `quantization.py`, `reference.py`
(the simple one-sequence path: the oracle)."""
