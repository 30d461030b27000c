"""lm-eval's local-completions against runtime.serve (tools/lm_eval_check.py): a loglikelihood and a
generate_until task, loglikelihoods equal to the offline engine's to 1e-4. lm-eval needs its own
venv (~800 MB); the test runs where one exists (LOOPSTACK_LMEVAL_VENV, or .venv-lmeval made by
tools/lm_eval_check.sh) and skips elsewhere, CI included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from zoo.resolve import packaged_checkpoint

VENV = Path(os.environ.get("LOOPSTACK_LMEVAL_VENV", ROOT / ".venv-lmeval"))


@pytest.mark.slow
@pytest.mark.skipif(not (VENV / "bin" / "lm_eval").exists(),
                    reason=f"no lm-eval venv at {VENV}: make one with tools/lm_eval_check.sh")
@pytest.mark.skipif(packaged_checkpoint("ouro-tiny") is None, reason="the packaged ouro-tiny is not installed")
def test_lm_eval_loglikelihoods_equal_the_offline_engine(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "lm_eval_check.py"), "--venv", str(VENV),
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert report["loglikelihood_requests"] >= 18 and report["max_abs_diff_vs_offline"] <= 1e-4
    assert report["generate_until_exact_match_vs_offline_greedy"] == 1.0
