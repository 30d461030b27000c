"""runtime.bench's profilers of the benchmark loop: `profile_prefill=true` (a cell's prefill steps) and
`profile=N` (decode steps) print torch's table and the compact kernel list; the warmup pass is not
profiled and a profiled prefill says so in its row."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers import golden_case, single_thread  # noqa: F401 (fixture)
from torch.autograd import DeviceType

from runtime.bench_profile import PROFILE_FROM_STEP, kernel_summary


def test_bench_profiles_the_prefill_and_decode_steps(capsys, single_thread):
    from hydra import compose, initialize_config_dir

    from runtime.bench import run
    from runtime.generate import CONF_DIR

    new = PROFILE_FROM_STEP + 4                      # enough decode steps for profile=2 to start and stop
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["hal=cpu", f"model.path={golden_case('ouro-tiny').path}",
                                          "weights=checkpoint", "model.dtype=float32", "workload=tiny",
                                          f"workloads.tiny.new={new}", "matmul_size=64",
                                          "engine.num_kv_blocks=64", "warmup=true", "profile=2",
                                          "profile_prefill=true"])
    (row,) = run(cfg)
    out = capsys.readouterr().out
    assert out.count("===== profile of the prefill of the benchmark loop") == 1      # the measured pass only
    assert out.count("===== profile of 2 decode steps of the benchmark loop") == 1
    prefill = out.split("===== profile of the prefill")[1].split("===== profile of 2 decode")[0]
    assert "aten::mm" in prefill and "Self CPU time total" in prefill                # torch's table has rows
    summary = prefill.split("----- host ops by self CPU time")[1].splitlines()
    assert summary[1].split() == ["kernel", "count", "total", "ms", "share"]
    assert any(line.startswith("aten::mm") and line.endswith("%") for line in summary[2:])
    assert row["profiled_prefill"] is True and row["prefill_tok_s"] > 0
    # the floor over the copy rate measured here, beside the issues' H200 one: this CPU is far slower
    assert 0 < row["copy_tb_s"] < 4.27 and row["decode_vs_measured_floor"] <= row["decode_vs_floor"]
    assert json.loads(out.strip().splitlines()[-1]) == row                            # the printed JSON row


def test_kernel_summary_sums_device_kernels_by_name_prefix():
    """The CUDA path on fake events: device kernels only (host ops dropped), names cut to 60
    characters and summed, shares of the device time, sorted by time."""
    def event(key, count, us, device=DeviceType.CUDA, cpu_us=0):
        return SimpleNamespace(key=key, count=count, device_type=device, self_device_time_total=us,
                               self_cpu_time_total=cpu_us)

    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
    events = [event(gemm + "a", 96, 50_000), event(gemm + "b", 24, 10_000),
              event("_fresh_attention", 96, 30_000), event("Memcpy DtoD (Device -> Device)", 4, 10_000),
              event("aten::mm", 120, 0, DeviceType.CPU, 9_000)]
    lines = kernel_summary(events, "the prefill", wall_ms=200.0)
    assert lines[0] == ("----- device kernels of the prefill: 100.000 ms busy over 200.000 ms wall, "
                        "220 launches")
    first = lines[2].split()
    assert lines[2].startswith(gemm[:60]) and first[-3:] == ["120", "60.000", "60.0%"]
    assert lines[3].split()[0] == "_fresh_attention" and lines[3].endswith("30.0%")
    assert len(lines) == 5 and not any("aten::mm" in line for line in lines)


def test_timeline_summary_finds_the_host_lead_and_the_idle_gaps():
    """Fake events on one clock (us): host 0-1000; kernels 100-200, 201-300 (a 1 us gap), 350-400
    overlapped by 360-500 on another stream, then 650-700 (150 us idle): lead 0.1 ms, span 0.6 ms,
    idle 0.201 ms, tail 0.3 ms."""
    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("step", 0, 1000, DeviceType.CPU), event("gemm", 100, 200), event("norm", 201, 300),
              event("attn", 350, 400), event("copy", 360, 500), event("gemm", 650, 700)]
    from runtime.bench_profile import timeline_summary

    lines = timeline_summary(events, "the prefill")
    assert lines[0] == ("----- timeline of the prefill: host lead 0.100 ms before the first kernel, device span "
                        "0.600 ms, idle inside it 0.201 ms in 3 gaps, host tail 0.300 ms after the last kernel")
    assert lines[1].split()[-4:] == ["1", "gaps,", "0.001", "ms"]          # 0-2 us
    assert lines[3].split()[-4:] == ["1", "gaps,", "0.050", "ms"]          # 10-100 us
    assert lines[4].split()[-4:] == ["1", "gaps,", "0.150", "ms"]          # >= 100 us
    assert lines[5].split()[:4] == ["150.0", "us", "between", "copy"] and lines[5].endswith("-> gemm")
    assert timeline_summary([event("step", 0, 10, DeviceType.CPU)], "x") == \
        ["----- timeline of x: no device kernels profiled"]


def test_bench_refuses_a_workload_longer_than_the_model_before_measuring(single_thread, monkeypatch):
    """The golden ouro-tiny holds 256 positions: prefill8k is refused with the fix, before the matmul
    rate is measured or a cell runs."""
    from hydra import compose, initialize_config_dir

    import pytest

    import runtime.bench as bench
    from runtime.generate import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["hal=cpu", f"model.path={golden_case('ouro-tiny').path}",
                                          "weights=checkpoint", "model.dtype=float32", "workload=prefill8k"])
    with pytest.raises(ValueError, match=r"workload prefill8k needs 8209 positions and ouro-tiny has 256: .*"
                                         r"workloads\.prefill8k\.prompt="):
        bench.run(cfg)
    measured = []
    monkeypatch.setattr("runtime.roofline.measure_matmul_rate", lambda *a, **k: measured.append(1) or 1e12)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        both = compose("bench", overrides=["hal=cpu", f"model.path={golden_case('ouro-tiny').path}",
                                           "weights=checkpoint", "model.dtype=float32", "workload=[tiny,prefill8k]"])
    with pytest.raises(ValueError, match="workload prefill8k needs"):        # before the tiny cell runs
        bench.run(both)
    assert not measured


@pytest.mark.parametrize("override,message", [("output=/nonexistent/folder/rows.jsonl", "output=.* cannot be written"),
                                               ("output=.", "output=. cannot be written"),
                                               ("profile=-1", "profile must be an integer >= 0")])
def test_bench_refuses_a_bad_output_or_profile_before_building_a_model(override, message, monkeypatch):
    """The rows are appended to `output=` as each cell finishes: a path that cannot be written is
    refused before any cell runs, as is a negative `profile=`."""
    from hydra import compose, initialize_config_dir

    import runtime.bench as bench
    from runtime.generate import CONF_DIR

    monkeypatch.setattr(bench, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["hal=cpu", "workload=tiny", override])
    with pytest.raises(ValueError, match=message):
        bench.run(cfg)


def test_bench_keeps_a_given_max_model_len_and_refuses_one_shorter_than_a_cell(single_thread, monkeypatch):
    """engine.max_model_len set: every cell runs at it (a serve user's default table width), and a cell
    that needs more positions is refused by name before anything is measured."""
    from hydra import compose, initialize_config_dir

    import runtime.bench as bench
    from runtime.generate import CONF_DIR

    monkeypatch.setattr("runtime.roofline.measure_matmul_rate", lambda *a, **k: 1e12)
    base = ["hal=cpu", f"model.path={golden_case('ouro-tiny').path}", "weights=checkpoint", "model.dtype=float32",
            "workload=tiny", "warmup=false", "engine.num_kv_blocks=64"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        short = compose("bench", overrides=[*base, "engine.max_model_len=30"])
        given = compose("bench", overrides=[*base, "engine.max_model_len=256"])
        own = compose("bench", overrides=base)
    with pytest.raises(ValueError, match=r"workload tiny needs 40 positions and engine.max_model_len=30: raise it"):
        bench.run(short)
    assert [row["max_model_len"] for row in bench.run(given)] == [256]
    assert [row["max_model_len"] for row in bench.run(own)] == [40]


def test_the_warmup_captures_what_a_late_prompt_replays(single_thread, monkeypatch):
    """A cell with a late prompt: the warm-up brings one of the same length, so the passes its chunks
    replay are captured before the timed cell (graphs on; the CPU captures on first use)."""
    from hydra import compose, initialize_config_dir

    import runtime.bench as bench
    from runtime.generate import CONF_DIR

    monkeypatch.setattr("runtime.roofline.measure_matmul_rate", lambda *a, **k: 1e12)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["hal=cpu", f"model.path={golden_case('ouro-tiny').path}",
                                          "weights=checkpoint", "model.dtype=float32", "workload=tiny",
                                          "+workloads.tiny.late_prompt=40", "engine.max_num_batched_tokens=32",
                                          "engine.graphs=true", "warmup=true", "engine.num_kv_blocks=64"])
    (row,) = bench.run(cfg)
    assert row["late_ttft_s"] > 0 and row["captures_in_cell"] == 0, row


def test_a_cell_with_repeats_reports_the_median_first_token_of_new_prompts(single_thread, monkeypatch):
    """`workloads.NAME.repeats=3`: the cell's prompts run three times, each time new ones (no prefix the
    first run or the warm-up had), and the row reports the median of the three first tokens with every
    sample; repeats below 1, or beside a late prompt, are refused before a model is built."""
    from hydra import compose, initialize_config_dir

    import runtime.bench as bench
    from runtime.engine.llm_engine import LLMEngine
    from runtime.generate import CONF_DIR

    monkeypatch.setattr("runtime.roofline.measure_matmul_rate", lambda *a, **k: 1e12)
    prompts, real = [], LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, rid, prompt, *a, **k: prompts.append(
        (rid, tuple(prompt))) or real(self, rid, prompt, *a, **k))
    base = ["hal=cpu", f"model.path={golden_case('ouro-tiny').path}", "weights=checkpoint", "model.dtype=float32",
            "workload=tiny", "engine.num_kv_blocks=64"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=[*base, "+workloads.tiny.repeats=3"])
        zero = compose("bench", overrides=[*base, "+workloads.tiny.repeats=0"])
        late = compose("bench", overrides=[*base, "+workloads.tiny.repeats=2", "+workloads.tiny.late_prompt=40"])
    (row,) = bench.run(cfg)
    samples = row["ttft_ms_samples"]
    assert len(samples) == 3 and row["ttft_ms"] == sorted(samples)[1], row
    assert row["prefill_s"] == round(row["ttft_ms"] / 1e3, 4)
    timed = [p for rid, p in prompts if rid.startswith(("bench-0-", "bench-101-", "bench-102-"))]
    assert len(timed) == 3 * 2 and len({p for _, p in prompts}) == len(prompts)      # no prompt twice
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=r"workloads.tiny.repeats must be an integer >= 1"):
        bench.run(zero)
    with pytest.raises(ValueError, match=r"workloads.tiny has a late_prompt.*drop workloads.tiny.repeats"):
        bench.run(late)


def run_tool(*args: str) -> str:
    """`python tools/<args>` in its own process, this checkout's packages first (a script's sys.path
    starts at tools/, not at whatever the venv installed); its stdout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, f"tools/{args[0]}", *args[1:]], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("model", ["ouro-1.4b", "huginn-0125"])
def test_prefill_host_cost_tool_runs(model):
    """tools/prefill_host_cost.py (the host's part of a long prompt's step, docs/benchmarks.md) at a
    short prompt: it turns every graph replay into a no-op. Huginn's config narrows under its own
    key names."""
    out = run_tool("prefill_host_cost.py", "--model", model, "--tokens", "512", "--repeats", "2")
    assert out.startswith(f"{model}: one 512-token prompt")
    assert "then the step to the finished output" in out and "update_meta" in out


def test_decode_host_cost_tool_runs():
    """tools/decode_host_cost.py (a decode step's host work at a small and at the model's own
    max_model_len, docs/benchmarks.md) at toy sizes, every request with a repetition penalty."""
    lines = run_tool("decode_host_cost.py", "--requests", "4", "--context", "64", "--repeats", "3",
                     "--repetition-penalty", "1.1").splitlines()
    assert [line.split("max_model_len ")[1].split(":")[0] for line in lines] == ["83", "65536", "83", "65536"], lines
    assert all("(repetition penalty 1.1)" in line for line in lines[:2]), lines


def test_serve_host_cost_tool_runs():
    """tools/serve_host_cost.py (a decode step's host work behind runtime.serve's app against the
    engine driven directly, docs/benchmarks.md) at toy sizes: every stream gets all its events."""
    pytest.importorskip("uvicorn")
    # 24 tokens each: the three streams arrive a few steps apart on a loaded CI machine, and with 6 the
    # first could finish before the last began (no step with every request decoding: a CI flake)
    lines = run_tool("serve_host_cost.py", "--requests", "3", "--context", "32", "--tokens", "24").splitlines()
    assert lines[0].startswith("ouro-1.4b (one narrow layer, replays off) on cpu, 3 requests x (32 in, 24 out)")
    assert lines[1].startswith("engine driven directly: ") and lines[2].startswith("behind runtime.serve's app (asyncio): ")
    assert all("ms per decode step" in line for line in lines[1:3]), lines
    assert lines[3].startswith("the client received 75 events"), lines     # 24 tokens and [DONE] per stream


def test_v_copy_ab_forces_the_copy_and_passes_the_rest_to_the_bench(monkeypatch):
    """tools/v_copy_ab.py (lever 101's A/B in the engine): `--copy-v` makes every rotary/KV-write
    launch copy v; the other arguments reach runtime.bench as its argv."""
    import runpy
    import sys

    import hal.kernels.rotary_kv as rotary_kv
    import v_copy_ab

    seen = []

    def bench(name, run_name):
        seen.append((name, run_name, sys.argv[:]))
        rotary_kv.rotary_kv_write(copy_v=False)       # what the backend passes
    monkeypatch.setattr(runpy, "run_module", bench)
    for flag, copied in ((["--copy-v"], True), ([], False)):
        monkeypatch.setattr(rotary_kv, "rotary_kv_write", lambda *a, **kw: seen.append(kw.get("copy_v")))
        monkeypatch.setattr(sys, "argv", ["v_copy_ab.py", *flag, "hal=cuda", "workload=[prefill8k]"])
        seen.clear()
        v_copy_ab.main()
        assert seen == [("runtime.bench", "__main__", ["runtime.bench", "hal=cuda", "workload=[prefill8k]"]), copied]


def test_a_cell_whose_batch_never_fits_reports_tokens_over_time_not_a_full_batch_rate(single_thread, caplog):
    """A KV cache too small for the cell runs its requests in waves: no step decodes the whole batch,
    so the row says so and gives the tokens over the decode time (not batch / step time, which
    read 0.69x the floor for 128 x 1K on an 80 GB H100), with no step time to compare to a floor."""
    import torch

    import zoo
    from hal.cpu import CpuHal
    from runtime.bench_cell import run_cell
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine

    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype=torch.float32, device="cpu")
    cell = {"batch": 6, "prompt": 40, "new": 6}         # 6 x 3 blocks x 4 planes = 72 blocks for all
    fits = run_cell(LLMEngine(model, CpuHal(), EngineConfig(num_kv_blocks=96, max_model_len=64)), cell, None)
    assert "batch_never_full" not in fits and fits["full_batch_steps"] > 0 and fits["preemptions"] == 0
    assert fits["decode_tok_s"] == pytest.approx(6 / fits["decode_ms_step"] * 1e3, rel=1e-3)
    waves = run_cell(LLMEngine(model, CpuHal(), EngineConfig(num_kv_blocks=40, max_model_len=64)), cell, None)
    assert waves["batch_never_full"] is True and waves["full_batch_steps"] == 0 and waves["max_rows_decoded"] < 6
    assert waves["decode_ms_step"] != waves["decode_ms_step"]                  # NaN
    assert waves["decode_tok_s"] == waves["decode_tok_s_mean"] > 0
    assert "never decoded together" in caplog.text


def test_a_cell_longer_than_the_cache_names_the_cache_not_max_model_len():
    """The cell's length is the bench's own choice: its error names engine.num_kv_blocks and the cell
    (it said "set engine.max_model_len=17", which the user never set and which then failed anew)."""
    from hydra import compose, initialize_config_dir

    from runtime.bench import run
    from runtime.generate import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["hal=cpu", f"model.path={golden_case('ouro-tiny').path}",
                                          "weights=checkpoint", "model.dtype=float32", "workload=tiny",
                                          "matmul_size=64", "engine.num_kv_blocks=5"])
    with pytest.raises(ValueError, match=r"workload tiny needs \d+ positions per request, but the KV cache has 5 "
                                         r"blocks.*raise engine.num_kv_blocks"):
        run(cfg)


def test_bench_appends_each_row_as_its_cell_finishes(tmp_path, single_thread, monkeypatch):
    """`output=`: the first cell's row is in the file though the second cell fails (a device call's time
    limit cuts a run of several cells short)."""
    from hydra import compose, initialize_config_dir

    import runtime.bench as bench
    from runtime.generate import CONF_DIR

    real, calls = bench.run_cell, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("cut short")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "run_cell", second_fails)
    out = tmp_path / "rows.jsonl"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["hal=cpu", f"model.path={golden_case('ouro-tiny').path}",
                                          "weights=checkpoint", "model.dtype=float32", "warmup=false",
                                          "matmul_size=64", "workload=[tiny,b1]", "workloads.b1.prompt=8",
                                          "workloads.b1.new=2", f"output={out}"])
    with pytest.raises(RuntimeError, match="cut short"):
        bench.run(cfg)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["workload"] == "tiny" and row["decode_ms_step"] > 0


def test_tools_append_their_rows_as_json_lines(tmp_path):
    """runtime/bench_rows.py: each call appends (a device call's second tool adds to the first's file);
    no path writes nothing."""
    from runtime.bench_rows import append_rows

    out = tmp_path / "rows.jsonl"
    append_rows(str(out), [{"name": "a", "us": 1.5}])
    append_rows(str(out), iter([{"name": "b", "us": 2}, {"name": "c", "us": None}]))
    append_rows(None, [{"name": "lost"}])
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"name": "a", "us": 1.5}, {"name": "b", "us": 2}, {"name": "c", "us": None}]
