"""The shape of the code, held to what README says of it: the packages stack one way
(a module imports only from its own layer or below), no imports run in a circle, no
module is over ~400 lines, a built wheel holds every package and imports, and starting the
engine imports no compiler."""
import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "models", "nanokv")
# Lowest first. A module belongs to the longest prefix that names it.
LAYERS = [
    ("kernels",),                                  # the ops; the only place that knows the backends
    ("models",),                                   # the model and all its forward pass reads
    ("nanokv.checks",),                            # checks of user-given values
    ("nanokv.eviction",),                          # eviction policy: settings, schedules, rankings
    ("nanokv.config", "nanokv.sampling_params"),   # what users set: engine options, request parameters
    ("nanokv.engine",),                            # one step
    ("nanokv", "nanokv.llm", "nanokv.tokenizer"),  # the public face
    ("nanokv.serve", "nanokv.tools"),              # on top: the server and the tools
]
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports (anywhere in it, TYPE_CHECKING included)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def layer(name: str) -> int:
    matches = [(len(prefix), i) for i, group in enumerate(LAYERS) for prefix in group
               if name == prefix or name.startswith(prefix + ".")]
    return max(matches)[1]


def test_layers_stack_one_way():
    known = modules()
    climbs = [f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
              for name, path in known.items() for target in imports(name, path, known) if layer(target) > layer(name)]
    assert climbs == []


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    state, cycles = {}, []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[name] = "done"
    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_module_is_too_long():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_kernel_backends_are_known_only_inside_kernels():
    """The engine asks kernels questions (kernels.check_device, captures_graphs, ...), never a backend's name."""
    outside = [str(path.relative_to(ROOT)) for name, path in modules().items()
               if not name.startswith("kernels") and ("backend(" in path.read_text() or "BACKEND" in path.read_text())]
    assert outside == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of a copy of the sources (a build in place would leave build/ behind,
    and a stale build/ can put modules that no longer exist into the wheel)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--quiet", "-w", str(out)],
                   check=True, capture_output=True, timeout=600)
    (built,) = out.glob("nanokv-*.whl")
    return built


def test_the_wheel_holds_every_module_and_imports_them(wheel, tmp_path):
    known = modules()
    files = {str(path.relative_to(ROOT)) for path in known.values()}
    with zipfile.ZipFile(wheel) as archive:
        assert files <= set(archive.namelist())
        archive.extractall(tmp_path / "site")
    names = sorted(name for name, path in known.items() if path.name != "__main__.py")
    script = (f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\n"
              "import nanokv\nprint(nanokv.__file__)")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path / "site"))


def test_starting_the_engine_leaves_the_compiler_unimported():
    """What chat.py, the server and every tensor-parallel rank import and build at their start:
    not torch.compile's machinery (torch._dynamo, torch._inductor), which takes seconds to
    import and which the engine never uses."""
    script = ("import sys\nimport nanokv, nanokv.engine.workers, nanokv.serve.server\n"
              "nanokv.LLM('random:tiny', dtype='float32').generate([[1, 2, 3]], nanokv.SamplingParams(max_tokens=2))\n"
              "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
