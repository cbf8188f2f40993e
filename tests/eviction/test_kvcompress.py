"""KV-Compress against a dense float64 oracle written from the paper.

The oracle keeps one plain list of pairs per (layer, KV head), of any length, and
implements Section 4.2.2's block eviction literally: per head, the pairs sorted by
metric with the empty slots of its last page first; evicting e pages costs the
(e * bs)-th lowest; pages go one at a time to the head whose next page is cheapest.
The metric is Section 4.3's squared attention, summed over the query group and the
last `kv_window` queries before an eviction (KVC-w), or with kv_score_all (KVC-full,
eq. 19) over every query so far, never reset, except on the `kv_window` keys nearest
before each query. No pages, tables or kernels: the engine must keep exactly the same
positions per head and the same greedy tokens.
"""
from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.eviction_order import eviction_order_ref, eviction_order_triton
from kernels.hole_filling import hole_moves_ref, hole_moves_triton
from kernels.page_choice import choose_pages_ref, choose_pages_triton
from kernels.repaging import repage_ref, repage_triton
from nanokv.eviction.pages import held_pages
from helpers import KERNEL_DEVICE
from oracle import BLOCK, differences, distinct_prompt as prompt, engine

# ----- the block-eviction schedule on its own ---------------------------------------------

def greedy_page_eviction(priority, lens, num_pages, bs, floor):
    """The schedule one page at a time: [L, H] pages each head gives up and, per head, the
    slots it keeps (ascending)."""
    L, H, _ = priority.shape
    order, evicted = {}, {}
    for l in range(L):
        for h in range(H):
            n, pages = int(lens[l, h]), -(-int(lens[l, h]) // bs)
            real = sorted(range(n), key=lambda j: (float(priority[l, h, j]), j))
            order[l, h] = [None] * (pages * bs - n) + real     # empty slots first
            evicted[l, h] = 0
    for _ in range(num_pages):
        def cost(head):
            e = evicted[head] + 1
            if e > len(order[head]) // bs - floor:
                return math.inf
            slot = order[head][e * bs - 1]
            return -math.inf if slot is None else float(priority[head][slot])
        head = min(order, key=lambda hd: (cost(hd), hd))   # ties: the lower (layer, head)
        assert cost(head) < math.inf
        evicted[head] += 1
    kept = {hd: sorted(j for j in order[hd][evicted[hd] * bs:] if j is not None) for hd in order}
    return torch.tensor([[evicted[l, h] for h in range(H)] for l in range(L)]), kept


def on_kernel_device(kernel):
    """kernel run where Triton kernels run here (the interpreter on the CPU, else the GPU): its
    results, and the tensors it writes in place, back on the CPU."""
    def run(*args):
        moved = [a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        results = kernel(*moved)
        for a, m in zip(args, moved):
            if isinstance(a, torch.Tensor) and m is not a:
                a.copy_(m)
        return tuple(x.cpu() for x in results)
    return run


KERNELS = [pytest.param(eviction_order_ref, choose_pages_ref, hole_moves_ref, id="reference"),
           pytest.param(*map(on_kernel_device, (eviction_order_triton, choose_pages_triton, hole_moves_triton)),
                        id="triton")]


@pytest.mark.parametrize("eviction_order, choose_pages, hole_moves", KERNELS)
@pytest.mark.parametrize("seed", range(6))
def test_page_eviction_takes_the_cheapest_pages_across_heads(seed, eviction_order, choose_pages, hole_moves):
    g = torch.Generator().manual_seed(seed)
    L, H, bs, width = 3, 2, 4, 6
    n = width * bs
    lens = torch.randint(bs + 1, n + 1, (L, H), generator=g).int()
    priority = torch.randint(0, 6, (L, H, n), generator=g).float()   # many ties
    priority[0, 0, :3] = math.inf                                     # protected pairs
    floor = 1 + seed % 2
    room = int((-(-lens // bs) - floor).clamp(min=0).sum())
    num_pages = int(torch.randint(1, room + 1, (), generator=g))
    positions = torch.arange(n).expand(L, H, -1)   # ties by position: by slot, as the greedy oracle breaks them
    pages = held_pages(lens, bs)
    order, costs = eviction_order(priority, positions.int(), lens, pages, bs, floor)
    evicted = choose_pages(costs[None], pages[None], pages.sum().view(1) - num_pages)[0]
    expected_evicted, expected_kept = greedy_page_eviction(priority, lens, num_pages, bs, floor)
    assert torch.equal(evicted, expected_evicted)
    counts = torch.zeros(2, dtype=torch.int64)
    *_, new_lens = hole_moves(order[None], lens[None], evicted[None] * bs, n, L * H * n, counts)
    num_moves = int(counts[1])
    dropped = sum(int(lens[head]) - len(kept) for head, kept in expected_kept.items())
    assert int(counts[0]) == int((lens - new_lens[0]).sum()) == dropped
    # The heads' slots end to end (each holding its own pair), the moves made at once, in as many
    # columns as there are moves and in two more (head (0, 0)'s last held slot onto itself).
    for columns in (num_moves, num_moves + 2):
        src, dst, new_lens = hole_moves(order[None], lens[None], evicted[None] * bs, n, columns, counts)
        assert src.shape == dst.shape == (1, columns)
        heads = list(range(L * H * n))
        writes = {}
        for a, b in zip(src[0].tolist(), dst[0].tolist()):   # every value read before any is written
            writes.setdefault(b, set()).add(heads[a])
        assert all(len(values) == 1 for values in writes.values())   # no slot gets two different pairs
        for b, (value,) in writes.items():
            heads[b] = value
        changed = [b for b, (value,) in writes.items() if value != b]
        assert len(changed) == num_moves
        for (l, h), slots in expected_kept.items():
            first = (l * H + h) * n
            assert new_lens[0, l, h] == len(slots)
            assert sorted(v - first for v in heads[first:first + len(slots)]) == slots
            mine = [b for b in changed if first <= b < first + n]
            assert all(first <= heads[b] < first + n for b in mine)   # within the head
            assert len(mine) <= lens[l, h] - len(slots)                # one write per pair evicted
            assert new_lens[0, l, h] % bs == 0 or evicted[l, h] == 0   # a head that gave pages keeps whole ones


REPAGES = [pytest.param(repage_ref, id="reference"), pytest.param(on_kernel_device(repage_triton), id="triton")]


@pytest.mark.parametrize("repage", REPAGES)
@pytest.mark.parametrize("tight", [False, True])
def test_pages_leave_the_blocks_given_back_and_the_rest_are_shared_out(tight, repage):
    """Two sequences repaged together (their pages distinct): each as if alone, whatever the
    bound on the moves (tight: the most pages one of them moves); the second's heads get no
    more spare pages than its cap, and the tables are as wide as the host's bound says."""
    L, H, W = 2, 3, 4
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(80, dtype=torch.int32, generator=g)[:2 * L * H * W].view(2, L, H, W)   # some unused
    kept = torch.tensor([[[4, 1, 2], [0, 3, 1]], [[1, 0, 2], [1, 0, 1]]])   # shares of 1 and 2 spare pages
    free = [t for t in range(80) if t not in tables]
    staying = torch.stack([torch.cat([tables[s][kept[s] > 1][:, 0], torch.tensor(free[s::2], dtype=torch.int32)])[:17]
                           for s in range(2)])
    leaving = [sum(p not in staying[s] for l in range(L) for h in range(H) for p in tables[s, l, h, :kept[s, l, h]])
               for s in range(2)]
    cap = torch.tensor([5, 1])
    moved_pages = torch.zeros((), dtype=torch.int64)
    new, moves, widths = repage(tables, kept, staying, max(leaving) if tight else L * H * W, 80, cap, W + 2,
                                moved_pages)
    src, dst = moves[:, 0], moves[:, 1]
    assert src.shape == dst.shape == (2, max(leaving) if tight else L * H * W) and new.shape[-1] == W + 2
    assert int(moved_pages) == sum(leaving)
    assert widths.tolist() == [int(kept[0].max()) + 1, int(kept[1].max()) + 1]
    pairs = list(zip(src.flatten().tolist(), dst.flatten().tolist()))
    moved = {a: b for a, b in pairs if a != b}
    assert len(moved) == sum(leaving) and not {a for a, b in pairs if a == b} & set(moved.values())   # the rest: no-ops
    for s in range(2):
        used = {(l, h): tables[s, l, h, :kept[s, l, h]].tolist() for l in range(L) for h in range(H)}
        assert {p for p in moved if p in tables[s]} == {p for pages in used.values() for p in pages
                                                          if p not in staying[s]}
        share = (len(staying[s]) - int(kept[s].sum())) // (L * H)
        assert share == s + 1
        share = min(share, int(cap[s]))
        everything = []
        for (l, h), pages in used.items():
            row = new[s, l, h, :kept[s, l, h] + share].tolist()
            assert row[:kept[s, l, h]] == [moved.get(p, p) for p in pages]   # in order, moved where they had to
            assert not new[s, l, h, kept[s, l, h] + share:].any()
            everything += row
        assert len(set(everything)) == len(everything) and set(everything) <= set(staying[s].tolist())


@pytest.mark.parametrize("repage", REPAGES)
def test_a_sequence_keeping_fewer_blocks_than_another_is_never_handed_their_padding(repage):
    """staying's -1 entries (a sequence keeping fewer blocks than another) are no pages: not
    unused ones to share out, also when every column of every head is in use (no column
    names 'none' among the pages used)."""
    tables = torch.arange(8, dtype=torch.int32).view(2, 1, 2, 2)   # each head uses both its pages
    kept = torch.full((2, 1, 2), 2)
    staying = torch.tensor([[0, 1, 2, 3, 8, 9], [4, 5, 6, 7, -1, -1]], dtype=torch.int32)
    moved_pages = torch.zeros((), dtype=torch.int64)
    new, moves, widths = repage(tables, kept, staying, 1, 10, torch.tensor([4, 4]), 3, moved_pages)
    assert new[0, 0].tolist() == [[0, 1, 8], [2, 3, 9]]   # one spare page a head
    assert new[1, 0].tolist() == [[4, 5, 0], [6, 7, 0]] and widths.tolist() == [3, 2]   # none: no share
    assert (moves[:, 0] == moves[:, 1]).all() and int(moved_pages) == 0   # nothing leaves


def test_a_width_that_lands_late_keeps_what_evictions_added_since(monkeypatch):
    """A sequence's width (the columns its rows are read to) is the bound each eviction writes
    until the exact one (its widest head's pages) reaches the host; one that lands after later
    evictions adds what their bounds added since: its heads may have grown as much."""
    from types import SimpleNamespace

    from nanokv.engine.head_pages import HeadTables, Landing, OwnPages

    values, blocked = Landing.values, [True]
    monkeypatch.setattr(Landing, "values", lambda landing: None if blocked[0] else values(landing))
    head_tables = HeadTables(2, SimpleNamespace(num_layers=1, num_kv_heads=1, k=torch.zeros(1)))
    own, lens = OwnPages(row=1, width=0, slots=0), torch.zeros(1, 1, 1, dtype=torch.int32)

    def evicted(width: int, widest: int) -> int:   # the width a read then takes
        head_tables.write(torch.tensor([1]), torch.arange(width, dtype=torch.int32).view(1, 1, 1, width), lens,
                          [own], torch.tensor([widest]))
        return head_tables.rows([own], [0])[1]
    assert evicted(6, 4) == 6 and evicted(8, 5) == 8   # bounds, while nothing lands
    blocked[0] = False
    assert head_tables.rows([own], [0])[1] == 4 + 8 - 6   # the first landed: 4, and 2 added since
    assert evicted(9, 3) == 3 and head_tables.tables.shape[-1] == 12   # landed at once; the table grew


# ----- the model oracle -------------------------------------------------------------------

class HeadKV:
    """One (layer, KV head)'s pairs, in position order."""

    def __init__(self, head_dim: int):
        self.k = torch.empty(0, head_dim, dtype=torch.float64)
        self.v = torch.empty(0, head_dim, dtype=torch.float64)
        self.pos = torch.empty(0, dtype=torch.long)
        self.score = torch.empty(0, dtype=torch.float64)

    def append(self, k, v, pos):
        self.k, self.v = torch.cat([self.k, k]), torch.cat([self.v, v])
        self.pos = torch.cat([self.pos, pos])
        self.score = torch.cat([self.score, torch.zeros(len(pos), dtype=torch.float64)])

    def keep(self, rows: list[int]):
        self.k, self.v, self.pos, self.score = self.k[rows], self.v[rows], self.pos[rows], self.score[rows]


@torch.no_grad()
def oracle_forward(oracle, cache, ids, positions, counts):
    """Oracle.forward with a list of pairs per head, adding the squared probabilities of the
    (query, key) pairs that count: counts(query positions [T], key positions [n]) -> [T, n or 1] bool."""
    pos = torch.tensor(positions)
    T, H, Hkv, D = len(ids), oracle.num_heads, oracle.num_kv_heads, oracle.head_dim
    group = H // Hkv
    x = oracle.model.embed_tokens(torch.tensor(ids))
    for layer, heads in zip(oracle.model.layers, cache):
        attn = layer.self_attn
        h = oracle.rms_norm(x, layer.input_layernorm)
        q = oracle.rope(attn.q_proj(h).view(T, H, D).transpose(0, 1), pos)
        k = oracle.rope(attn.k_proj(h).view(T, Hkv, D).transpose(0, 1), pos)
        v = attn.v_proj(h).view(T, Hkv, D).transpose(0, 1)
        out = torch.empty(T, H, D, dtype=torch.float64)
        for kv_head, kv in enumerate(heads):
            kv.append(k[kv_head], v[kv_head], pos)
            for qh in range(kv_head * group, (kv_head + 1) * group):
                logits = (q[qh] @ kv.k.T / math.sqrt(D)).masked_fill(kv.pos[None] > pos[:, None], -math.inf)
                probs = logits.softmax(dim=-1)
                kv.score += (probs ** 2 * counts(pos, kv.pos)).sum(dim=0)
                out[:, qh] = probs @ kv.v
        x = x + attn.o_proj(out.reshape(T, H * D))
        x = x + layer.mlp(oracle.rms_norm(x, layer.post_attention_layernorm))
    return oracle.lm_head(oracle.rms_norm(x, oracle.model.norm))


def eviction_points(schedule, prompt_len, budget, p, end):
    """{position before which the cache evicts: the pairs per head it keeps on average}."""
    if schedule == "once":
        return {prompt_len: budget} if prompt_len > budget else {}
    first = prompt_len if schedule == "decode" and prompt_len > budget - p else budget
    return {t: budget - p for t in range(first, end, p)}


def kvcompress_oracle(oracle, ids, budget, p, max_tokens, schedule="prefill", bs=BLOCK, window=8, sinks=0,
                      score_all=False):
    """Greedy tokens and kept positions [L, H, n] (-1 padded) of kvcompress: before each
    eviction point the heads give up whole pages, as many as leave them the point's pairs
    per head on average; under prefill the prompt is read |kv| tokens, then p at a time.
    score_all: KVC-full's metric."""
    L, Hkv = len(oracle.model.layers), oracle.num_kv_heads
    cache = [[HeadKV(oracle.head_dim) for _ in range(Hkv)] for _ in range(L)]
    evictions = eviction_points(schedule, len(ids), budget, p, len(ids) + max_tokens - 1)
    recent = window

    def counts(q_pos, k_pos):
        if score_all:   # every query, except on the `window` keys nearest before it
            return q_pos[:, None] - k_pos[None] >= window
        return torch.tensor([any(e - window <= int(i) < e for e in evictions) for i in q_pos])[:, None]

    def feed(tokens, start):
        return oracle_forward(oracle, cache, tokens, list(range(start, start + len(tokens))), counts)

    def evict(after):
        lens = torch.tensor([[len(kv.pos) for kv in heads] for heads in cache])
        width = -(-int(lens.max()) // bs) * bs
        priority = torch.full((L, Hkv, width), math.inf, dtype=torch.float64)
        for l, heads in enumerate(cache):
            for h, kv in enumerate(heads):
                n = len(kv.pos)
                protected = (kv.pos < sinks) | (torch.arange(n) >= n - recent)
                priority[l, h, :n] = kv.score.masked_fill(protected, math.inf)
        pages = int((-(-lens // bs)).sum()) - after * L * Hkv // bs
        _, kept = greedy_page_eviction(priority, lens, pages, bs, -(-recent // bs))
        for (l, h), rows in kept.items():
            cache[l][h].keep(rows)
            if not score_all:   # KVC-w's window restarts
                cache[l][h].score.zero_()

    chunk = budget if schedule == "prefill" else len(ids)
    logits, position = feed(ids[:chunk], 0), min(chunk, len(ids))
    while position < len(ids):
        evict(evictions[position])
        logits = feed(ids[position:position + p], position)
        position = min(position + p, len(ids))
    tokens = [int(logits[-1].argmax())]
    for position in range(len(ids), len(ids) + max_tokens - 1):
        if position in evictions:
            evict(evictions[position])
        tokens.append(int(feed(tokens[-1:], position)[-1].argmax()))
        if schedule != "once":
            assert sum(len(kv.pos) for heads in cache for kv in heads) <= budget * L * Hkv
    width = max(len(kv.pos) for heads in cache for kv in heads)
    kept = torch.full((L, Hkv, width), -1, dtype=torch.long)
    for l, heads in enumerate(cache):
        for h, kv in enumerate(heads):
            kept[l, h, :len(kv.pos)] = kv.pos
    return tokens, kept


def params(budget, p, max_tokens, schedule="prefill", score_all=False):
    from nanokv import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_method="kvcompress",
                          kv_schedule=schedule, kv_budget=budget, evict_every=p, kv_score_all=score_all,
                          return_kept_positions=True)


# (schedule, budget, p, prompt, tokens[, KVC-full]) for pages of 16 slots, then of 4, where heads have more
# pages to trade
CASES = {16: [("prefill", 32, 16, 70, 12), ("prefill", 32, 16, 33, 20), ("prefill", 48, 16, 100, 8),
              ("prefill", 64, 32, 90, 6), ("decode", 32, 16, 70, 12), ("decode", 48, 16, 40, 30),
              ("once", 32, 16, 70, 12), ("once", 48, 16, 100, 8), ("prefill", 32, 16, 70, 12, True)],
         4: [("prefill", 32, 8, 80, 20), ("prefill", 40, 8, 70, 9), ("decode", 32, 8, 75, 15),
             ("once", 24, 8, 60, 10), ("prefill", 40, 8, 70, 9, True), ("decode", 32, 8, 60, 10, True),
             ("once", 24, 8, 60, 8, True)]}


@pytest.mark.parametrize("bs", CASES)
def test_kvcompress_keeps_what_the_oracle_keeps(model, bs):
    """Every schedule, all cases of a block size in one batch; the heads keep different numbers
    of pairs, and the sequence never holds more than its budget (under prefill and decode)."""
    path, _, oracle = model
    llm = engine(path, block_size=bs)
    cases = [(*case, False)[:6] for case in CASES[bs]]
    prompts = [prompt(s, seed=0) for _, _, _, s, _, _ in cases]
    outs = llm.generate(prompts, [params(b, p, n, schedule, full) for schedule, b, p, _, n, full in cases])
    problems = []
    for (schedule, b, p, s, n, full), ids, out in zip(cases, prompts, outs):
        tokens, kept = kvcompress_oracle(oracle, ids, b, p, n, schedule=schedule, bs=bs, score_all=full)
        problems += differences(f"{schedule}{' KVC-full' if full else ''} budget={b} p={p} prompt={s}", out,
                                tokens, kept)
    assert not problems, "\n".join(problems)
    held = torch.stack([(out.kept_positions >= 0).sum(dim=-1) for out in outs])
    assert bs == 16 or (held.amin(dim=(1, 2)) < held.amax(dim=(1, 2))).any()   # heads kept different numbers
    assert llm.runner.kv_cache.num_blocks == llm.scheduler.blocks.num_free   # every block went back


@pytest.mark.parametrize("schedule, late", [("prefill", False), ("decode", False), ("prefill", True)])
def test_kvcompress_sequences_evicting_together_keep_what_each_keeps_alone(model, schedule, late, monkeypatch):
    """Prompts of one length under one method evict in the same steps, as one group (pages
    chosen and moved together, before and after their heads have pages of their own): each
    keeps the oracle's positions and tokens. late: the widths an eviction leaves reach the host
    only after two more queries, as on a GPU that is behind (the next evictions take bounds)."""
    from nanokv.engine.head_pages import Landing

    if late:
        values, queried = Landing.values, {}

        def landing_late(landing):
            queried[id(landing)] = queried.get(id(landing), 0) + 1
            return values(landing) if queried[id(landing)] > 6 else None
        monkeypatch.setattr(Landing, "values", landing_late)
    repage, bounds = kernels.repage, []

    def bounded(*args):
        new_tables, moves, widths = repage(*args)
        bounds.append((args[-2], int(widths.max())))   # the host's bound, the widest head's pages
        return new_tables, moves, widths
    monkeypatch.setattr(kernels, "repage", bounded)
    path, _, oracle = model
    llm = engine(path, block_size=4)
    prompts = [prompt(60, seed=seed) for seed in range(3)]
    outs = llm.generate(prompts, params(32, 8, 20, schedule))
    problems = []
    for seed, (ids, out) in enumerate(zip(prompts, outs)):
        tokens, kept = kvcompress_oracle(oracle, ids, 32, 8, 20, schedule=schedule, bs=4)
        problems += differences(f"{schedule} prompt seed {seed}", out, tokens, kept)
    assert not problems, "\n".join(problems)
    assert llm.runner.kv_cache.num_blocks == llm.scheduler.blocks.num_free
    assert bounds and all(bound >= widest for bound, widest in bounds), bounds
    assert not late or max(queried.values()) > 6   # the bounds were taken, then the widths landed


def test_kvcompress_beside_other_methods_and_preempted(gqa):
    """One batch mixes kvcompress with batchmax and the full cache, in a pool so small that
    requests are preempted and recomputed: each still matches its run alone."""
    from nanokv import SamplingParams

    path, _, oracle = gqa
    ids = [prompt(50, seed=10), prompt(60, seed=11), prompt(70, seed=12)]
    others = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, kv_method="batchmax", kv_budget=32,
                             evict_every=16)]
    alone = [engine(path).generate([i], [p])[0].token_ids for i, p in zip(ids, others)]
    llm = engine(path, num_kv_blocks=8, max_model_len=128)
    outs = llm.generate(ids, [*others, params(32, 16, 20)])   # the full cache grows: the last admitted goes
    assert llm.scheduler.num_preemptions > 0
    tokens, kept = kvcompress_oracle(oracle, ids[2], 32, 16, 20)
    assert not differences("kvcompress", outs[2], tokens, kept)
    assert [o.token_ids for o in outs[:2]] == alone
    assert llm.scheduler.blocks.num_free == 8


@pytest.mark.parametrize("bad, message", [
    (dict(kv_schedule="once", kv_budget=40), "multiples of the block size"),
    (dict(evict_every=8), "multiples of the block size"),
    (dict(kv_recent=20), "whole pages"),
    (dict(kv_pool=3), "kv_pool is a setting of snapkv only"),
])
def test_kvcompress_settings_are_checked(bad, message):
    from nanokv.eviction import make_method

    settings = dict(kv_schedule=None, kv_budget=32, evict_every=16, kv_recent=None, kv_pool=None) | bad
    with pytest.raises(ValueError, match=message):
        make_method("kvcompress", settings["kv_schedule"], settings["kv_budget"], settings["evict_every"], BLOCK,
                    recent=settings["kv_recent"], pool=settings["kv_pool"])


def test_kvc_full_settings_are_checked():
    """kv_score_all belongs to kvcompress and is a bool; `all=1` writes it in a method spec.
    KVC-full is not windowed: its queries skip the kv_window keys nearest before them, which
    it keeps (no query counted them yet)."""
    from nanokv import SamplingParams
    from nanokv.config import EngineConfig
    from nanokv.eviction import make_method
    from nanokv.tools.method_spec import parse_spec

    with pytest.raises(ValueError, match="kv_score_all is a setting of kvcompress only; it must be None for h2o"):
        make_method("h2o", None, 32, 16, BLOCK, score_all=False)
    with pytest.raises(TypeError, match="kv_score_all must be None or True or False, got 1"):
        SamplingParams(kv_score_all=1)
    with pytest.raises(TypeError, match="kv_score_all must be None or True or False, got 'yes'"):
        EngineConfig(kv_score_all="yes")
    with pytest.raises(ValueError, match="bad setting 'all=2'"):
        parse_spec("kvcompress,all=2")
    assert parse_spec("kvcompress@decode,all=1,window=4") == dict(kv_method="kvcompress", kv_schedule="decode",
                                                                  kv_score_all=True, kv_window=4)
    method = make_method("kvcompress", None, 32, 16, BLOCK, window=4, score_all=True)
    assert (method.score_skip, method.windowed, method.recent) == (4, False, 4)
    assert make_method("kvcompress", None, 32, 16, BLOCK, window=4).score_skip == 0
