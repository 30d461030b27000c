"""`runtime.bench` with the caps on the prompt chunks a step splits into captured prefills set from the
environment, for measuring them (docs/benchmarks.md, thirty-ninth and forty-first sessions):

    CAP=0 python tools/bench_split_cap.py hal=cuda weights=random model=ouro-1.4b 'workload=[b64short]' \\
        workloads.b64short.new=16 engine.max_num_batched_tokens=512

CAP=0 splits no step (every step of prompt chunks runs one eager pass); CAP=N splits steps of up to N
chunks (`runtime.execution.captured_steps.MAX_SPLIT_PROMPTS`, default 8) and TOKENS=M steps of up to M
prompt tokens (`MAX_SPLIT_TOKENS`, default 1024). PACKED=0 runs the steps past those caps through the
eager pass instead of a packed captured pass (runtime/execution/packed_steps.py: lever 109's A/B).
LONE=0 restores the steps of one prompt chunk as they ran before lever 110 (lever 110's A/B): a lone
chunk that is not its prompt's last splits up to the caps, else runs eagerly, and one chunk beside
decodes splits only up to TOKENS (not `MAX_SPLIT_TOKENS_ONE_CHUNK`). MIXED=0 sends the decode rows of
mixed steps (eager or packed) through the prefill config with their chunks again, as before lever 113
(`hal.kernels.attend.launches_for(mixed=)`)."""
import os
import sys

from runtime.execution import captured_steps
from runtime.execution.runner import ModelRunner

captured_steps.MAX_SPLIT_PROMPTS = int(os.environ.get("CAP", captured_steps.MAX_SPLIT_PROMPTS))
captured_steps.MAX_SPLIT_TOKENS = int(os.environ.get("TOKENS", captured_steps.MAX_SPLIT_TOKENS))
if os.environ.get("PACKED", "1") == "0":
    ModelRunner.packed_step = lambda self, scheduled: None
if os.environ.get("LONE", "1") == "0":
    _prefill_bucket = ModelRunner.prefill_bucket

    def _last_chunk_only(self, scheduled):
        return _prefill_bucket(self, scheduled) if len(scheduled) == 1 and scheduled[0].samples else None

    ModelRunner.prefill_bucket = _last_chunk_only
    captured_steps.MAX_SPLIT_TOKENS_ONE_CHUNK = captured_steps.MAX_SPLIT_TOKENS

if os.environ.get("MIXED", "1") == "0":
    from hal.kernels import attend

    _launches_for = attend.launches_for

    def _unmixed(*args, mixed=False, **kwargs):
        return _launches_for(*args[:12], **kwargs)

    attend.launches_for = _unmixed

from runtime import bench  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "runtime.bench"
    bench.main()
