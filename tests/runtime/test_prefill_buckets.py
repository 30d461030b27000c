"""Which captured prefill a prompt replays (runtime/execution/prefill_buckets.py): widths, padding,
scratch slots and the fresh path."""
from runtime.execution.prefill_buckets import PrefillBuckets


def test_widths_follow_capture_and_the_step_budget():
    assert PrefillBuckets(8192, captures=False).widths == [16, 32, 64, 128, 256, 512, 1024]
    assert PrefillBuckets(8192, captures=True).widths == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 2560,
                                                          3072, 3584, 4096, 8192]
    assert PrefillBuckets(5000, captures=True).widths[-2:] == [4096, 5000]      # a full chunk's width
    assert PrefillBuckets(512, captures=True).widths[-1] == 512


def test_medium_buckets_pad_freely_long_ones_only_to_a_64th():
    buckets = PrefillBuckets(20000, captures=True)
    assert [buckets.bucket(n) for n in (100, 1025, 2049, 4096)] == [128, 1536, 2560, 4096]
    assert buckets.bucket(4097) is None                    # 8192 would be half padding: eager
    assert buckets.bucket(8192 - 128) == 8192 and buckets.bucket(8192 - 129) is None
    assert buckets.bucket(20000) == 20000 and buckets.bucket(19000) is None
    assert buckets.bucket(20001) is None
    assert PrefillBuckets(20000, captures=False).bucket(2000) is None          # no capture: eager


def test_scratch_holds_a_short_capture_or_the_padding_of_a_longer_one():
    assert PrefillBuckets(8192, captures=True).scratch_tokens(16) == 1024        # 511 + 16, 128 + 16 below
    assert PrefillBuckets(256, captures=True).scratch_tokens(16) == 256
    assert PrefillBuckets(65536, captures=True).scratch_tokens(16) == 65536 // 64 + 16


def test_first_chunks_from_the_backends_length_attend_fresh():
    buckets = PrefillBuckets(20000, captures=True, fresh_min_tokens=4097)
    assert buckets.attends_fresh(8192, 0) and buckets.attends_fresh(20000, 0)
    assert not buckets.attends_fresh(4096, 0) and not buckets.attends_fresh(1536, 0)   # own K/V, paged kernel
    assert not buckets.attends_fresh(8192, 4096)                   # a later chunk has context
    assert not PrefillBuckets(20000, captures=True).attends_fresh(8192, 0)   # a backend without a fresh path
    # the chunk's own length decides, as in its eager pass: a line inside a bucket splits it
    inside = PrefillBuckets(20000, captures=True, fresh_min_tokens=2000)
    assert inside.bucket(1990) == inside.bucket(2040) == 2048
    assert not inside.attends_fresh(1990, 0) and inside.attends_fresh(2040, 0)
