"""Vendor-neutral checks any Hal must pass: `python -m hal.conformance hal=<name>`, or from pytest."""
from hal.conformance.checks import CHECKS, CheckResult, run_all

__all__ = ["CHECKS", "CheckResult", "run_all"]
