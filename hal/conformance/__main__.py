"""`python -m hal.conformance hal=<name> [only=check1,check2] [attention_backend=NAME]`: run the
conformance checks and print the versions, one line per check, and the acceptance level reached
(R0 smoke .. R3 numerics, see `report.py`); exit status 1 if any check fails. The R3 check runs the
golden cases through the engine: it comes from the installed runtime (`checks.engine_checks`), or
run `python -m runtime.conformance`, which passes it in.

(A tiny key=value parser instead of Hydra, so a vendor engineer can run this with nothing but torch.)
"""
from __future__ import annotations

import logging
import platform
import sys

import torch

import hal
from hal.conformance.checks import CHECKS, engine_checks, run_all
from hal.conformance.report import format_levels, level_statuses, versions


def main(argv: list[str], extra: dict | None = None, program: str = "hal.conformance") -> int:
    checks = {**CHECKS, **(engine_checks() if extra is None else extra)}
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    keys = ("hal", "only", "device_index", "attention_backend")
    usage = (f"usage: python -m {program} hal=<{'|'.join(['auto', *hal.names()])}> [only=a,b] "
             f"[device_index=N] [attention_backend=NAME]")
    if any(a in ("--help", "-h") for a in argv):
        print(usage + f"; checks: {', '.join(checks)}")
        return 0
    unknown = [a for a in argv if "=" not in a or a.split("=", 1)[0] not in keys]
    if unknown:
        print(f"{usage}; not understood: {' '.join(unknown)}", file=sys.stderr)
        return 2
    only = [c for c in args.get("only", "").split(",") if c] if "only" in args else None
    if only is not None and (not only or set(only) - set(checks)):
        print(f"error: only= takes check names, got {args['only']!r}; the checks: {', '.join(checks)}",
              file=sys.stderr)
        return 2
    if not args.get("device_index", "0").isdigit():
        print(f"error: device_index= takes a device number (0, 1, ...), got {args['device_index']!r}",
              file=sys.stderr)
        return 2
    name = args.get("hal", "auto")
    # the Hal's decisions (attention backend per shape, mapped or staged host buffers) with reasons
    logging.basicConfig(level=logging.WARNING, format="log: %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("hal").setLevel(logging.INFO)
    print("versions: " + " ".join(f"{k}={v}" for k, v in versions().items()))
    try:
        options = {"device_index": int(args["device_index"])} if "device_index" in args else {}
        if "attention_backend" in args:
            options["attention_backend"] = args["attention_backend"]
        instance = hal.get(name, **options)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        print("acceptance level: none (the Hal did not construct)")
        return 2
    caps = instance.caps
    print(f"hal={instance.name} device={instance.device()} arch={caps.arch} torch={torch.__version__} "
          f"python={platform.python_version()}")
    print(f"caps: {caps}")
    vendor_versions = instance.versions()
    if vendor_versions:
        print(f"{instance.name} versions: " + " ".join(f"{k}={v}" for k, v in vendor_versions.items()))
    results = run_all(instance, only, checks)
    for r in results:
        print(f"{r.status:4s}  {r.name}" + (f"\n      {r.detail}" if r.detail else ""))
    failed = [r.name for r in results if r.status == "FAIL"]
    passed = sum(r.status == "PASS" for r in results)
    print(f"{passed}/{len(results)} passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    for line in format_levels(level_statuses(results, list(dict.fromkeys([*checks, "golden_greedy"])))):
        print(line)
    if "golden_greedy" not in checks:
        print("(R3 runs the golden cases through the engine: install loopstack, or run "
              "python -m runtime.conformance)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
