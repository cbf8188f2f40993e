"""Everything a GPU session must measure, in one command and one markdown report.

    python bench.py --mode gpu-report --report gpu-report.md

GPU time is rare (a lent machine, 30 minutes, no network), so one command does
it all within 9 minutes: the gpu-marked tests, the kernel tests compiled, the
kernel benchmarks (against the measured copy bandwidth and torch SDPA), paper
mode on a Llama-3.1-8B shape and workload mode on a Qwen3-0.6B shape, both
with random weights, and a short graphed run with scored steps and an fp8 cache
under compute-sanitizer's memcheck (every kernel's memory accesses). Each part runs in its own process with its own time
limit, so a part that fails or runs out of time is reported as such and the
others still run. The report (device, driver, versions, date, commit, each
command with its exit status, time and output) is ready to paste into
docs/PERF.md.
"""
from __future__ import annotations

import datetime
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/kernels/test_attention_triton.py", "tests/kernels/test_key_scores.py",
                "tests/kernels/test_kernels_elementwise.py",
                "tests/engine/test_triton_engine.py"]
OUTPUT_TAIL = 6000   # characters of a part's output kept in the report


SANITIZER = "compute-sanitizer"   # the CUDA toolkit's; on PATH or in /usr/local/cuda/bin


@dataclass
class Part:
    title: str
    args: list[str]      # run as `python ARGS...` from the repository root
    timeout_s: int
    launcher: list[str] = field(default_factory=list)   # a command that runs the python (a sanitizer)


@dataclass
class Outcome:
    part: Part
    returncode: int | None   # None: killed at its time limit
    wall_s: float
    output: str


def parts() -> list[Part]:
    """The report's parts, in order; their limits add up to 8 minutes 55 s."""
    return [
        Part("gpu-marked tests", ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"], 85),
        Part("kernel tests, compiled on the GPU", ["-m", "pytest", "-q", "-m", "not gpu", "-p", "no:cacheprovider",
                                                   *KERNEL_TESTS], 60),
        Part("kernel benchmarks", ["-m", "nanokv.tools.kernel_bench", "--quick"], 80),
        Part("paper mode, Llama-3.1-8B shape (random weights), output shortened to 128 tokens",
             ["bench.py", "--preset", "gpu-paper"], 110),
        Part("workload mode, Qwen3-0.6B shape (random weights): uniform and uneven eviction",
             ["bench.py", "--mode", "workload", "--random-weights", "qwen3-0.6b", "--methods", "full", "batchmax",
              "kvcompress", "--budgets", "512"], 65),
        Part("host mode: the engine's own time per decode step, decodes replayed from CUDA graphs",
             ["bench.py", "--mode", "host", "--batches", "1", "64", "256", "--methods", "full", "batchmax", "kvcompress",
              "--output-len", "100"], 35),
        Part("offload mode: recompute, swap and decoding from the host (l = 0, KVPR's l), Qwen3-0.6B shape",
             ["bench.py", "--mode", "offload", "--random-weights", "qwen3-0.6b", "--methods", "full",
              "--num-requests", "8", "--enforce-eager"], 40),
        Part("compute-sanitizer memcheck: a short graphed run, scored steps, fp8 cache",
             ["-c", "from nanokv.tools.gpu_report import short_run; short_run()"], 60,
             launcher=[SANITIZER, "--tool", "memcheck", "--error-exitcode", "1"]),
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


def run_part(part: Part, python: str = sys.executable) -> Outcome:
    start = time.perf_counter()
    launcher = _launcher(part)
    if launcher is None:
        return Outcome(part, 127, 0.0, f"{part.launcher[0]} not found (on PATH or in /usr/local/cuda/bin): "
                                       "install the CUDA toolkit to run this part")
    try:
        done = subprocess.run([*launcher, python, *part.args], cwd=ROOT, capture_output=True, text=True,
                              timeout=part.timeout_s)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as killed:
        returncode = None
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                         for x in (killed.stdout, killed.stderr))
    return Outcome(part, returncode, time.perf_counter() - start, output)


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
    commit = _command_output(["git", "describe", "--always", "--dirty"])
    return "\n".join([
        f"- Device: {device}; driver {driver or 'unknown (no nvidia-smi)'}, CUDA {torch.version.cuda}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}",
        f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}; commit: "
        f"{commit or 'unknown (not a git checkout: name the commit the tree was copied from)'}",
        f"- Command: `{command}`",
    ])


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


def write_report(path: str, outcomes: list[Outcome], command: str) -> str:
    failed = [o.part.title for o in outcomes if o.returncode != 0]
    summary = "every part ran to the end" if not failed else f"did not finish cleanly: {', '.join(failed)}"
    text = (f"# nanokv GPU report\n\n{header(command)}\n- Result: {summary}\n\n"
            + "\n".join(section(o) for o in outcomes))
    Path(path).write_text(text)
    return text


def main(report_path: str, selected: list[Part] | None = None) -> int:
    """Run every part (or the selected ones), write the report, return how many failed."""
    import torch
    if selected is None and not torch.cuda.is_available():
        raise SystemExit("--mode gpu-report needs a CUDA device (its parts are tested on the CPU)")
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    outcomes = []
    for part in selected or parts():
        print(f"{part.title} (limit {part.timeout_s} s) ...", file=sys.stderr, flush=True)
        outcomes.append(run_part(part))
    write_report(report_path, outcomes, command)
    print(f"report written to {report_path}", file=sys.stderr)
    return sum(o.returncode != 0 for o in outcomes)
