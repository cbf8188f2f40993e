"""The Triton tests build every tensor on a device they are given (helpers.KERNEL_DEVICE, or
one passed in), never on the CPU by default: on a GPU a CPU tensor would meet CUDA ones, or
reach a compiled kernel. Without CUDA every device is the CPU and such a slip passes unseen,
so this test looks for it in the source."""
import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
CPU_ONLY = {"test_attention_cpu.py", "test_linear_cpu.py"}   # they test the CPU backend, on the CPU
MODULES = [p for p in sorted((TESTS / "kernels").glob("*.py")) if p.name not in CPU_ONLY]
MODULES.append(TESTS / "engine" / "test_triton_engine.py")
FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "randperm",
             "linspace", "logspace", "eye"}


def is_torch(node, names):
    return (isinstance(node, ast.Attribute) and node.attr in names
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def unplaced(tree):
    """Calls that build tensors (torch factories) or an engine (LLM) with no device=, outside a
    `with torch.device(...)`, or with a literal device; a tensor turned at once into Python
    values (.tolist(), .item()) is no tensor."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def in_device_block(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.With) and any(
                    isinstance(item.context_expr, ast.Call) and is_torch(item.context_expr.func, {"device"})
                    and not isinstance(item.context_expr.args[0], ast.Constant) for item in node.items):
                return True
        return False

    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or not (is_torch(call.func, FACTORIES)
                                                  or isinstance(call.func, ast.Name) and call.func.id == "LLM"):
            continue
        device = next((k.value for k in call.keywords if k.arg == "device"), None)
        parent = parents.get(call)
        if isinstance(device, ast.Constant) or device is None and not (
                in_device_block(call) or isinstance(parent, ast.Attribute) and parent.attr in ("tolist", "item")):
            yield call


def test_the_check_finds_tensors_on_a_default_or_literal_device():
    source = """
a = torch.zeros(3)
b = torch.arange(3, device="cpu")
c = LLM(path, dtype="float32")
d = torch.randn(2, device=device) + torch.tensor([1, 2], device=x.device)
e = torch.randint(0, 9, (4,)).tolist()
with torch.device(KERNEL_DEVICE):
    f = torch.ones(2)
with torch.device("cpu"):
    g = torch.ones(2)
"""
    assert sorted(call.lineno for call in unplaced(ast.parse(source))) == [2, 3, 4, 10]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_triton_tests_name_the_device_of_every_tensor(path):
    found = [f"{path.name}:{call.lineno}: {ast.unparse(call)[:80]}" for call in unplaced(ast.parse(path.read_text()))]
    assert found == [], "build these on KERNEL_DEVICE (or the device passed in): on a GPU they would be CPU tensors"
