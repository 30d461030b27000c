"""Requests and their bookkeeping, free of device code: `llm_engine.py` (`LLMEngine`: the step,
sync and async), `engine_requests.py` (add_request / abort / outputs, which `LLMEngine` inherits),
`scheduler.py` (continuous batching, chunked prefill, preemption, priorities), `request_queues.py`
(the scheduler's queues between steps: add, fork, finish), `step_schedule.py` (a step's schedule as
data), `kv_cache.py` (paged blocks, one table per KV plane), `prefix_cache.py`, `swap.py`,
`sequence.py` (request state), `outputs.py`."""
