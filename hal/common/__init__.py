"""Pieces several Hals share (no vendor SDK here): `host.py` (the device members of a Hal that runs on
the host), `graph.py` (the eager graph), `host_buffer.py` (the staged host buffer),
`torch_attention.py` (the paged-attention reference in plain torch), `paged.py` (paged-KV
arithmetic), `kv_quant.py` (the 8-bit KV cache's quantization and layout), `comm.py` (collectives
over torch.distributed)."""
