"""lm-eval against `runtime.serve`: a loglikelihood (multiple-choice) task and a generate_until task
from local JSONL files, through lm-eval's `local-completions` model, on the packaged ouro-tiny; then
every loglikelihood lm-eval reports is recomputed offline with
`LLM("ouro-tiny").generate(ids, SamplingParams(prompt_logprobs=...))` and must agree to 1e-4, and
every generate_until answer must be the offline greedy text.

    bash tools/lm_eval_check.sh            # makes the lm-eval venv once, then runs this

lm-eval (and its datasets / scikit-learn dependencies, ~800 MB) lives in a venv of its own, never in
the project's; it talks to the server over HTTP only and tokenizes through the server's /tokenize
(lm-eval's "remote" tokenizer backend), so both sides use the same tokenizer.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4

# ouro-tiny was trained on Debian's fortunes and the King James Bible (docs/ouro-tiny.md)
MULTIPLE_CHOICE = [
    ("In the beginning God created the", [" heaven and the earth.", " sea and the fish.", " day and the night."], 0),
    ("And God said, Let there be", [" light: and there was light.", " bread.", " a great wind."], 0),
    ("The Lord is my shepherd; I shall not", [" want.", " sleep.", " run."], 0),
    ("Blessed are the meek: for they shall inherit the", [" earth.", " sky.", " gold."], 0),
    ("A fool and his money are soon", [" parted.", " rich.", " together."], 0),
    ("Honesty is the best", [" policy.", " river.", " chair."], 0),
]
GENERATE = ["In the beginning", "And the LORD said unto Moses,", "The meaning of life is", "A fool"]
MAX_GEN_TOKS = 12

TASKS = """\
task: loopstack_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
---
task: loopstack_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: target
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def offline_llm():
    from runtime import LLM

    return LLM("ouro-tiny", hal="cpu", dtype="float32")


def greedy_texts(llm) -> list[str]:
    """The targets of the generate_until task: the offline greedy answer, cut at the first newline."""
    from runtime import SamplingParams

    # lm-eval encodes the prompt without special tokens (through /tokenize); a text prompt would get them
    prompts = [llm.tokenizer.encode(text) for text in GENERATE]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0))
    return [out.text.split("\n")[0] for out in outs]


def write_tasks(folder: Path, targets: list[str]) -> None:
    with open(folder / "mc.jsonl", "w") as f:
        for context, choices, label in MULTIPLE_CHOICE:
            f.write(json.dumps({"context": context, "choices": choices, "label": label}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for prompt, target in zip(GENERATE, targets):
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    mc, gen = TASKS.format(data=folder, max_gen_toks=MAX_GEN_TOKS).split("---\n")
    (folder / "loopstack_mc.yaml").write_text(mc)
    (folder / "loopstack_gen.yaml").write_text(gen)


def start_server(log_path: Path) -> tuple[subprocess.Popen, int]:
    """`runtime.serve` with no model=: the packaged ouro-tiny; returns the process and its port."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", "hal=cpu", "port=0", "model.dtype=float32",
                             "server.model_name=ouro-tiny", "log_level=INFO"],
                            cwd=tempfile.gettempdir(), env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
        if match:
            return proc, int(match.group(1))
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start within 300 s")


def run_lm_eval(venv: Path, port: int, tasks: Path, out: Path) -> None:
    model_args = (f"model=ouro-tiny,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote,"
                  f"num_concurrent=2,max_retries=1,tokenized_requests=True")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "unused",
           "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(venv / "bin" / "lm_eval"), "run", "--model", "local-completions", "--model_args", model_args,
                    "--tasks", "loopstack_mc,loopstack_gen", "--include_path", str(tasks), "--log_samples",
                    "--output_path", str(out)], check=True, env=env)


def read_samples(out: Path, task: str) -> list[dict]:
    files = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    if not files:
        raise SystemExit(f"lm-eval wrote no samples for {task} under {out}")
    return [json.loads(line) for line in open(sorted(files)[-1])]


def arguments(sample: dict) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):                       # {"gen_args_0": {"arg_0": ctx, "arg_1": cont}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a[:2]) for a in args]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """As lm-eval splits a (context, continuation) pair into token ids: trailing spaces of the
    context move to the continuation, the whole is encoded and cut at the context's length."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    return whole[:len(tokenizer.encode(context))], whole[len(tokenizer.encode(context)):]


def check_loglikelihoods(llm, samples: list[dict]) -> tuple[float, int]:
    from runtime import SamplingParams

    pairs, reported = [], []
    for sample in samples:
        for (context, continuation), resp in zip(arguments(sample), sample["resps"]):
            pairs.append(encode_pair(llm.tokenizer, context, continuation))
            reported.append(float(resp[0][0]))
    outs = llm.generate([c + k for c, k in pairs], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    worst = 0.0
    for (context, _), out, value in zip(pairs, outs, reported):
        offline = sum(lp.logprob for lp in out.prompt_logprobs[len(context):])
        worst = max(worst, abs(offline - value))
    return worst, len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=os.environ.get("LOOPSTACK_LMEVAL_VENV", str(ROOT / ".venv-lmeval")))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    venv = Path(args.venv)
    if not (venv / "bin" / "lm_eval").exists():
        raise SystemExit(f"no lm-eval in {venv}: run tools/lm_eval_check.sh (it makes the venv)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    llm = offline_llm()
    write_tasks(work, greedy_texts(llm))
    server, port = start_server(work / "server.log")
    try:
        run_lm_eval(venv, port, work, work / "results")
    finally:
        server.terminate()
        server.wait(60)
    worst, count = check_loglikelihoods(llm, read_samples(work / "results", "loopstack_mc"))
    generated = read_samples(work / "results", "loopstack_gen")
    exact = [float(s.get("exact_match", 0.0)) for s in generated]
    mc = [float(s.get("acc", 0.0)) for s in read_samples(work / "results", "loopstack_mc")]
    report = {"loglikelihood_requests": count, "max_abs_diff_vs_offline": worst, "mc_acc": sum(mc) / len(mc),
              "generate_until_exact_match_vs_offline_greedy": sum(exact) / len(exact), "workdir": str(work)}
    print(json.dumps(report))
    if worst > TOLERANCE or min(exact) < 1.0:
        raise SystemExit(f"FAILED: loglikelihoods differ by {worst:.2e} (> {TOLERANCE}) or a generate_until "
                         f"answer differs from the offline greedy text")
    print("lm-eval check passed")


if __name__ == "__main__":
    main()
