"""The GPU report's logic on the CPU: parts run in their own processes with their own
limits, and the report says how each ended; the real parts are well-formed."""
from pathlib import Path

import pytest

import bench
from nanokv.tools import gpu_report
from nanokv.tools.gpu_report import Part


def test_report_records_each_part_and_how_it_ended(tmp_path):
    selected = [Part("fine", ["-c", "print('| a | b |')"], 30),
                Part("broken", ["-c", "import sys; print('oops'); sys.exit(3)"], 30),
                Part("slow", ["-c", "import time; print('started', flush=True); time.sleep(60)"], 2)]
    report = tmp_path / "report.md"
    assert gpu_report.main(str(report), selected) == 2
    text = report.read_text()
    for line in ("- Device: ", "driver", "torch ", "triton ", "- Date: ", "commit: ", "- Command: "):
        assert line in text
    assert "did not finish cleanly: broken, slow" in text
    fine, broken, slow = text.split("## ")[1:]
    assert "ok" in fine and "| a | b |" in fine
    assert "FAILED (exit 3)" in broken and "oops" in broken
    assert "killed at its 2 s limit" in slow and "started" in slow


def test_long_output_keeps_its_tail():
    outcome = gpu_report.Outcome(Part("long", ["x"], 1), 0, 1.0, "head\n" + "x" * 10000 + "\nthe summary")
    text = gpu_report.section(outcome)
    assert "the summary" in text and "head" not in text and "[...]" in text


def test_the_real_parts_fit_nine_minutes_and_are_well_formed():
    parts = gpu_report.parts()
    assert sum(p.timeout_s for p in parts) <= 8 * 60 + 55   # the rest: starting each process, writing
    for part in parts:
        if part.launcher:
            assert part.launcher[0] == gpu_report.SANITIZER and part.args[0] == "-c"
        elif part.args[0] == "bench.py":
            args = bench.parse_args(part.args[1:])
            assert args.random_weights or args.mode == "host"
            assert args.mode in ("paper", "workload", "host", "offload")
        elif part.args[:2] == ["-m", "pytest"]:
            assert all(Path(gpu_report.ROOT, f).is_file() for f in part.args if f.startswith("tests/"))
        else:
            assert part.args == ["-m", "nanokv.tools.kernel_bench", "--quick"]
    paper = bench.parse_args(["--preset", "gpu-paper"])
    assert (paper.input_len, paper.kv_cache_gb, paper.budgets, paper.ed_budgets) == (3584, 4.0, [1024], [2])


def test_a_missing_launcher_is_reported_not_fatal(tmp_path):
    part = Part("sanitized", ["-c", "print('never')"], 30, launcher=["no-such-sanitizer-here", "--tool", "memcheck"])
    report = tmp_path / "report.md"
    assert gpu_report.main(str(report), [part]) == 1
    assert "no-such-sanitizer-here not found" in report.read_text()


def test_the_short_run_runs_anywhere(tmp_path, monkeypatch, capsys):
    """The memcheck part's program, on the CPU (no graphs there)."""
    gpu_report.short_run()
    assert "64 tokens" in capsys.readouterr().out


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--mode", "gpu-report"])
