"""Everything a GPU session must measure, in one command and one markdown report.

    python bench.py --mode gpu-report --report gpu-report.md [--commit SHA]

GPU time is rare (a lent machine, bare and offline: torch, Triton, pytest, transformers and
numpy, none of the server's packages, no bundled model), so one command does it all within
9 minutes: the gpu-marked tests, the kernel tests compiled, the kernel benchmarks (against
the measured copy bandwidth and torch SDPA), paper mode at the paper's setting on a
Llama-3.1-8B shape, workload, host and offload modes on a Qwen3-0.6B shape, all with random
weights, and a short graphed run with scored steps and an fp8 cache under compute-sanitizer's
memcheck (every kernel's memory accesses). Each part runs in its own process with its own
time limit, so a part that fails or runs out of time is reported as such and the others
still run. The report is rewritten after every part (a run cut short keeps what it did): at
its top device, driver, versions, date, commit and command, then every GPU target as
measured / target (nanokv/tools/gpu_targets.py), then each part's command, exit status, time
and output, ready to paste into docs/PERF.md.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanokv.tools import gpu_targets
from nanokv.tools.gpu_targets import Figure
from nanokv.tools.provenance import COMMIT_VARIABLE, ROOT, source_commit

KERNEL_TESTS = ["tests/kernels/test_attention_triton.py", "tests/kernels/test_key_scores.py",
                "tests/kernels/test_kernels_elementwise.py", "tests/kernels/test_kv_quant.py",
                "tests/engine/test_triton_engine.py"]
OUTPUT_TAIL = 6000   # characters of a part's output kept in the report
SANITIZER = "compute-sanitizer"   # the CUDA toolkit's; on PATH or in /usr/local/cuda/bin
GPU_MARK = "@pytest.mark.gpu"


@dataclass
class Part:
    title: str
    args: list[str]      # run as `python ARGS...` from the repository root
    timeout_s: int
    launcher: list[str] = field(default_factory=list)   # a command that runs the python (a sanitizer)
    figures: gpu_targets.Reader | None = None   # what the report's top shows of it
    records: bool = False   # the part takes --out FILE and writes its JSON lines there


@dataclass
class Outcome:
    part: Part
    returncode: int | None   # None: killed at its time limit
    wall_s: float
    output: str
    records: list[dict] = field(default_factory=list)

    @property
    def figures(self) -> list[Figure]:
        return self.part.figures(self.output, self.records) if self.part.figures else []


def gpu_test_files() -> list[str]:
    """The test files that hold gpu-marked tests. The report names them rather than collecting
    the whole suite: other files import what a bare GPU machine lacks (the server's packages,
    the bundled model's)."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                  if GPU_MARK in path.read_text())


def parts() -> list[Part]:
    """The report's parts, in order; their limits add up to 8 minutes 55 s. On an H200 (2026-11-27,
    docs/PERF.md) with 4 pytest workers the gpu-marked tests took 54 s, the kernel tests 57, the
    kernel benchmarks 28 (before they profiled a second decode step), paper mode 54, workload
    mode 76 (three methods, before each was warmed up), host mode 41, offload mode 36 and
    memcheck 51 on a fresh machine (Triton compiling under the sanitizer); in the seventh run the
    kernel tests took 47 s and memcheck 39."""
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    if importlib.util.find_spec("xdist"):   # the lent machines have it: a file per worker, compiling in parallel
        pytest += ["-n", "4", "--dist", "loadfile"]
    return [
        Part("gpu-marked tests", [*pytest, "-m", "gpu", *gpu_test_files()], 75, figures=gpu_targets.tests),
        Part("kernel tests, compiled on the GPU", [*pytest, "-m", "not gpu", *KERNEL_TESTS], 65,
             figures=gpu_targets.tests),
        Part("kernel benchmarks", ["-m", "nanokv.tools.kernel_bench", "--quick"], 45, figures=gpu_targets.kernels,
             records=True),
        Part("paper mode at the paper's setting: Llama-3.1-8B shape (random weights), input 3584, output 512, "
             "4 GB of KV", ["bench.py", "--preset", "gpu-paper"], 70, figures=gpu_targets.paper, records=True),
        Part("workload mode, Qwen3-0.6B shape (random weights): uniform and uneven eviction, alone and together",
             ["bench.py", "--mode", "workload", "--random-weights", "qwen3-0.6b", "--methods", "full", "batchmax",
              "kvcompress", "kvcompress,together=1", "--budgets", "512"], 120, figures=gpu_targets.workload,
             records=True),
        Part("host mode, Qwen3-0.6B shape: the engine's own time per decode step against the forward, "
             "decodes replayed from CUDA graphs",
             ["bench.py", "--mode", "host", "--random-weights", "qwen3-0.6b", "--batches", "1", "256",
              "--methods", "full", "batchmax", "kvcompress", "--output-len", "64"], 55, figures=gpu_targets.host,
             records=True),
        Part("offload mode: recompute, swap and decoding from the host (l = 0, KVPR's l), Qwen3-0.6B shape, "
             "outputs of at most 128 tokens",
             ["bench.py", "--mode", "offload", "--random-weights", "qwen3-0.6b", "--methods", "full",
              "--num-requests", "8", "--output-len", "128"], 45, figures=gpu_targets.offload, records=True),
        Part("compute-sanitizer memcheck: a short graphed run, scored steps, fp8 cache",
             ["-c", "from nanokv.tools.gpu_report import short_run; short_run()"], 60,
             launcher=[SANITIZER, "--tool", "memcheck", "--error-exitcode", "1"], figures=gpu_targets.memcheck),
    ]


def short_run() -> None:
    """A few decode steps replayed from CUDA graphs, scoring for eviction and evicting, on an
    fp8 cache (a small random model): what the memcheck part runs."""
    from nanokv import LLM, SamplingParams
    llm = LLM("random:smollm2-135m", kv_cache_dtype="fp8", max_model_len=256, max_num_seqs=4, kv_cache_gb=0.05)
    prompts = [list(range(1, 1 + n)) for n in (40, 100)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True, kv_method="batchmax", kv_budget=64,
                                                evict_every=16))
    print(f"{sum(len(o.token_ids) for o in outs)} tokens, graphs: {llm.runner.graphs is not None}")


def _launcher(part: Part) -> list[str] | None:
    """part's launcher with its program found, None if it is not installed."""
    if not part.launcher:
        return []
    program = shutil.which(part.launcher[0]) or shutil.which(part.launcher[0], path="/usr/local/cuda/bin")
    return None if program is None else [program, *part.launcher[1:]]


def run_part(part: Part, records_dir: Path, python: str = sys.executable) -> Outcome:
    start = time.perf_counter()
    launcher = _launcher(part)
    if launcher is None:
        return Outcome(part, 127, 0.0, f"{part.launcher[0]} not found (on PATH or in /usr/local/cuda/bin): "
                                       "install the CUDA toolkit to run this part")
    records_file = records_dir / f"part-{int(time.time() * 1e6)}.jsonl"
    out = ["--out", str(records_file)] if part.records else []
    try:
        done = subprocess.run([*launcher, python, *part.args, *out], cwd=ROOT, capture_output=True, text=True,
                              timeout=part.timeout_s)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as killed:
        returncode = None
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                         for x in (killed.stdout, killed.stderr))
    records = [json.loads(line) for line in records_file.read_text().splitlines()] if records_file.exists() else []
    return Outcome(part, returncode, time.perf_counter() - start, output, records)


def _command_output(args: list[str]) -> str | None:
    try:
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def header(command: str) -> str:
    """Where and when: device, driver, versions, date, commit, the command."""
    import torch
    import triton
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    commit = source_commit()
    return "\n".join([
        f"- Device: {device}; driver {driver or 'unknown (no nvidia-smi)'}, CUDA {torch.version.cuda}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}",
        f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}; commit: "
        f"{commit or 'unknown (not a checkout of its own: pass --commit, the commit the tree was copied from)'}",
        f"- Command: `{command}`",
    ])


def summary(outcomes: list[Outcome]) -> str:
    """Every part's figures in one table: measured against target, and whether it is met."""
    rows = ["| part | figure | measured | target | met |", "| --- | --- | --- | --- | --- |"]
    for o in outcomes:
        status = "" if o.returncode == 0 else " (killed at its limit)" if o.returncode is None else \
            f" (exit {o.returncode})"
        for f in o.figures or [Figure("(no figures)", "")]:
            met = "" if f.met is None else "yes" if f.met else "**no**"
            rows.append(f"| {o.part.title.split(':')[0]}{status} | {f.name} | {f.measured} | {f.target} | {met} |")
    return "\n".join(rows) + "\n"


def section(outcome: Outcome) -> str:
    """One part of the report: its command, how it ended, and what it printed."""
    part = outcome.part
    status = (f"killed at its {part.timeout_s} s limit" if outcome.returncode is None
              else "ok" if outcome.returncode == 0 else f"FAILED (exit {outcome.returncode})")
    output = outcome.output.strip()
    if len(output) > OUTPUT_TAIL:
        output = "[...]\n" + output[-OUTPUT_TAIL:]
    command = " ".join([*part.launcher, "python", *part.args])
    return (f"## {part.title}\n\n`{command}`: {status}, {outcome.wall_s:.0f} s\n\n"
            f"```\n{output or '(no output)'}\n```\n")


def write_report(path: str, outcomes: list[Outcome], command: str, pending: list[Part]) -> str:
    failed = [o.part.title.split(":")[0] for o in outcomes if o.returncode != 0]
    result = "every part ran to the end" if not failed else f"did not finish cleanly: {', '.join(failed)}"
    if pending:
        result += f"; still to run: {', '.join(p.title.split(':')[0] for p in pending)}"
    text = (f"# nanokv GPU report\n\n{header(command)}\n- Result: {result}\n\n## Targets\n\n{summary(outcomes)}\n"
            + "\n".join(section(o) for o in outcomes))
    Path(path).write_text(text)
    return text


def main(report_path: str, selected: list[Part] | None = None, commit: str | None = None) -> int:
    """Run every part (or the selected ones), rewriting the report after each; return how many
    failed. commit: the commit the tree was copied from, for the report and every part."""
    import torch
    if selected is None and not torch.cuda.is_available():
        raise SystemExit("--mode gpu-report needs a CUDA device (its parts are tested on the CPU)")
    if commit:
        os.environ[COMMIT_VARIABLE] = commit   # the parts inherit it
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    todo, outcomes = list(selected or parts()), []
    with tempfile.TemporaryDirectory() as records_dir:
        while todo:
            part = todo.pop(0)
            print(f"{part.title} (limit {part.timeout_s} s) ...", file=sys.stderr, flush=True)
            outcomes.append(run_part(part, Path(records_dir)))
            write_report(report_path, outcomes, command, todo)
    print(f"report written to {report_path}", file=sys.stderr)
    return sum(o.returncode != 0 for o in outcomes)
