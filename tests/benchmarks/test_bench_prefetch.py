"""benchmarks/bench_prefetch.py's sampler section: the kernels with and without prefetching, over 48 layers' weights
and one layer's, give the same bits (the run stops otherwise) and their times make the table (the numbers are the
machine's; only their presence and consistency are checked)."""


import pytest

from benchmarks import bench_prefetch  # noqa: E402
from moe_rl.kernels import native  # noqa: E402


@pytest.mark.skipif(native.library() is None, reason="the C kernels are not built here")
def test_the_sampler_section_times_both_builds_and_writes_its_table(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the no-prefetch build goes to a folder of its own
    rows = bench_prefetch.time_sampler(bench_prefetch.builds(), repeat=1)
    assert [row["layers"] for row in rows] == [bench_prefetch.LAYERS, 1]
    for row in rows:
        assert row["prefetch us per layer"] > 0 and row["no prefetch us per layer"] > 0
        assert row["speed-up"] == pytest.approx(row["no prefetch us per layer"] / row["prefetch us per layer"])
    text = bench_prefetch.markdown([], rows, [], "python -m benchmarks.bench_prefetch")
    assert "Not measured: the C product loop does not run here" in text
    assert f"| {bench_prefetch.LAYERS} | {rows[0]['prefetch us per layer']:.0f} |" in text
