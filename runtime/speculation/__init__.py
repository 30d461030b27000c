"""Self-speculative decoding: `speculator.py` (one round: draft, verify, accept), `drafting.py`,
`acceptance.py` (the acceptance rules), `costs.py` (pass costs for the benchmark)."""
