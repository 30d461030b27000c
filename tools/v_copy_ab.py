"""`runtime.bench` with the fresh prefill's v copied (lever 101) or left a view (the default since the
thirty-fourth session), for an A/B in the engine on one machine:

    python3 tools/v_copy_ab.py --copy-v hal=cuda weights=random model=ouro-1.4b 'workload=[prefill8k]'
    python3 tools/v_copy_ab.py hal=cuda weights=random model=ouro-1.4b 'workload=[prefill8k]'

Every argument but `--copy-v` goes to runtime.bench. The copy is forced by wrapping
`hal.kernels.rotary_kv.rotary_kv_write`, which the Triton backend looks up at each call.
"""
import runpy
import sys

import hal.kernels.rotary_kv as rotary_kv


def main() -> None:
    args = sys.argv[1:]
    if "--copy-v" in args:
        args.remove("--copy-v")
        plain = rotary_kv.rotary_kv_write

        def copying(*a, **kw):
            kw["copy_v"] = True
            return plain(*a, **kw)
        rotary_kv.rotary_kv_write = copying
    sys.argv = ["runtime.bench", *args]
    runpy.run_module("runtime.bench", run_name="__main__")


if __name__ == "__main__":
    main()
