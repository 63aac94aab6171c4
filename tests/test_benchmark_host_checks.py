"""``bench_host_checks`` runs at small sizes (the script's measurements, not their times, are checked)."""

from benchmarks.ops.bench_host_checks import captured_reads_cost, group_scale_cost


def test_the_host_checks_benchmark_measures_both_checks():
    params, reads = captured_reads_cost(layers=2, reps=2)
    assert params > 20 and reads > 0
    scale, key = group_scale_cost(calls=10)
    assert scale > 0 and key > 0
