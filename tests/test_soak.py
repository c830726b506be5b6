"""The soak command on a tiny model for a few seconds: its accounting, not its figures."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.stack import ROOT


def test_soak_command_accounts_for_every_request(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tests.soak", "--model", str(tiny_model_dir), "--duration", "8",
                          "--rate", "2", "--max-tokens", "16", "--slots", "4", "--sample-every", "2",
                          "--out", str(tmp_path), "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["sent"] > 0 and report["completed"] == report["sent"] and not report["errors"]
    assert report["accepted"] == report["sent"] and report["records_finished"] == report["accepted"]
    assert not report["records_missing"] and not report["records_unfinished"]
    assert len(report["samples"]) >= 3 and all(s["worker_rss_mb"] > 0 for s in report["samples"])
    assert "worker RSS MB start" in out.stdout
