"""Eviction surgery: the scheduler's evictions carried out on the paged cache.

The scheduler decides who drops how many pairs (the method's schedule); here each
(layer, KV head)'s pairs are read from the cache, ranked by the method's ranking,
and the holes the evicted pairs leave below the head's new length are filled by the
survivors above it (kernels.hole_moves, kernels.move_slots): an eviction writes at most as
many pairs as it drops, and slot order is not position order. Sequences of one rule,
size and count are ranked together; an uneven method (kvcompress) gives up whole
pages chosen across all its heads and layers, of every rank when the model is split
(nanokv/eviction/pages.py).

Ranking allocates memory per held pair and moving per evicted pair (ranked_pair_bytes, moved_pair_bytes),
so the pairs are taken a piece at a time, (sequences, layers), each within piece_bytes but at
least one layer of one sequence: reserve_bytes is what the pool sizing sets aside for it.
Each piece costs the same torch ops whatever it holds, so the fewer the pieces, the fewer
the launches: a piece is as large as its bound allows.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np
import torch

import kernels
from models import KVCache
from models.tensor_parallel import Shard
from nanokv.engine.head_pages import HeadTables, Landing, OwnPages
from nanokv.engine.press_window import PressWindow
from nanokv.engine.scheduler import Eviction
from nanokv.engine.sequence import Sequence
from nanokv.eviction import HeldPairs, KVMethod
from nanokv.eviction.pages import held_pages

PIECE_BYTES = 256 * 2**20
PIECE_SHARE = 64   # on a GPU a piece may take 1/64 of its memory, if that is more than PIECE_BYTES
# What ranking and choosing allocate per held pair, all of it counted (tests/eviction/test_eviction_cost.py
# measures it): positions, scores, priorities, the selection's masks and indices; KV-Compress sorts
# every head's slots into eviction order, then its holes and its movers.
RANKED_PAIR_BYTES = 96
UNEVEN_RANKED_PAIR_BYTES = 384


def ranked_pair_bytes(head_dim: int, kv_dtype: torch.dtype, method: KVMethod, group: int) -> int:
    """What ranking one held pair allocates under method: a ranking that reads keys (K-norm)
    also takes each key, dequantized, in fp32; one that reads values too (a press), each value,
    and both again in position order; a press that reads layer inputs, what scoring the pair
    against the queries of those positions takes (press_window_bytes)."""
    ranking = method.ranking
    read = head_dim * (kv_dtype.itemsize + 4) + 4
    reads = 4 * read if ranking.reads_values else read if ranking.reads_keys else 0
    return ((UNEVEN_RANKED_PAIR_BYTES if method.uneven else RANKED_PAIR_BYTES) + reads
            + press_window_bytes(head_dim, group, ranking.inputs))


def press_window_bytes(head_dim: int, group: int, inputs: int) -> int:
    """What a press that reads the layer inputs of `inputs` positions takes per held pair, as
    kvpress's SnapKV does: the key repeated for each query head of its group (fp32), and four
    fp32 matrices [queries, pairs] of attention weights, mask and softmax a query head."""
    return group * (4 * head_dim + 16 * inputs) if inputs else 0


def moved_pair_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """What moving one pair allocates: its K, V, position, score and scales gathered, and its
    slot indices."""
    return 2 * head_dim * kv_dtype.itemsize + 96


def reserve_bytes(num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, max_model_len: int, group: int,
                  press_window: int, bound: int) -> int:
    """What eviction allocates at most at once: a piece (within bound), or one layer of a
    sequence as long as it gets, ranked by the costliest ranking (an AdaKV press: uneven,
    reading keys and values, and the layer inputs of the press_window positions the engine
    keeps) and every pair moved."""
    worst = (UNEVEN_RANKED_PAIR_BYTES + 4 * (head_dim * (kv_dtype.itemsize + 4) + 4)
             + press_window_bytes(head_dim, group, press_window))
    return max(bound, num_kv_heads * max_model_len * (worst + moved_pair_bytes(head_dim, kv_dtype)))


def piece_bytes(device: torch.device) -> int:
    """The bound on one piece on device: PIECE_BYTES, or a GPU's memory over PIECE_SHARE if that
    is more. Every piece runs the same launches, so a large GPU evicts a batch in few: kvcompress
    at the Qwen3-0.6B shape allocates ~200 MB per sequence, one sequence a piece of PIECE_BYTES."""
    if device.type != "cuda":
        return PIECE_BYTES
    return max(PIECE_BYTES, torch.cuda.get_device_properties(device).total_memory // PIECE_SHARE)


def cut_pieces(num_seqs: int, num_layers: int, layer_bytes: int, bound: int,
               seq_bytes: int = 0) -> list[tuple[slice, slice]]:
    """(sequences, layers) of a group, each within bound bytes when one layer of one sequence
    costs layer_bytes, and its moves seq_bytes whatever its layers: whole sequences while one
    fits, else one sequence's layers a few at a time (at least one)."""
    layers = max(1, min(num_layers, (bound - seq_bytes) // layer_bytes))
    if layers < num_layers:
        return [(slice(s, s + 1), slice(first, first + layers))
                for s in range(num_seqs) for first in range(0, num_layers, layers)]
    seqs = max(1, bound // (num_layers * layer_bytes + seq_bytes))
    return [(slice(first, first + seqs), slice(None)) for first in range(0, num_seqs, seqs)]


def read_slots(per_slot: torch.Tensor, tables: torch.Tensor, n: int) -> torch.Tensor:
    """The first n slots of each head, through its pages tables [S, L, H, nb], from a
    per-slot buffer [num_pages, bs, ...] -> [S, L, H, n, ...]."""
    return per_slot[tables.long()].flatten(3, 4)[:, :, :, :n]


class Evictor:
    def __init__(self, cache: KVCache, head_tables: HeadTables, press_window: PressWindow, shard: Shard = Shard()):
        self.cache, self.block_size, self.device = cache, cache.block_size, cache.k.device
        self.piece_bytes = piece_bytes(self.device)
        self.press_window = press_window   # what a press is handed besides the pairs
        self.head_tables = head_tables   # an uneven method's own pages, after its first eviction
        self.shard = shard   # a split model's replicated KV heads sum their scores over their replicas
        # Since the engine started, over this rank's heads: the pairs evictions dropped, those they
        # moved into holes (counts[:2], kernels.hole_moves) and the pages they repaged whole
        # (counts[2], kernels.repage), counted on the device by the kernels: no sync.
        self.counts = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.num_pieces = 0   # and the pieces they were taken in, each the same launches
        self._counted = [0, 0]                  # the counts as the host last had them,
        self._counting: Landing | None = None   # and a copy of later ones on its way

    def pair_totals(self) -> list[int]:
        """[evicted, moved]: the pair counts as far as the host has them (a page repaged: its
        slots moved). Never waits for the device: exact once the steps that evicted are done
        (their tokens read, say)."""
        landed = self._counting.values() if self._counting is not None else None
        if landed is not None:
            evicted, moved, pages = landed
            self._counted, self._counting = [evicted, moved + pages * self.block_size], None
        return self._counted

    def evict(self, evictions: list[Eviction]) -> None:
        """Drop each eviction's pairs from every (layer, KV head) of its sequence, the survivors
        filling the holes below each head's new length. Sequences evicting alike are done
        together: those of one rule, slot count and eviction count; an uneven method's, of one
        rule, whatever they hold and drop. What every group reads from the host reaches the
        device in one copy (kernels.from_host_many)."""
        if not evictions:
            return
        groups = defaultdict(list)
        for e in evictions:
            uneven = e.seq.method.uneven
            groups[(e.seq.method.rule, True) if uneven else (e.seq.method.rule, e.num_slots, e.num_evicted)].append(e)
        parts = [self._pages_host(group) if len(key) == 2 else self._host([e.seq for e in group], key[1])
                 for key, group in groups.items()]
        arrived = kernels.from_host_many({(i, name): a for i, part in enumerate(parts) for name, a in part.items()},
                                         self.device)
        for i, (((_, num_slots, *uniform), group), part) in enumerate(zip(groups.items(), parts)):
            on_device = {name: arrived[i, name] for name in part}
            if not uniform:
                self._evict_pages(group, on_device)
                continue
            num_evicted = uniform[0]
            seqs = [e.seq for e in group]
            tables = self.cache.pages(on_device["blocks"])
            for in_piece, layers in self._pieces(len(seqs), seqs[0].method, num_slots, num_evicted):
                piece = tables[in_piece, layers]
                evicted = self._evicted(seqs[in_piece], piece, on_device["current"][in_piece], num_slots,
                                        num_evicted, layers)
                held, leaving = (torch.full(evicted.shape[:3], n, dtype=torch.int32, device=self.device)
                                 for n in (num_slots, num_evicted))
                src, dst, _ = kernels.hole_moves(evicted, held, leaving, piece.shape[-1] * self.block_size,
                                                 evicted[0].numel(), self.counts[:2])
                kernels.move_slots(self.cache.per_slot, piece.flatten(1), src, dst)   # the rest: a slot onto itself
                if seqs[0].method.windowed:   # its scores restart: the next window counts from zero
                    self.cache.scores.index_fill_(0, piece.flatten().long(), 0.0)
        self.pair_totals()   # an earlier copy taken if it has landed; this one follows it
        self._counting = Landing(self.counts)

    def _pieces(self, num_seqs: int, method: KVMethod, num_slots: int, num_evicted: int = 0,
                num_moved: int = 0) -> list[tuple[slice, slice]]:
        """The pieces of a group of sequences each holding num_slots pairs per head and dropping
        num_evicted of each (an uneven method's: moving at most num_moved pairs in all its heads)."""
        head_dim, dtype = self.cache.k.shape[-1], self.cache.k.dtype
        group = self.press_window.model.config.num_heads // self.cache.num_kv_heads
        moved = moved_pair_bytes(head_dim, dtype)
        per_head = num_slots * ranked_pair_bytes(head_dim, dtype, method, group) + num_evicted * moved
        pieces = cut_pieces(num_seqs, self.cache.num_layers, self.cache.num_kv_heads * per_head, self.piece_bytes,
                            num_moved * moved)
        self.num_pieces += len(pieces)
        return pieces

    def _blocks(self, seqs: list[Sequence], num_slots: int) -> np.ndarray:
        """[S, nb]: the blocks holding the sequences' first num_slots slots (KVCache.pages makes
        each head's pages of them)."""
        rows = [seq.block_table.row for seq in seqs]
        return seqs[0].block_table.tables.ids[rows, :-(-num_slots // self.block_size)]

    def _host(self, seqs: list[Sequence], num_slots: int) -> dict[str, np.ndarray]:
        """What evicting seqs' first num_slots slots reads from the host: their blocks, and the
        position each has reached (what a ranking such as TOVA's measures recency from)."""
        return dict(blocks=self._blocks(seqs, num_slots),
                    current=np.array([seq.num_computed_tokens - 1 for seq in seqs], dtype=np.int64))

    def _held(self, seqs: list[Sequence], tables: torch.Tensor, current: torch.Tensor, n: int,
              lens: torch.Tensor | None = None, num_evicted: int = 0, layers: slice = slice(None),
              num_kept: list[int] | None = None) -> HeldPairs:
        """What the sequences' heads hold in their first n slots through tables [S, L, H, nb], the
        layers `layers` of the model, each sequence at position current [S]."""
        scores = self.shard.sum_over_replicas(read_slots(self.cache.scores, tables, n))
        first = layers.start or 0
        press_args = functools.cache(lambda s: self.press_window.press_args(seqs[s]))   # a sequence's, once
        return HeldPairs(read_slots(self.cache.positions, tables, n), scores, current=current[:, None, None, None],
                         key_norms=lambda: self._dequantized(tables, n, 0).norm(dim=-1), lens=lens,
                         num_evicted=num_evicted, num_kept=num_kept,
                         keys_values=lambda: (self._dequantized(tables, n, 0), self._dequantized(tables, n, 1)),
                         press_args=lambda s, i: press_args(s)(first + i))

    def _dequantized(self, tables: torch.Tensor, n: int, which: int) -> torch.Tensor:
        """[S, L, H, n, head_dim]: the keys (which 0) or values (1) of the first n slots, dequantized
        if the cache is quantized, in fp32 at least (float64 stays float64)."""
        scales = self.cache.kv_scales
        pairs = kernels.dequantize(read_slots((self.cache.k, self.cache.v)[which], tables, n),
                                   None if scales is None else read_slots(scales, tables, n)[..., which])
        return pairs.to(torch.promote_types(pairs.dtype, torch.float32))

    def _evicted(self, seqs: list[Sequence], tables: torch.Tensor, current: torch.Tensor, num_slots: int,
                 num_evicted: int, layers: slice = slice(None)) -> torch.Tensor:
        """[S, L, H, num_evicted] ascending slot indices each head drops of its first num_slots (of
        the model's layers `layers`), by the sequences' common rule: the lowest priorities, ties by position."""
        held = self._held(seqs, tables, current, num_slots, num_evicted=num_evicted, layers=layers)
        method = seqs[0].method
        return kernels.lowest(method.ranking.keep_priority(held), held.positions, num_evicted,
                              method.protected(current))

    def _own_host(self, seqs: list[Sequence], num_slots: list[int]) -> dict[str, np.ndarray]:
        """The host's part of uneven sequences' own pages when each holds its num_slots slots (per
        head on average): their rows of the head tables (HeadTables.rows). A sequence's first
        eviction first writes its blocks' pages there (_own_pages), and its OwnPages starts here."""
        host = {}
        fresh = [i for i, seq in enumerate(seqs) if seq.own_pages is None]
        if fresh:
            slots = max(num_slots[i] for i in fresh)
            host.update(fresh_blocks=self._blocks([seqs[i] for i in fresh], slots),
                        fresh_lens=np.array([num_slots[i] for i in fresh], dtype=np.int32),
                        fresh_rows=np.array([seqs[i].block_table.row for i in fresh], dtype=np.int64))
            for i in fresh:
                seqs[i].own_pages = OwnPages(seqs[i].block_table.row, -(-slots // self.block_size), num_slots[i])
        host["own_rows"], _ = self.head_tables.rows([seq.own_pages for seq in seqs], num_slots)
        return host

    def _own_pages(self, seqs: list[Sequence], on_device: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Uneven sequences' pages [S, L, Hkv, W] and pairs per head [S, L, Hkv] (_own_host's rows
        on the device), their first eviction's rows written first."""
        if "fresh_blocks" in on_device:
            tables = self.cache.pages(on_device["fresh_blocks"])
            self.head_tables.write(on_device["fresh_rows"], tables,
                                   on_device["fresh_lens"][:, None, None].expand(tables.shape[:3]))
        return self.head_tables.gather(on_device["own_rows"], max(seq.own_pages.width for seq in seqs))

    def _pages_host(self, evictions: list[Eviction]) -> dict[str, np.ndarray]:
        """What _evict_pages reads from the host: the sequences' own rows (_own_host), their
        blocks, positions (_host) and the pages they keep over every KV head of the model (the
        pairs kept per head, rounded down to pages), and what they keep of their blocks
        (_blocks_kept: planned, a split model's ranks may keep more)."""
        seqs = [e.seq for e in evictions]
        host = self._own_host(seqs, [e.num_slots for e in evictions])
        heads = self.cache.num_layers * self.cache.num_kv_heads * self.shard.size // self.shard.num_replicas
        host.update(self._host(seqs, max(len(seq.block_table) for seq in seqs) * self.block_size),
                    target=np.array([(e.num_slots - e.num_evicted) * heads // self.block_size for e in evictions],
                                    dtype=np.int64))
        return host | self._blocks_kept(evictions)

    def _blocks_kept(self, evictions: list[Eviction]) -> dict[str, np.ndarray]:
        """The blocks each sequence keeps, and each head's share of their unused pages: the room its
        tokens until the next eviction take (what the blocks kept hold beyond the pairs kept)."""
        kept = np.array([e.num_blocks_kept for e in evictions], dtype=np.int64)
        return dict(blocks_kept=kept,
                    room=kept - np.array([(e.num_slots - e.num_evicted) // self.block_size for e in evictions]))

    def _evict_pages(self, evictions: list[Eviction], on_device: dict[str, torch.Tensor]) -> None:
        """KV-Compress: each sequence's heads go down to num_slots - num_evicted pairs each on
        average by giving up whole pages, chosen across all its heads and layers by the ranking;
        each head's survivors fill its holes (MoveCache), and its pages in blocks the sequence
        gives back after this step move into the blocks it keeps, whose unused pages are shared
        out among the heads. The pages' costs are computed a piece at a time, then chosen over
        all of a sequence's, then each piece's pairs moved: the same torch ops whatever the
        sequences hold and drop. on_device: _pages_host's values."""
        seqs = [e.seq for e in evictions]
        tables, lens = self._own_pages(seqs, on_device)
        S, L, H, width = tables.shape
        method, bs, n = seqs[0].method, self.block_size, width * self.block_size
        num_kept = [e.num_slots - e.num_evicted for e in evictions]
        # A sequence's heads hold pages of its blocks only, so the pages chosen over every head of the
        # model, and the pairs they hold that move, are at most what its blocks hold beyond those kept
        # (and a page more: the pages kept are the pairs kept rounded down).
        num_heads = H * self.shard.size // self.shard.num_replicas
        most_moved = [(len(e.seq.block_table) * bs - k) * L * num_heads + bs for e, k in zip(evictions, num_kept)]
        pieces = self._pieces(S, method, n, num_moved=min(L * H * n, max(most_moved)))
        pages_held = held_pages(lens, bs)

        def ordered(in_piece: slice, layers: slice) -> tuple[torch.Tensor, torch.Tensor]:   # order, costs
            held = self._held(seqs[in_piece], tables[in_piece, layers], on_device["current"][in_piece], n,
                              lens[in_piece, layers], layers=layers, num_kept=num_kept[in_piece])
            return kernels.eviction_order(method.ranking.keep_priority(held), held.positions, lens[in_piece, layers],
                                          pages_held[in_piece, layers], bs, method.floor_pages(bs),
                                          method.protected(on_device["current"][in_piece]))

        if len(pieces) == 1:   # its costs are all of them (in fp32, as a buffer of several pieces' would be)
            last = ordered(*pieces[0])
            costs = last[1].float()
        else:
            costs = torch.empty(S, L, H, width, device=self.device)
            for in_piece, layers in pieces:
                costs[in_piece, layers] = ordered(in_piece, layers)[1]
        evicted = self._choose_pages(costs, pages_held, on_device["target"], evictions)
        kept_lens = torch.empty_like(lens)
        for in_piece, layers in pieces:
            order = (last if len(pieces) == 1 else ordered(in_piece, layers))[0]   # one piece: ordered once
            max_moves = min(order[0].numel(), max(most_moved[in_piece]))
            *moves, kept_lens[in_piece, layers] = kernels.hole_moves(
                order, lens[in_piece, layers], evicted[in_piece, layers] * bs, n, max_moves, self.counts[:2])
            kernels.move_slots(self.cache.per_slot, tables[in_piece, layers].flatten(1), *moves)   # all, unmasked
        if method.windowed:   # its scores restart (KVC-full's keep accumulating); a column past a head's
            #                   pages zeroes its first page again (a boolean mask would wait for the device)
            held = torch.arange(width, device=self.device) < pages_held[..., None]
            self.cache.scores.index_fill_(0, torch.where(held, tables, tables[..., :1]).flatten().long(), 0.0)
        kept_pages = pages_held - evicted
        blocks_kept = self._blocks_kept(evictions)
        if self.shard.size > 1:   # its ranks may keep more blocks than planned (_choose_pages)
            on_device.update(kernels.from_host_many(blocks_kept, self.device))
        staying = self.cache.pages(on_device["blocks"])   # [S, L, H, nb]: the pages of the blocks each holds
        column = torch.arange(staying.shape[-1], device=self.device)
        staying = torch.where(column < on_device["blocks_kept"][:, None, None, None], staying,
                              -1).flatten(1)   # -1: not a block it keeps
        # A head's pages all lie in its sequence's blocks: those leaving lie in the blocks given back.
        given_back = [(len(e.seq.block_table) - e.num_blocks_kept) * L * H for e in evictions]
        room = blocks_kept["room"].tolist()   # each head's share of the unused pages: at most this many more
        for start, stop in dict.fromkeys((in_piece.start, in_piece.stop) for in_piece, _ in pieces):
            part = slice(start, stop)   # whole sequences, as many as a piece holds
            width = max(seq.own_pages.width + pages for seq, pages in zip(seqs[part], room[part]))
            part_tables, moves, widths = kernels.repage(tables[part], kept_pages[part], staying[part],
                                                        max(given_back[part]), len(self.cache.positions),
                                                        on_device["room"][part], width, self.counts[2])
            kernels.move_pages(self.cache.per_slot, moves)
            for seq in seqs[part]:
                seq.own_pages.slots = seq.num_kv_slots
            self.head_tables.write(on_device["own_rows"][0, part], part_tables, kept_lens[part],
                                   [seq.own_pages for seq in seqs[part]], widths)

    def _choose_pages(self, costs: torch.Tensor, pages: torch.Tensor, target: torch.Tensor,
                      evictions: list[Eviction]) -> torch.Tensor:
        """The pages each head gives up [S, L, H]: each sequence's cheapest by costs [S, L, H, W]
        until its heads, holding pages [S, L, H], hold target [S] pages in all (_pages_host), chosen
        over every KV head of the model (a split model's ranks' costs and pages gathered: the same
        choice on every rank).
        A split model's rank whose heads keep more pages than their share of the blocks kept
        needs more of them: each eviction's num_blocks_kept grows to what its fullest rank needs,
        with the room for new pairs per head that one rank would have."""
        shard = self.shard
        if shard.size == 1:
            return kernels.choose_pages(costs, pages, target)
        width = shard.max(costs.shape[-1], self.device)   # the ranks' page tables may be of other widths
        mine = torch.cat([torch.nn.functional.pad(costs, (0, width - costs.shape[-1]), value=float("inf")),
                          pages[..., None].to(costs.dtype)], dim=-1)
        every = shard.all_heads(mine.double())   # the pages' counts stay exact in float64
        held = every[..., -1].long()
        S, L, num_heads = held.shape
        evicted = kernels.choose_pages(every[..., :-1], held, target)
        kept, local = held - evicted, costs.shape[2]
        fullest = -(-kept.view(S, L, num_heads // local, local).sum((1, 3)) // (L * local))   # [S, parts]
        extra = fullest.amax(1) - -(-kept.flatten(1).sum(1) // (L * num_heads))
        for e, more in zip(evictions, extra.tolist()):
            e.num_blocks_kept = min(e.num_blocks_kept + more, len(e.seq.block_table.ids))
        return evicted[:, :, shard.own_heads(num_heads)]

    def kept_positions(self, seq: Sequence) -> torch.Tensor:
        """The original positions of the pairs seq holds at the end, per layer and KV head:
        [L, H, n], -1 after a head's last pair when heads hold different numbers. A method
        whose algorithm evicts right after a chunk (ED) still has that eviction pending here
        (the engine evicts before the next chunk): it is applied."""
        n = seq.num_kv_slots
        if seq.method.uneven:
            own = kernels.from_host_many(self._own_host([seq], [n]), self.device)
            tables, lens = (x[0] for x in self._own_pages([seq], own))
            positions = read_slots(self.cache.positions, tables[None], tables.shape[-1] * self.block_size)[0]
            slot = torch.arange(positions.shape[-1], device=self.device)
            end = torch.iinfo(positions.dtype).max   # a head's empty slots: after its pairs, then -1
            ordered = positions.masked_fill(slot >= lens[..., None], end).sort(dim=-1).values
            return ordered.masked_fill(ordered == end, -1)[..., :int(lens.max())].cpu()
        on_device = kernels.from_host_many(self._host([seq], n), self.device)
        tables = self.cache.pages(on_device["blocks"])
        pending = seq.method.schedule.evict_count(seq) if seq.method.schedule.evicts_eagerly else 0
        positions = read_slots(self.cache.positions, tables, n)
        if pending:
            evicted = self._evicted([seq], tables, on_device["current"], n, pending)
            positions = positions.scatter(-1, evicted, torch.iinfo(torch.int32).max)
        return positions.sort(dim=-1).values[..., :n - pending][0].cpu()
