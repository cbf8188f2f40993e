"""KVPR's split against a brute-force scan of l, and on the shapes where it pays and where not;
swapping against recomputing a preempted sequence."""
import random

import pytest
import torch

from models.shapes import shape_config
from nanokv.engine.offload_costs import PositionCost, SwapCost, best_split, measure_link_and_device

PCIE, H100 = 25e9, 4e14   # bytes/s host to device, flops/s: the order of a real GPU server


def test_the_split_is_the_best_of_every_l():
    rng = random.Random(0)
    for _ in range(2000):
        cost = PositionCost(rng.uniform(0, 2), rng.uniform(0.01, 2), rng.choice([0.0, rng.uniform(0, 3)]))
        s = rng.randrange(0, 300)
        times = [cost.layer_time(l, s) for l in range(s + 1)]
        assert best_split(s, cost) == times.index(min(times)), (cost, s)


@pytest.mark.parametrize("shape, pays", [("llama-3.1-8b", False), ("smollm2-135m", False), ("qwen3-0.6b", True),
                                         ("llama-2-7b", True)])
def test_it_pays_only_where_a_layer_input_is_smaller_than_its_kv(shape, pays):
    cost = PositionCost.of(shape_config(shape), torch.bfloat16, torch.bfloat16, False, PCIE, H100)
    l = best_split(1024, cost)
    assert (l > 0) == pays
    if pays:   # the link carries inputs of l positions and K/V of the rest, while the device recomputes
        assert 0 < l < 1024 and cost.layer_time(l, 1024) < 0.65 * cost.layer_time(0, 1024)


def test_an_8bit_cache_leaves_little_to_gain():
    """Qwen3-0.6B's K/V in int8 are as large as its bf16 layer input but for the scales."""
    cost = PositionCost.of(shape_config("qwen3-0.6b"), torch.bfloat16, torch.int8, True, PCIE, H100)
    assert cost.layer_time(best_split(1024, cost), 1024) > 0.95 * cost.layer_time(0, 1024)


def test_the_link_and_the_device_are_measured():
    link, flops = measure_link_and_device(torch.device("cpu"), torch.float32, 256, 128)
    assert link > 1e8 and flops > 1e8


def test_engines_after_the_first_do_not_measure_again(tiny_models):
    """Every engine of a process (and the bench's split table) weighs the first measurement."""
    from nanokv import LLM

    measure_link_and_device.cache_clear()
    engines = [LLM(str(tiny_models("qwen3")), dtype="float32", max_model_len=112, max_num_seqs=8, num_kv_blocks=16,
                   kv_offload_gb=0.0008, decode_from_host=True) for _ in range(2)]
    assert measure_link_and_device.cache_info().misses == 1
    assert engines[0].runner.link_and_device == engines[1].runner.link_and_device


@pytest.mark.parametrize("shape, device_flops, swaps", [
    ("llama-3.1-8b", H100, True),     # 128 kB of K/V a token over PCIe against 15 Gflop
    ("smollm2-135m", H100, False),    # 23 kB against 0.2 Gflop: quicker to prefill again
    ("smollm2-135m", 2e11, True),     # ... but not on a CPU
])
def test_a_swap_pays_where_moving_kv_is_quicker_than_recomputing(shape, device_flops, swaps):
    model = shape_config(shape)
    block_bytes = 16 * model.num_layers * 2 * model.num_kv_heads * model.head_dim * 2   # bf16, 16 tokens
    cost = SwapCost.of(model, block_bytes, PCIE, device_flops)
    assert cost.pays(num_blocks=64, num_tokens=64 * 16) == swaps
