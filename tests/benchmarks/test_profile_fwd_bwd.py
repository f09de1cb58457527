"""benchmarks/profile_fwd_bwd.py on the smallest bench shape: it profiles both models, taking turns, and writes the
op table with both columns (the numbers are the machine's; only their presence and consistency are checked)."""

import re

from benchmarks import profile_fwd_bwd  # noqa: E402


def test_the_profile_writes_both_models_ops_and_shares(tmp_path):
    profile_fwd_bwd.main(["--shape", "d64 L4 E8 K2 F64", "--steps", "1", "--rows", "6", "--out", str(tmp_path)])
    text = (tmp_path / "profile_d64_L4_E8_K2_F64.md").read_text()
    assert '--shape "d64 L4 E8 K2 F64" --steps 1' in text and "| kernel family | used | why |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == 6
    mm = next(line for line in rows if line.startswith("| `aten::mm`"))
    native_ms, hf_ms = (float(ms) for ms in re.findall(r"\| ([0-9.]+) \(", mm))
    assert native_ms > 0 and hf_ms > 0  # both models ran their matrix products under the profiler
