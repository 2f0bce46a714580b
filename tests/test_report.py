"""The run report: a PNG of the usual curves from a metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridrl.report import load_metrics, main, make_report
from hybridrl.utils.tracking import Tracking


def write_metrics(run_dir, rows, tail: str = "") -> None:
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write(tail)


def full_rows():
    rows = []
    for step in range(1, 7):
        row = {
            "step": step,
            "critic/score/mean": 0.1 * step,
            "critic/score/min": 0.0,
            "critic/score/max": 0.2 * step,
            "actor/ppo_kl": 0.001 * step,
            "actor/kl_loss": 0.002 * step,
            "actor/entropy": 2.0 - 0.1 * step,
            "response_length/mean": 40.0 + step,
            "perf/throughput": 1000.0,
        }
        if step % 2 == 0:
            row["val-core/openai/gsm8k/reward/mean@4"] = 0.3 + 0.05 * step
        rows.append(row)
    return rows


def image_shape(path):
    import matplotlib.image

    return matplotlib.image.imread(path).shape


def test_load_metrics_dedupes_and_skips_bad_lines(tmp_path):
    rows = [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0, "y": None}, {"step": 2, "x": 5.0}]
    write_metrics(tmp_path, rows, tail='\n{"step": 3, "x": 3.')  # a run killed mid-line
    series = load_metrics(str(tmp_path / "metrics.jsonl"))
    assert series == {"x": [(1, 1.0), (2, 5.0)]}


def test_report_png_has_all_six_panels(tmp_path):
    write_metrics(tmp_path, full_rows())
    out = make_report(str(tmp_path))
    assert out == str(tmp_path / "report.png")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert image_shape(out)[:2] == (680, 1500)  # 2 rows x 3 columns at 100 dpi


def test_report_skips_missing_panels(tmp_path):
    rows = [{"step": s, "critic/score/mean": s / 10, "actor/entropy": 1.0} for s in range(3)]
    write_metrics(tmp_path, rows)
    os.rename(tmp_path / "metrics.jsonl", tmp_path / "run.jsonl")  # a metrics file given by path
    out = make_report(str(tmp_path / "run.jsonl"))
    assert out == str(tmp_path / "report.png")
    assert image_shape(out)[:2] == (340, 1000)  # 1 row x 2 columns


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        make_report(str(tmp_path))
    write_metrics(tmp_path, [{"step": 1, "custom/thing": 1.0}])
    with pytest.raises(ValueError, match="custom/thing"):
        make_report(str(tmp_path))
    assert main([str(tmp_path / "nowhere")]) == 2


def test_tracker_file_output_feeds_the_report(tmp_path, capsys):
    with Tracking("p", "e", "file", log_dir=str(tmp_path)) as t:
        for row in full_rows():
            t.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    assert main([str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.png")
    assert image_shape(tmp_path / "r.png")[:2] == (680, 1500)


@pytest.mark.slow
def test_module_entry_point(tmp_path):
    write_metrics(tmp_path, full_rows())
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrl.report", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report.png").exists()
