"""The one results table (``results/kernels.csv``): ``benchmarks.timing.append_results``
writes the documented columns, whole rows only."""

import csv
import multiprocessing

import pytest

from benchmarks.timing import RESULT_FIELDS, add_csv_argument, append_results


def _read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_documented_columns_and_values(tmp_path):
    path = tmp_path / "results" / "kernels.csv"
    append_results([{"kernel": "decode", "shape": "4096x4096, M=1", "variant": "default", "us": 12.3456}],
                   raw="run1/bench.json", csv_path=path)
    append_results([{"kernel": "sync", "us": 7}], raw="run2/sync.json", csv_path=path)
    header, *rows = _read(path)
    assert tuple(header) == RESULT_FIELDS == ("kernel", "shape", "variant", "us", "gpu", "commit", "date", "raw")
    assert [dict(zip(header, r))["kernel"] for r in rows] == ["decode", "sync"]
    first = dict(zip(header, rows[0]))
    assert first["shape"] == "4096x4096, M=1" and first["us"] == "12.346" and first["raw"] == "run1/bench.json"
    assert first["gpu"] and first["commit"] and len(first["date"]) == 10
    assert dict(zip(header, rows[1]))["shape"] == ""


def test_a_half_row_left_by_a_killed_writer_is_cut_off(tmp_path):
    path = tmp_path / "kernels.csv"
    append_results([{"kernel": "a", "us": 1}], raw="", csv_path=path)
    with open(path, "a") as f:
        f.write("b,4096,def")  # killed mid-row
    append_results([{"kernel": "c", "us": 3}], raw="", csv_path=path)
    rows = _read(path)
    assert [r[0] for r in rows] == ["kernel", "a", "c"]
    assert all(len(r) == len(RESULT_FIELDS) for r in rows)


def test_a_bad_row_writes_nothing(tmp_path):
    path = tmp_path / "kernels.csv"
    append_results([{"kernel": "a", "us": 1}], raw="", csv_path=path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="no"):
        append_results([{"kernel": "b", "us": 2}, {"kernel": "c"}], raw="", csv_path=path)
    with pytest.raises(ValueError):
        append_results([{"kernel": "d", "us": "fast"}], raw="", csv_path=path)
    assert path.read_bytes() == before
    append_results([{"kernel": "e", "us": 1}], raw="", csv_path="")  # '' : no table
    append_results([], raw="", csv_path=path)
    assert path.read_bytes() == before


def _writer(path, who):
    for i in range(20):
        append_results([{"kernel": f"k{who}", "shape": "x" * 3000, "variant": str(i), "us": i}] * 3, raw="r",
                       csv_path=path)


def test_concurrent_writers_leave_whole_rows(tmp_path):
    path = tmp_path / "kernels.csv"
    procs = [multiprocessing.get_context("fork").Process(target=_writer, args=(path, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    header, *rows = _read(path)
    assert tuple(header) == RESULT_FIELDS
    assert len(rows) == 4 * 20 * 3 and all(len(r) == len(RESULT_FIELDS) and r[1] == "x" * 3000 for r in rows)


def test_csv_argument():
    import argparse

    ap = argparse.ArgumentParser()
    add_csv_argument(ap)
    assert ap.parse_args([]).csv.endswith("results/kernels.csv")
    assert ap.parse_args(["--csv", ""]).csv == ""
