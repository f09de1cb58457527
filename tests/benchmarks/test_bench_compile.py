"""benchmarks/bench_compile.py's bookkeeping, without compiling (a cold Inductor compile of even a one-layer model
takes about 40 CPU seconds here): the minibatch shapes, the compile time and break-even it derives from the arms'
times, and the table row it writes. The timing itself runs in the benchmark (`--quick`, about 2 minutes)."""

import math

from benchmarks import bench_compile


def test_minibatch_shapes_vary_within_the_bench_shape_and_repeat_for_a_seed():
    shapes = bench_compile.minibatch_shapes(16, 64, 6)
    assert shapes == bench_compile.minibatch_shapes(16, 64, 6)
    assert all(b in (8, 12, 16) and 32 <= s <= 64 for b, s in shapes)
    assert len(set(shapes)) > 1


def test_compile_time_and_break_even_come_from_the_first_and_steady_calls(tmp_path):
    def arm(cpu, first):
        return {"wall": cpu, "cpu": cpu, "first wall": first, "first cpu": first}

    times = {"plain torch": arm(0.5, 0.6), "C kernels": arm(0.3, 0.3), "compiled": arm(0.4, 10.4)}
    dynamo = {"frames compiled": 12, "graph breaks": 9, "recompiles": 1, "recompile reasons": "forward: size"}
    bits = {"bit-identical": "no", "max abs diff": 2e-7}
    rows = bench_compile.rows_of("forward+backward", "d64 L4 E8 K2 F64", "16x64", 6, times, dynamo, bits)
    assert [row["arm"] for row in rows] == list(bench_compile.ARMS)
    compiled = rows[-1]
    assert math.isclose(compiled["compile cpu"], 10.0)
    assert math.isclose(compiled["break-even calls vs plain torch"], 100.0)  # 10 s / 0.1 s saved per call
    assert compiled["break-even calls vs C kernels"] == math.inf  # slower than the kernels: never pays back
    bench_compile.write_csv(tmp_path / "compile.csv", rows)
    assert "break-even calls vs C kernels" in (tmp_path / "compile.csv").read_text().splitlines()[0]
    text = bench_compile.markdown(rows, "python -m benchmarks.bench_compile", {"start": "0.1", "end": "0.2"}, "abc1234")
    assert "| 1.33x | 10.0 s (10.0 s wall) | 600 / never | 12 | 1 | 9 | no | 2e-07 |" in text
