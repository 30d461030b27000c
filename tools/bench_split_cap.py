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
(`hal.kernels.attend.launches_for(mixed=)`). SIDE=1 (CUDA, an experiment for lever 113's next step) runs a
mixed step's row launch on a side stream, a parallel branch of the captured graph, beside the chunks'
launch, which in one stream's PDL chain it waits for though it needs nothing of it (measured on an H100
in the forty-sixth session: -1.4% on the 64 x 1K burst at 2,048, so not built into the engine)."""
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

if os.environ.get("SIDE", "0") == "1":
    import torch

    from hal.kernels import attend, backend
    from hal.kernels.launch import run_launch

    _side_streams = {}

    def _side_by_side(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale, configs,
                      num_compute_units, kv_scales=None, new_kv=None, mixed=False):
        if not mixed or q.device.type != "cuda":
            return attend.paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
                                          scale, configs, num_compute_units, kv_scales, new_kv, mixed)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        launches = attend.launches_for(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                                       configs, num_compute_units, out, kv_scales, new_kv, mixed)
        current = torch.cuda.current_stream(q.device)
        side = _side_streams.setdefault(q.device, torch.cuda.Stream(q.device))
        side.wait_stream(current)                  # the cache this step wrote, q
        with torch.cuda.stream(side):
            for launch in launches[1:]:            # the one-token rows (the row kernel)
                run_launch(launch)
        run_launch(launches[0])                    # the chunks (the prefill config)
        current.wait_stream(side)                  # the next layer reads both halves of `out`
        return out

    backend.paged_attention = _side_by_side

from runtime import bench  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "runtime.bench"
    bench.main()
