"""The pinned staging ring of captured metadata: a host mirror whose copy may still be queued is
never rewritten before the event recorded after that copy has been waited on."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hal.common.staging import StagingRing


class FakeEvent:
    def __init__(self, log: list) -> None:
        self.log, self.is_recorded, self.is_waited = log, False, False

    def record(self) -> None:
        self.is_recorded = True

    def synchronize(self) -> None:
        self.is_waited = True
        self.log.append(self)


def test_ring_waits_before_reusing_a_slot_and_keeps_queued_values():
    rng = np.random.default_rng(7)
    steps = [rng.integers(0, 1000, size=(5,), dtype=np.int32) for _ in range(5)]
    target = torch.zeros(5, dtype=torch.int32)
    waited, made = [], []

    def make_event():
        made.append(FakeEvent(waited))
        return made[-1]

    ring = StagingRing([steps[0]], torch.device("cpu"), depth=2, make_event=make_event)
    for i, values in enumerate(steps):
        ring.stage([values], [target])
        assert torch.equal(target, torch.from_numpy(values))
        assert made[i].is_recorded
        if i >= 1:
            # the other slot still holds the previous step's values: its copy may still be queued
            previous = ring.slots[(i - 1) % 2][0]
            assert torch.equal(previous, torch.from_numpy(steps[i - 1]))
        # step i reused slot i % 2 only after waiting on the event of step i - 2
        assert waited == made[:max(0, i - 1)]


def test_ring_rejects_a_batch_of_another_shape():
    ring = StagingRing([np.zeros(4, dtype=np.int32)], torch.device("cpu"))
    try:
        ring.stage([np.ones(3, dtype=np.int32)], [torch.zeros(4, dtype=torch.int32)])
    except ValueError as exc:
        assert "does not fit the captured meta" in str(exc)
    else:
        raise AssertionError("a mismatched shape was staged")


class WaitedEvent(FakeEvent):
    def wait(self) -> None:
        self.log.append(("wait", self))


@pytest.mark.parametrize("through_landing", [False, True])
def test_a_narrower_table_travels_as_its_own_columns(through_landing):
    """Block tables of sequences shorter than the capacity stage only their columns: the target's
    first columns take them, the others keep what they held (no kernel reads past a sequence's
    length), and a later, wider batch fills more of them. On a device the columns go through a
    contiguous landing buffer, after the stream waited for the previous stage's event (here the
    device path runs on CPU tensors, with recording events)."""
    target = torch.full((2, 3, 8), -1, dtype=torch.int32)
    ring = StagingRing([np.zeros((2, 3, 8), dtype=np.int32)], torch.device("cpu"))
    log, events = [], []
    if through_landing:
        ring.is_cpu = False
        ring._make_event = lambda: events.append(WaitedEvent(log)) or events[-1]
    short = np.arange(12, dtype=np.int32).reshape(2, 3, 2)
    ring.stage([short], [target], narrow=(0,))
    assert torch.equal(target[..., :2], torch.from_numpy(short)) and (target[..., 2:] == -1).all()
    wider = np.arange(100, 130, dtype=np.int32).reshape(2, 3, 5)
    ring.stage([wider], [target], narrow=(0,))
    assert torch.equal(target[..., :5], torch.from_numpy(wider)) and (target[..., 5:] == -1).all()
    if through_landing:
        assert log == [("wait", events[0])]                   # the second stage waited on the first
        assert 30 <= ring._landing[0].numel() <= 48           # grown to the wider batch, within the capacity
    for bad, named in ((np.zeros((2, 3, 9), dtype=np.int32), (0,)), (np.zeros((2, 4, 2), dtype=np.int32), (0,)),
                       (short, ())):            # only the arrays named may be narrower
        try:
            ring.stage([bad], [target], narrow=named)
        except ValueError as exc:
            assert "does not fit the captured meta" in str(exc)
        else:
            raise AssertionError(f"a batch of shape {bad.shape} was staged")


class _Decoding:
    """What `describe_rows` reads of a request."""

    def __init__(self, request_id: str, position: int) -> None:
        self.request_id, self.num_computed_tokens = request_id, position

    def token_at(self, position: int) -> int:
        return 7


def test_a_decode_steps_tables_travel_as_wide_as_its_longest_sequence():
    """A captured decode meta has room for max_model_len's blocks (4,096 here); a step's inputs carry
    the persistent batch's rows only as wide as the longest of its tables, and `update_meta` stages
    those columns alone: the host copies and the host-to-device bytes follow the context, not
    max_model_len."""
    from hal.attention import MetaCapacity
    from hal.kernels.backend import TritonPagedAttention
    from hal.kernels.configs import configs_for
    from runtime.execution.step_inputs import describe_rows

    tables, lengths = np.zeros((4, 8, 4096), dtype=np.int32), np.zeros((4, 8), dtype=np.int64)
    rows, blocks = np.array([5, 1, 6]), (3, 5, 2)
    for row, n in zip(rows, blocks):
        tables[:, row, :n] = 100 * row + np.arange(n)
        lengths[:, row] = n
    requests = [_Decoding(str(row), 16 * n - 2) for row, n in zip(rows, blocks)]
    host = describe_rows(tables, lengths, rows, requests, 4, 16)
    assert host.batch.block_tables.shape == (4, 3, 5)
    backend = TritonPagedAttention(2, 2, 16, torch.float32, torch.device("cpu"), 16, configs=configs_for("default"),
                                   num_compute_units=4)
    meta = backend.build_meta(host.batch, MetaCapacity(3, 3, 4096, 4, 65536))
    assert meta.block_tables.shape == (4, 3, 4096)
    meta.block_tables.fill_(-1)
    tables[:, 1, 5] = 105                             # one more block for row 1
    lengths[:, 1] = 6
    requests[1].num_computed_tokens += 16
    backend.update_meta(meta, describe_rows(tables, lengths, rows, requests, 4, 16).batch)
    assert torch.equal(meta.block_tables[..., :6], torch.from_numpy(tables[:, rows, :6]))
    assert (meta.block_tables[..., 6:] == -1).all()   # never read: every kernel stops at the sequence's length


def test_padding_rows_keep_their_spare_scratch_column_in_a_narrower_batch():
    """Padding rows of a captured decode pass own a spare scratch block in their second column, into
    which speculation's drafts step (`advance_meta`). A batch whose real tables are one block wide
    must still stage that column: before, it kept an earlier, wider batch's pool blocks there, and the
    padding rows' draft KV went into them. A table wider than the capacity is refused by name."""
    from types import SimpleNamespace

    from hal.attention import MetaCapacity, PagedBatch
    from hal.kernels.backend import TritonPagedAttention
    from hal.kernels.configs import configs_for
    from runtime.execution.step_inputs import HostInputs, describe_rows, pad

    page, pool, bucket, planes, drafts = 16, 100, 16, 2, 3
    env = SimpleNamespace(block_size=page, scratch_block=pool, num_scratch_slots=bucket * (drafts + 1))
    backend = TritonPagedAttention(2, 2, 16, torch.float32, torch.device("cpu"), page, configs=configs_for("default"),
                                   num_compute_units=4)
    empty = pad(HostInputs([], [], [], PagedBatch([], [], [[] for _ in range(planes)], page), []), bucket, 1, env)
    meta = backend.build_meta(empty.batch, MetaCapacity(bucket, bucket, 64, planes, 1024))
    tables, lengths = np.zeros((planes, 32, 64), dtype=np.int32), np.zeros((planes, 32), dtype=np.int64)
    for step, (rows, blocks, position) in enumerate(((np.arange(16), 3, 40), (np.arange(16, 26), 1, 5))):
        for row in rows:
            tables[:, row, :blocks] = 10 + 3 * row + np.arange(blocks)
            lengths[:, row] = blocks
        host = describe_rows(tables, lengths, rows, [_Decoding(str(r), position) for r in rows], planes, page)
        backend.update_meta(meta, pad(host, bucket, 1, env).batch)
    for ahead in range(1, drafts + 1):
        blocks = (backend.advance_meta(meta, ahead).slot_mapping // page)[:, 10:]      # the padding rows
        assert (blocks >= pool).all(), (ahead, blocks)
    wide = np.zeros((planes, 2, 65), dtype=np.int32)
    with pytest.raises(ValueError, match=r"a block table has 65 blocks, the captured meta has room for 64"):
        backend.update_meta(meta, PagedBatch(np.ones(2, dtype=np.int64), np.full(2, 65 * page), wide, page,
                                             np.full((planes, 2), 65)))
