"""`python -m bench.dashboard` on a few records: it fills, catches up, serves every window and compares."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.stack import ROOT


def test_the_dashboard_benchmark_runs_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "bench.dashboard", "--records", "3000", "--repeats", "1",
                    "--sample-s", "0.5", "--dir", str(tmp_path), "--json", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["catch_up"]["samples"][0]["catching_up"] is True
    assert result["catch_up"]["samples"][-1]["catching_up"] is False
    assert result["web"]["windows"]["24h"]["requests"] == 3000
    assert result["web"]["windows"]["24h"]["keyed_requests"] == result["keyed_records"] > 0
    assert result["web"]["windows"]["24h"]["keys_listed"] == 10
    assert set(result["web"]["windows"]) == {"5m", "1h", "24h", "7d"}
    for window, base in result["previous_way"].items():
        assert base["records"] == result["web"]["windows"][window]["requests"]
        assert base["max_relative_percentile_difference"] is None or base["max_relative_percentile_difference"] <= 0.011
    assert not list(tmp_path.glob("dashboard-bench-*")), "the throwaway database is removed"
