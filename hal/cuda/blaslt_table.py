"""Measured cuBLASLt algorithm ranks for decode projections (hal/cuda/blaslt.py reads them).

Key: (device name, SM count, cuBLASLt version, dtype). Value: {(M, N, K): rank}, the heuristic's
candidate to run for `y[M, N] = x[M, K] @ w[N, K]^T`; only shapes where a candidate other than the
first (F.linear's) beat F.linear, twice, by at least 3%. Made by `python3 tools/lt_algo_probe.py --table` on the device
named (docs/benchmarks.md says which call), pasted here as printed.
"""
from __future__ import annotations

TABLES: dict[tuple[str, int, int, str], dict[tuple[int, int, int], int]] = {}

# decode buckets, tools/lt_algo_probe.py --table (2026-12-04, call 2 of the twenty-ninth session)
TABLES[('NVIDIA H200', 132, 130100, 'bfloat16')] = {
    (1, 2048, 5632): 1, (1, 3072, 6144): 2, (1, 3072, 10752): 4, (1, 35840, 5280): 4, (2, 2048, 5632): 1,
    (2, 3072, 6144): 2, (2, 3072, 10752): 4, (2, 35840, 5280): 6, (4, 2048, 5632): 1, (4, 3072, 6144): 2,
    (4, 3072, 10752): 4, (4, 35840, 5280): 6, (8, 2048, 5632): 1, (8, 3072, 6144): 2, (8, 35840, 5280): 6,
    (16, 2048, 5632): 1, (16, 3072, 6144): 2, (16, 6144, 2048): 1, (16, 35840, 5280): 1, (24, 2048, 5632): 3,
    (24, 3072, 10752): 5, (24, 6144, 2048): 1, (24, 35840, 5280): 1, (32, 2048, 5632): 1, (32, 3072, 6144): 2,
    (32, 6144, 2048): 1, (32, 35840, 5280): 2, (48, 2048, 5632): 2, (48, 3072, 6144): 2, (48, 6144, 2048): 5,
    (48, 35840, 5280): 3, (64, 2048, 5632): 1, (64, 3072, 6144): 2, (64, 6144, 2048): 5, (64, 8192, 3072): 2,
    (64, 11264, 2048): 2, (64, 15840, 5280): 1, (96, 2048, 2048): 1, (96, 3072, 6144): 1,
    (96, 35840, 5280): 5, (128, 2048, 2048): 1, (160, 2048, 5632): 1, (160, 35840, 5280): 1,
    (192, 5280, 5280): 6, (192, 35840, 5280): 1, (256, 3072, 10752): 1, (256, 5280, 5280): 2,
}
