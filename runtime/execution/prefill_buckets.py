"""Which captured prefill a prompt chunk replays: the token counts that are captured, the
padding each may take, and which of them attend through the backend's fresh path. Arithmetic only;
the runner asks, `graphs.PassGraphs` captures.

Three ranges, as measured on the H200 (docs/performance.md, levers 77-78):
- up to 1,024 tokens (`SHORT`), on every Hal, padded freely: a short prefill is launch-bound, so its
  padded graph costs about its weight reads. With capture off (the CPU) the same padded pass runs
  eagerly, so turning graphs on or off never changes a kernel's shapes.
- 1,536 to 4,096 tokens in steps of 512 (`MEDIUM`), where the Hal captures, padded freely (at most
  511 tokens): the eager pass of such a prompt waits on the host, which issues ~1,350 launches
  (2,048 tokens: 63-86 ms eager, 37 ms captured).
- 8,192 tokens and more (`LONG`, and max_num_batched_tokens itself), where the Hal captures and the
  prompt fills the bucket to within 1/64: the pass is compute-bound, so padding costs its share of
  the work while capture saves only the launch gaps (8k: level to -0.5%). Every full chunk of a long
  prompt fills max_num_batched_tokens exactly.
A prompt's first chunk attends over its own K/V: through the backend's fresh path (a vendor's kernel:
cuDNN on Hopper, 1.43x the paged kernel's rate at 8k on an H100) from the backend's
`AttnCaps.fresh_min_tokens`, on the paged kernel below. The eager pass draws the same line, so captured
and eager passes of a prompt run the same attention kernel and give the same greedy tokens (a 1,536-token
graph on the paged kernel did not, against eager flash at 1,500 tokens, before the eager pass drew it too).
"""
from __future__ import annotations

SHORT = (16, 32, 64, 128, 256, 512, 1024)
MEDIUM = (1536, 2048, 2560, 3072, 3584, 4096)
LONG = (8192, 16384, 32768)
MAX_LONG_PADDING = 1 / 64


class PrefillBuckets:
    """The captured prefill widths of a runner: steps of at most `max_num_batched_tokens` tokens,
    `captures`: whether the Hal records graphs (else only `SHORT` runs padded); `fresh_min_tokens`: the
    attention backend's (`AttnCaps`)."""

    def __init__(self, max_num_batched_tokens: int, captures: bool,
                 fresh_min_tokens: int | None = None) -> None:
        self.fresh_min_tokens = fresh_min_tokens
        widths = {w for w in SHORT + (MEDIUM + LONG if captures else ()) if w <= max_num_batched_tokens}
        if captures and max_num_batched_tokens > SHORT[-1]:
            widths.add(max_num_batched_tokens)
        self.widths = sorted(widths)

    def bucket(self, num_tokens: int) -> int | None:
        """The width a prefill of `num_tokens` tokens replays, or None (it runs eagerly)."""
        width = next((w for w in self.widths if w >= num_tokens), None)
        if width is not None and width > MEDIUM[-1] and width - num_tokens > width * MAX_LONG_PADDING:
            return None
        return width

    def short_widths(self, max_model_len: int) -> list[int]:
        """The short widths (captured over padding alone, so at start) a prompt of at most
        `max_model_len` tokens may replay."""
        short = [w for w in self.widths if w <= SHORT[-1]]
        return [w for i, w in enumerate(short) if i == 0 or short[i - 1] < max_model_len]

    def scratch_tokens(self, block_size: int) -> int:
        """Scratch slots the captures need: a short width's capture runs over padding only (its whole
        width), a wider one over its first prompt (`graphs.PassGraphs.run`), so only the padding of a
        later prompt, rounded to a block."""
        need, below = 0, 0
        for width in self.widths:
            if width <= SHORT[-1]:
                need = max(need, width)
            else:
                padding = width - below - 1 if width <= MEDIUM[-1] else int(width * MAX_LONG_PADDING)
                need = max(need, padding + block_size)
            below = width
        return need

    def attends_fresh(self, num_tokens: int, first_token: int) -> bool:
        """Whether the captured pass of a prompt chunk of `num_tokens` at `first_token` takes the fresh
        path: its eager pass's rule (the chunk's own length, not its bucket's width)."""
        return first_token == 0 and self.fresh_min_tokens is not None and num_tokens >= self.fresh_min_tokens
