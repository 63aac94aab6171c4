"""``bench_decode_host --count-calls``: quads' Python calls per eager decode step, a count that
is the same in every step (what makes two trees comparable without timing noise)."""

from benchmarks.ops.bench_decode_host import decode_step_times


def test_counted_calls_are_the_same_every_step_and_the_profiler_is_removed():
    import sys

    counts = decode_step_times(steps=4, prompt=2, run=4, count_calls=True)
    assert len(counts) == 4 and len(set(counts)) == 1 and counts[0] > 100  # every module's forward and kernel
    assert sys.getprofile() is None
