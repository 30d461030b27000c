"""Measured cuBLASLt algorithm choices for decode projections (hal/cuda/blaslt.py reads them).

Key: (device name, SM count, cuBLASLt version, dtype). Value: {(M, N, K): choice}, the
choice for `y[M, N] = x[M, K] @ w[N, K]^T`: a rank of the heuristic's default list, or
`(sm_target, rank)` of its list for that SM-count target; only shapes where a choice beat F.linear,
twice, by at least 3%. Made by `python3 tools/lt_algo_probe.py --table [--sm-targets 0,112,88,66]` on
the device named (docs/benchmarks.md, twenty-ninth session), pasted here as printed.
"""
from __future__ import annotations

TABLES: dict[tuple[str, int, int, str], dict[tuple[int, int, int], int | tuple[int, int]]] = {}

# The union of two runs on H200s (calls 2 and 6 of the twenty-ninth session; the second searched the
# SM-count targets and wins where both name a shape): a win near the 3% threshold is found in one run
# and not in the other, and the first run's 64-row Ouro entries took 0.24-0.27 ms off its b64 step.
TABLES[('NVIDIA H200', 132, 130100, 'bfloat16')] = {
    (1, 2048, 5632): (66, 0), (1, 3072, 6144): (112, 2), (1, 3072, 10752): (66, 0), (1, 5280, 17920): (88, 0),
    (1, 35840, 5280): (66, 0), (2, 2048, 5632): (112, 1), (2, 3072, 6144): (66, 0), (2, 3072, 10752): (66, 0),
    (2, 5280, 17920): (88, 0), (2, 35840, 5280): (66, 0), (4, 2048, 5632): (112, 1),
    (4, 3072, 6144): (112, 2), (4, 3072, 10752): (66, 0), (4, 5280, 17920): (88, 0),
    (4, 35840, 5280): (66, 0), (8, 2048, 5632): (112, 1), (8, 3072, 6144): 2, (8, 5280, 17920): (88, 0),
    (8, 35840, 5280): (66, 0), (16, 2048, 5632): (112, 1), (16, 3072, 6144): 2, (16, 5280, 17920): (88, 0),
    (16, 6144, 2048): 1, (16, 21504, 3072): (88, 1), (16, 35840, 5280): (88, 0), (24, 2048, 5632): (66, 1),
    (24, 3072, 10752): 5, (24, 5280, 17920): (88, 0), (24, 6144, 2048): 1, (24, 35840, 5280): 1,
    (32, 2048, 5632): (66, 1), (32, 3072, 6144): 2, (32, 5280, 17920): (88, 0), (32, 6144, 2048): 1,
    (32, 35840, 5280): (88, 0), (48, 2048, 5632): (66, 1), (48, 3072, 6144): 2, (48, 3072, 10752): (112, 5),
    (48, 5280, 17920): (88, 0), (48, 6144, 2048): (88, 2), (48, 21504, 3072): 3, (48, 35840, 5280): (88, 6),
    (64, 2048, 5632): 1, (64, 3072, 6144): 2, (64, 3072, 10752): (112, 4), (64, 5280, 17920): (88, 0),
    (64, 6144, 2048): 5, (64, 8192, 3072): 2, (64, 11264, 2048): 2, (64, 15840, 5280): (88, 0),
    (64, 35840, 5280): (88, 2), (96, 2048, 2048): 1, (96, 3072, 6144): 1, (96, 5280, 17920): (88, 1),
    (96, 35840, 5280): 5, (128, 2048, 2048): 1, (128, 2048, 5632): 2, (128, 3072, 10752): (112, 0),
    (128, 5280, 17920): (112, 2), (160, 2048, 5632): 1, (160, 3072, 6144): (112, 2),
    (160, 35840, 5280): (112, 1), (192, 3072, 10752): (112, 0), (192, 5280, 5280): (112, 1),
    (192, 35840, 5280): (112, 3), (256, 3072, 10752): 1, (256, 5280, 5280): (112, 0),
}
