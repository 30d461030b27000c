"""Self-speculative decoding: `speculator.py` (one round: draft, verify, accept), `fused_round.py` (a
greedy round as one captured graph), `drafting.py`, `acceptance.py` (the acceptance rules), `costs.py`
(pass costs for the benchmark)."""
