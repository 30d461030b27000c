"""`runtime.bench` with the caps on the prompt chunks a step splits into captured prefills set from the
environment, for measuring them (docs/benchmarks.md, thirty-ninth and forty-first sessions):

    CAP=0 python tools/bench_split_cap.py hal=cuda weights=random model=ouro-1.4b 'workload=[b64short]' \\
        workloads.b64short.new=16 engine.max_num_batched_tokens=512

CAP=0 splits no step (every step of prompt chunks runs one eager pass); CAP=N splits steps of up to N
chunks (`runtime.execution.captured_steps.MAX_SPLIT_PROMPTS`, default 8) and TOKENS=M steps of up to M
prompt tokens (`MAX_SPLIT_TOKENS`, default 1024). PACKED=0 runs the steps past those caps through the
eager pass instead of a packed captured pass (runtime/execution/packed_steps.py: lever 109's A/B)."""
import os
import sys

from runtime.execution import captured_steps
from runtime.execution.runner import ModelRunner

captured_steps.MAX_SPLIT_PROMPTS = int(os.environ.get("CAP", captured_steps.MAX_SPLIT_PROMPTS))
captured_steps.MAX_SPLIT_TOKENS = int(os.environ.get("TOKENS", captured_steps.MAX_SPLIT_TOKENS))
if os.environ.get("PACKED", "1") == "0":
    ModelRunner.packed_step = lambda self, scheduled: None

from runtime import bench  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "runtime.bench"
    bench.main()
