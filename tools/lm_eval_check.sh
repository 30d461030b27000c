#!/usr/bin/env bash
# lm-eval's local-completions against runtime.serve on the packaged ouro-tiny (tools/lm_eval_check.py):
# a loglikelihood task and a generate_until task, the loglikelihoods checked against the offline
# engine to 1e-4. lm-eval gets its own venv (~800 MB with datasets and scikit-learn), made once:
#   LOOPSTACK_LMEVAL_VENV=/path bash tools/lm_eval_check.sh   (default: .venv-lmeval in the checkout)
# Not part of .ci/run (the install alone is minutes of downloads); run it when serving or sampling changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LOOPSTACK_LMEVAL_VENV:-$PWD/.venv-lmeval}"
if [ ! -x "$VENV/bin/lm_eval" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q 'lm-eval[api]==0.4.13'
fi
python tools/lm_eval_check.py --venv "$VENV" "$@"
