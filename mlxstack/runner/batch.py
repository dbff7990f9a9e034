"""Decode several sequences together: one forward pass, one token each, per step.

    group = DecodeGroup(ctx, batching=True)   # ctx: runner/rows.py RunnerContext
    group.add(seq, first_logits)   # after its prefill; samples its first token (lazy)
    out = group.step()             # feeds every pending token, samples the next, reads the previous
    finished = group.settle(verdicts)   # the engine core judged ``out``: rows that ended leave

With ``batching`` the members' KV layers live in one ``SlabKVCache`` per layer (engine/
batch_cache.py: mlx-lm's ``BatchKVCache`` layout -- rows right-aligned with per-row left padding,
RoPE offsets and masks -- that sequences join and leave in place, one row each): built when a
second sequence joins; a sequence that leaves gets its own ``KVCache`` layers back (a copy of its
row) so the engine closes its turn and stores it like any other, and its row is free for the next
one. Rows double when full and halve when most are free. A group of one always decodes on the
sequence's own cache.

Layers of other kinds are batched with mlx-lm's own forms: sliding windows as one
``BatchRotatingKVCache``, recurrent / conv state as one batched ``ArraysCache`` -- rebuilt from
every member's state (``extract`` then ``merge``) whenever a member joins or leaves; a window or a
recurrent state is small and bounded, so the copy is too (Gemma 3, GPT-OSS, Mamba, LFM2,
Qwen3-Next). KV_QUANT_SCHEME=turboquant rows are slab rows too: the slab codes each row as a lone
``TurboQuantKVCache`` would (cache/turboquant_rows.py) and a leaving row gets its codes back.
Without ``batching`` (chunked attention, CacheList, uniform KV_BITS) each member is stepped on its
own cache in turn. Each member keeps everything per request: sampler and PRNG key, stop
strings, detokenizer, checks.

Failures stay with what they touch. Per-row work (the sampler, reading the token back, the
detokenizer, stop checks) failing fails that row only: it leaves the batch (its KV is dropped,
never stored) and ``take_failed()`` hands it to the scheduler with its exception; the others go
on with their exact tokens. A join or a leave is a transaction over the group's bookkeeping and
the slab layers' arrays (``_atomic``): a failure puts the group back as it was, only the joining /
leaving sequences fail. What cannot be put back -- the shared forward failing, or a rollback
failing -- drops the whole batch (``reset``) and raises ``GroupReset`` naming every member lost;
the group is empty and consistent again, ready for the next join.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..config import faults
from .mlx_stream import generation_stream
from ..cache.slab import SlabKVCache, is_row_layer, merge_layer, place_batch_rows, place_own_layers, stack_layers
from .rows import GroupReset, Row, RowOutput, RunnerContext, Verdict, context_of, row_ids, run_row
from .shared_prefix import shared_prefix_ok
from .spec.speculation import spec_budgets, speculative_step, wants_step
from .forward import forward

log = logging.getLogger("mlxstack.batch")

MIN_SHARED = 256      # default SHARED_PREFIX_MIN_TOKENS: a prefix this long that rows share is held once
COMPACT_SLACK = 256   # drop unused leading columns once every active row has this much padding
BATCHABLE_KINDS = ("kv", "rotating", "arrays")   # cache kinds (cache/layer_kinds.py) with a batched form


class DecodeGroup:
    def __init__(self, ctx: RunnerContext, batching: bool) -> None:
        ctx = context_of(ctx)
        self.ctx = ctx
        self.batching = batching
        # plain-KV models: several short prefills in one forward, turns closed together
        self.dense = batching and all(k == "kv" for k in ctx.layout.kinds)
        quant = ctx.kv_quant
        # KV_QUANT_SCHEME=turboquant: slab rows coded as a lone TurboQuantKVCache is -- from exactly
        # QUANTIZED_KV_START, also inside a batched prefill's forward (cache/turboquant_rows.py)
        self.quant = quant if batching and quant is not None and quant.scheme == "turboquant" else None
        self.prefills_together = self.dense and (quant is None or self.quant is not None)
        self.seqs: list[Row] = []
        self.slab: list[Any] | None = None    # per layer, while len(seqs) > 1: a SlabKVCache (KV
        #                                       layers) or mlx-lm's batched form (other kinds)
        self.rows = 0                          # rows of the batch (members + free rows)
        self.row: dict[int, int] = {}          # id(seq) -> its row
        self.kv_idx: list[int] = []            # layers held as slab rows
        self.other_idx: list[int] = []         # layers merged / extracted by mlx-lm
        self._failed: list[tuple[Row, BaseException]] = []   # rows that failed in step()
        self.resets = 0                        # batches dropped after a failure (GroupReset)
        self.rollbacks = 0                     # joins / leaves undone after a failure
        self.last_width = 1                    # positions per row the last speculative step fed
        self._moved = False                    # members joined / left since the last step (not timed)
        want = ctx.shared_prefix_min_tokens
        # shortest root a row leaves to a slab's shared prefix; None: this engine never shares
        self.min_shared: int | None = want if want > 0 and batching and shared_prefix_ok(ctx) else None
        self._settle: dict[int, Any] = {}      # what step() left for settle(): per row, its next token ...
        self._settle_after: Any = None         # ... what follows every row's (a speculative slab settles)
        self._step_failed: dict[int, BaseException] = {}
        self._step_info: tuple = ()            # ... and the step's shape and time (speculation's costs)
        # shortest common prompt a request arriving with others takes from another's prefill: the
        # same setting (under KV quantisation the leader's prefill is not cut for it: engine/core.py
        # ``_enter``, LESSONS 78)
        self.follow_min: int | None = self.min_shared
        # every member preempted at once (the urgent request decodes alone, PRIORITY_DECODE_ROWS 0):
        # the batch set aside as it was -- slab, rows, members -- and put back without a copy
        self.paused: _Paused | None = None
        self.pauses = 0                        # batches set aside whole
        self.unpaused = 0                      # ... put back whole (the rest: rows copied out)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def forward_rows(self) -> int:
        """Rows one forward of this group computes: the batch's (free rows too), else one."""
        return self.rows if self.slab is not None else 1

    def rows_with(self, members: int) -> int:
        """Rows a forward would compute with ``members`` in the batch (its sizing: one row on its
        own cache; a slab of a power of two, rebuilt smaller once mostly free, ``_leave``)."""
        return _batch_rows(self.rows if self.slab is not None else 0, members) or 1

    def step_times(self, most: int) -> tuple[float | None, ...]:
        """What a plain decode step of 1 .. ``most`` members was measured to take here (seconds:
        the fastest of speculation's timed steps, runner/spec/step_costs.py ``plain_step``, by the
        rows the forward would compute); None where not timed often enough. An unbatched group
        steps its rows one by one: only its step of one counts."""
        costs = self.ctx.speculation.costs
        if not self.batching:
            return (costs.plain_step(1),) + (None,) * (most - 1)
        return tuple(costs.plain_step(self.rows_with(m)) for m in range(1, most + 1))

    # ------------------------------------------------------------------ failure handling
    def take_failed(self) -> list[tuple[Row, BaseException]]:
        """Rows that failed in the last step() (they already left the batch), with their errors."""
        out, self._failed = self._failed, []
        return out

    def reset(self) -> list[Row]:
        """Drop the batch: every member is out (their caches are not handed back) and the group is
        empty. Pure bookkeeping -- no MLX call -- so it cannot fail after an MLX error."""
        lost = self.seqs
        self.seqs, self.slab, self.row, self.rows, self.paused = [], None, {}, 0, None
        self.resets += 1
        return lost

    def _snapshot(self, touched: list[Row] = ()) -> tuple:
        """The group's bookkeeping and every slab layer's arrays (references): what a join or a
        leave changes. Slab writes outside the members' rows (a joiner's free row) need no undo;
        growing or compacting a slab assigns new arrays, so the old references are the old state."""
        kv = None
        if self.slab is not None:
            kv = [(i, self.slab[i], (self.slab[i].keys, self.slab[i].values, self.slab[i].offset,
                                     self.slab[i].left_padding, self.slab[i]._idx, list(self.slab[i].gap),
                                     self.slab[i].prefix, list(self.slab[i].shares),
                                     self.slab[i].codes.snapshot() if self.slab[i].codes else None))
                  for i in self.kv_idx]
        owners = list(self.seqs) + [t for t in touched if all(t is not s for s in self.seqs)]
        return (list(self.seqs), dict(self.row), self.rows, None if self.slab is None else list(self.slab), kv,
                [(s, list(s.live.layers)) for s in owners])

    def _restore(self, snap: tuple) -> None:
        seqs, row, rows, slab, kv, layers = snap
        self.seqs, self.row, self.rows, self.slab = seqs, row, rows, slab
        for i, layer, (keys, values, offset, left_padding, idx, gap, prefix, shares, codes) in kv or []:
            layer.keys, layer.values, layer.offset, layer.left_padding, layer._idx = keys, values, offset, left_padding, idx
            layer.gap, layer.prefix, layer.shares, layer._rows_mask = gap, prefix, shares, None
            if codes is not None:
                layer.codes.restore(codes)
        for s, own in layers:
            s.live.layers = own
        self._check()

    def _check(self) -> None:
        """The bookkeeping invariants (a row per member, distinct, inside the slab)."""
        if self.slab is None:
            if self.row or self.rows:
                raise RuntimeError("decode group: rows recorded without a batch")
            return
        rows = [self.row.get(id(s)) for s in self.seqs]
        if None in rows or len(set(rows)) != len(rows) or len(self.row) != len(rows) \
                or any(not 0 <= r < self.rows for r in rows):
            raise RuntimeError(f"decode group: rows {rows} do not fit a batch of {self.rows}")

    def _atomic(self, touched: list[Row], change: Callable[[], None]) -> None:
        """Run a join or a leave; on failure put the group back as it was and re-raise (only
        ``touched`` fail). A rollback that fails drops the batch: GroupReset."""
        snap = self._snapshot(touched)
        try:
            change()
        except Exception as exc:
            try:
                self._restore(snap)
            except Exception:  # noqa: BLE001 - the group cannot be trusted: drop it
                log.exception("decode group: rollback failed; dropping the batch")
                lost = self.reset()
                raise GroupReset(lost + [s for s in touched if all(s is not m for m in lost)], exc) from exc
            self.rollbacks += 1
            raise

    # ------------------------------------------------------------------ membership
    def add(self, seq: Row, logits: mx.array | None) -> None:
        """Add a sequence after its prefill: with ``logits`` its first token is sampled now; without,
        its last prompt token is still to be fed and rides in the next decode step."""
        if logits is None:
            seq.pending, seq.tail = mx.array(seq.prep.model_tokens[-1], dtype=mx.int32), True
        else:
            with mx.stream(generation_stream()):
                seq.pending = self._sample(seq, logits)
            mx.async_eval(seq.pending)
        self._join(seq)

    def _join(self, seq: Row) -> None:
        self._moved = True
        if self.batching and self.seqs:
            self._atomic([seq], lambda: self._join_one(seq))
            return
        faults.hit("slab_join", seq.job.request_id)
        self.seqs.append(seq)

    def preempt(self, seqs: list[Row]) -> None:
        """Members leave the batch for a more urgent request with their sampled, not yet fed,
        ``pending`` token: ``resume`` puts each back exactly there, its next tokens what they would
        have been (LESSONS 85). When every member of a batch leaves, the batch is set aside whole
        (``paused``: no copy; ``unpause`` puts it back); otherwise each leaves with its whole KV as
        its own cache (one buffer, the shared prefix included: it rejoins as any prefilled row
        does). A row whose last prompt token still rides in the next step (``tail``) is not
        preempted (the caller's rule)."""
        if not seqs:
            return
        gone = {id(s) for s in seqs}
        if self.slab is not None and self.paused is None and gone == {id(s) for s in self.seqs}:
            self.paused = _Paused(self.slab, self.rows, dict(self.row), list(self.seqs))
            self.seqs, self.slab, self.row, self.rows = [], None, {}, 0
            self._moved = True
            self.pauses += 1
            return
        self._own_caches()          # a paused batch's rows leave as copies before another one forms
        self._atomic(list(seqs), lambda: self._leave(list(seqs), whole=True))

    def unpause(self, seqs: list[Row]) -> list[Row]:
        """Preempted rows about to come back (``seqs``): when the group is empty and every row of
        the paused batch is among them, the batch is put back as it was (no copy) and its rows are
        returned -- they are members again; when only some are (or the group has members), each
        paused row first gets its own cache (a copy of its row, as a row that leaves alone does)
        and rejoins with ``resume``; when none is, nothing changes."""
        p = self.paused
        back = [s for s in p.seqs if any(s is r for r in seqs)] if p is not None else []
        if not back:
            return []
        if not self.seqs and len(back) == len(p.seqs):
            self.seqs, self.slab, self.row, self.rows, self.paused = p.seqs, p.slab, p.row, p.rows, None
            self._moved = True
            self.unpaused += 1
            self._check()
            return list(p.seqs)
        self._own_caches()
        return []

    def _own_caches(self) -> None:
        """Every row of the paused batch gets its own cache (its whole KV, one buffer) and the
        paused batch is gone: each is a preempted row like any other (ends, fails or rejoins)."""
        p, self.paused = self.paused, None
        if p is None:
            return
        for seq in p.seqs:
            row = p.row[id(seq)]
            layers = list(seq.live.layers)
            for i in self.kv_idx:
                layers[i] = p.slab[i].take(row, whole=True)
            for i in self.other_idx:
                layers[i] = p.slab[i].extract(row)
            seq.live.layers = layers
            seq.live.recount()

    def own_caches(self, seqs: list[Row]) -> None:
        """Preempted rows that end or fail now hold their own KV (a paused batch's rows are copied
        out: their turns close, or their KV is dropped, as any preempted row's)."""
        if self.paused is not None and any(any(s is q for q in self.paused.seqs) for s in seqs):
            self._own_caches()

    @property
    def paused_slab(self) -> list[Any] | None:
        """The paused batch's layers (what it holds in RAM), or None."""
        return self.paused.slab if self.paused is not None else None

    def resume(self, seq: Row) -> None:
        """A preempted row joins again: nothing is sampled, its ``pending`` token is fed next."""
        self._join(seq)

    def _join_one(self, seq: Row) -> None:
        self._split(seq.live.layers)
        states = self._other_states()
        self._make_room(1, seq.live.layers)
        faults.hit("slab_join", seq.job.request_id)
        row = self._free_rows()[0]
        self._place_own(row, seq)
        self.row[id(seq)] = row
        states[id(seq)] = [seq.live.layers[i] for i in self.other_idx]
        self.seqs = self.seqs + [seq]
        self._merge_other(states)
        self._release(seq)

    def adopt(self, seqs: list[Row], layers: list[Any], members: list[int]) -> None:
        """Add sequences prefilled together (runner/batch_prefill.py, plain-KV models): row
        ``members[i]`` of ``layers`` (mlx-lm BatchKVCache, one per layer) is ``seqs[i]``'s KV up to
        its last prompt token, which rides in the next decode step."""
        for seq in seqs:
            seq.pending, seq.tail = mx.array(seq.prep.model_tokens[-1], dtype=mx.int32), True
        self._moved = True

        def join() -> None:
            self._split(seqs[0].live.layers)
            self._make_room(len(seqs), seqs[0].live.layers)
            faults.hit("slab_join", row_ids(seqs))
            rows = self._free_rows()[:len(seqs)]
            place_batch_rows(self.slab, rows, layers, members, [s.live.roots for s in seqs], self.min_shared)
            for seq, row in zip(seqs, rows):
                self.row[id(seq)] = row
            self.seqs = self.seqs + list(seqs)
            for seq in seqs:
                self._release(seq)

        self._atomic(list(seqs), join)

    def _free_rows(self) -> list[int]:
        taken = set(self.row.values())
        return [r for r in range(self.rows) if r not in taken] if self.slab else []

    def _place_own(self, row: int, seq: Row) -> None:
        layers, roots = seq.live.layers, seq.live.roots
        place_own_layers([self.slab[i] for i in self.kv_idx], row, [layers[i] for i in self.kv_idx],
                         [roots[i] if i < len(roots) else None for i in self.kv_idx], self.min_shared)

    def _release(self, seq: Row) -> None:
        """A member's own KV layers are in its slab row now: drop them (the row is its KV until it
        leaves and ``take`` hands a copy back), so a batch does not hold every sequence twice."""
        if self.slab is not None and self.kv_idx:
            layers = list(seq.live.layers)
            for i in self.kv_idx:
                layers[i] = KVCache()
            seq.live.layers = layers

    def _make_room(self, joining: int, layers: list[Any]) -> None:
        """A batch with at least ``joining`` free rows (built from a group of one on its own
        cache). Non-KV layers are re-merged by the caller (_merge_other)."""
        need = len(self.seqs) + joining
        if self.slab is None:
            self.rows = _pow2(need)
            self.slab = [SlabKVCache.empty(self.rows, self.quant) if i in self.kv_idx else None
                         for i in range(len(layers))]
            if self.seqs:                                   # the one member so far: row 0
                only = self.seqs[0]
                self._place_own(0, only)
                self.row[id(only)] = 0
                self._release(only)
        elif need > self.rows:
            self._rebuild(_batch_rows(self.rows, need), self.seqs)

    def _rebuild(self, rows: int, members: list[Row]) -> None:
        """Move ``members``' KV rows to a slab of ``rows`` rows (rows 0..n-1, in that order);
        non-KV layers are re-merged by the caller."""
        keep = [self.row[id(s)] for s in members]
        with mx.stream(generation_stream()):
            for i in self.kv_idx:
                self.slab[i] = self.slab[i].rebuilt(rows, keep)
            mx.eval([x for i in self.kv_idx for x in (self.slab[i].keys, self.slab[i].values)])
        self.rows = rows
        self.row = {id(s): i for i, s in enumerate(members)}

    def _other_states(self) -> dict[int, list[Any]]:
        """Each member's non-KV layers: its own caches while the group has no batch, else copies
        extracted from the batched layers."""
        if self.slab is None:
            return {id(s): [s.live.layers[i] for i in self.other_idx] for s in self.seqs}
        return {id(s): [self.slab[i].extract(self.row[id(s)]) for i in self.other_idx] for s in self.seqs}

    def _split(self, layers: list[Any]) -> None:
        """Which layers are slab rows and which mlx-lm merges (once: the model's layout)."""
        if not self.kv_idx and not self.other_idx:
            self.kv_idx = [i for i, layer in enumerate(layers) if is_row_layer(layer)]
            self.other_idx = [i for i, layer in enumerate(layers) if not is_row_layer(layer)]

    def _merge_other(self, states: dict[int, list[Any]]) -> None:
        """Rebuild every non-KV layer's batch from the members' states, in row order. A free row
        repeats a member's state: an empty row would be fully masked, compute NaN, and carry it
        into the KV rows of the same row."""
        if not self.other_idx or self.slab is None:
            return
        by_row = {self.row[key]: st for key, st in states.items() if key in self.row}
        filler = next(iter(by_row.values()))
        with mx.stream(generation_stream()):
            for j, i in enumerate(self.other_idx):
                self.slab[i] = merge_layer([by_row.get(r, filler)[j] for r in range(self.rows)])
            mx.eval([a for i in self.other_idx for a in _arrays(self.slab[i])])

    def _leave(self, gone: list[Row], keep_cache: bool = True, whole: bool = False) -> None:
        """Members leave: with ``keep_cache`` each gets its own cache back (a copy of its row; with
        ``whole`` one buffer it can decode on), else (a failed row) its KV is dropped. Their rows
        are free; ``seqs`` is the rest."""
        gone_ids = {id(s) for s in gone}
        rest = [s for s in self.seqs if id(s) not in gone_ids]
        self._moved = True                                 # a compaction's copies land in the next forward
        if self.slab is None:
            self.seqs = rest
            return
        states = self._other_states()
        freed = {id(s): self.row.pop(id(s)) for s in gone}
        back = (gone if keep_cache else []) + (rest if len(rest) <= 1 else [])
        for seq in back:
            row = freed[id(seq)] if id(seq) in freed else self.row.pop(id(seq))
            layers: list[Any] = [None] * len(self.slab)
            alone = whole or all(seq is not g for g in gone)   # goes on decoding on its own cache
            for i in self.kv_idx:
                layers[i] = self.slab[i].take(row, whole=alone)
            for j, i in enumerate(self.other_idx):
                layers[i] = states[id(seq)][j]
            seq.live.layers = layers
            seq.live.recount()                          # a row coded in the slab comes back coded
        faults.hit("slab_leave", row_ids(gone))
        self.seqs = rest
        if len(rest) <= 1:                                 # back to a group of one: its own cache
            self.slab, self.row, self.rows = None, {}, 0
            return
        if _batch_rows(self.rows, len(rest)) != self.rows:  # mostly free rows: compute on fewer
            self._rebuild(_batch_rows(self.rows, len(rest)), rest)
        else:                                              # columns only the leavers used
            active = [self.row[id(s)] for s in rest]
            for i in self.kv_idx:
                self.slab[i].compact(active, COMPACT_SLACK)
        self._merge_other({id(s): states[id(s)] for s in rest})

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[int, RowOutput]:
        """Advance every member by one forward and return what each row read back (by
        ``id(row)``), unjudged: the engine core consumes the tokens (streaming, stop rules) and
        answers with ``settle``. A row whose own work failed is left out (``settle`` discards it,
        ``take_failed`` names it). GroupReset when the batch had to be dropped."""
        self._settle, self._step_failed = {}, {}
        if not self.seqs:
            return {}
        budgets = spec_budgets(self.seqs)
        rows, members, t0 = self.forward_rows, len(self.seqs), time.perf_counter()
        settled, self._moved = not self._moved, False    # a join's lazy copies land in the next forward
        if wants_step(self, budgets):
            out = speculative_step(self, budgets)
            width = self.last_width
        else:
            out, width = self._plain_step(), 1
        self._step_info = (settled, rows, members, width, time.perf_counter() - t0)
        return out

    def settle(self, verdicts: dict[int, Verdict], failed: dict[int, BaseException] | None = None) -> list[Row]:
        """Apply the engine core's verdicts on the last ``step``: each row keeps what it consumed
        (a speculative row takes the rest back), a row whose reply ended leaves with its cache, a row
        that failed (in the step, or in ``failed``: the core's own work on it) leaves without.
        Returns the rows that ended (removed)."""
        seqs = list(self.seqs)
        failed = {**self._step_failed, **(failed or {})}
        done: list[Row] = []
        for s in seqs:
            if id(s) in failed or id(s) not in self._settle:
                continue
            verdict = verdicts.get(id(s)) or Verdict(0, False)
            if run_row(failed, s, lambda s=s, v=verdict: self._settle[id(s)](v)):
                done.append(s)
        after, self._settle_after = self._settle_after, None
        if after is not None:
            after()
        settled, rows, members, width, seconds = self._step_info or (False, 0, 0, 1, 0.0)
        clean = settled and not done and not failed and len(self.seqs) == members \
            and self.forward_rows == rows and (self.slab is not None or members == 1)
        if clean:   # what a step costs here, by rows and width: speculation's cost model (runner/spec/step_costs.py)
            self.ctx.speculation.costs.record(rows, width, seconds)
        self._settle, self._step_info = {}, ()
        return self.settle_rows(seqs, failed, done)

    def _plain_step(self) -> dict[int, RowOutput]:
        """One token for every member (the forward, then the previous tokens read back); when every
        pending token is its row's last (max_tokens), only the read-back."""
        stream = generation_stream()
        model = self.ctx.decode_model
        seqs = list(self.seqs)
        current = [s.pending for s in seqs]
        failed = self._step_failed
        out: dict[int, RowOutput] = {}

        def row_work(s: Row, work: Callable[[], Any]) -> Any:
            return run_row(failed, s, work)

        def ends(s: Row, v: Verdict) -> bool:
            return v.done

        if all(not s.tail and s.produced + 1 >= s.params.max_tokens for s in seqs):
            # every row's pending token is its last (max_tokens): no forward, only the read-back
            for s, t in zip(seqs, current):
                tok = row_work(s, lambda t=t: int(t.item()))
                if id(s) not in failed:
                    out[id(s)] = RowOutput([tok])
                    self._settle[id(s)] = lambda v, s=s: ends(s, v) or self._keep(s, s.pending)
            return out
        nxt: list[Any] = [None] * len(seqs)
        with mx.stream(stream):
            for s in seqs:
                if not s.tail:                       # a prompt token is already in the history
                    row_work(s, lambda s=s: s.sampler.accept(s.pending))
            if self.slab is not None:
                try:
                    faults.hit("decode_forward", row_ids(seqs))
                    by_row = {self.row[id(s)]: t.reshape(()) for s, t in zip(seqs, current)}
                    dummy = mx.array(0, dtype=mx.int32)
                    tokens = mx.stack([by_row.get(r, dummy) for r in range(self.rows)])[:, None]
                    logits = forward(model, tokens, self.slab)[:, -1, :]
                except Exception as exc:  # noqa: BLE001 - the shared forward: every member is lost
                    raise GroupReset(self.reset(), exc) from exc
                for s in seqs:
                    s.live.advance(1)
                for j, s in enumerate(seqs):
                    if id(s) not in failed:
                        nxt[j] = row_work(s, lambda s=s: self._sample(s, logits[self.row[id(s)]]))
            else:                                    # each member on its own cache: its own forward
                for j, (s, t) in enumerate(zip(seqs, current)):
                    if id(s) not in failed:
                        nxt[j] = row_work(s, lambda s=s, t=t: self._forward_one(s.decode_model or model, s, t))
        try:
            mx.async_eval([n for n in nxt if n is not None])
        except Exception as exc:  # noqa: BLE001 - one evaluation for every row: all are lost
            raise GroupReset(self.reset(), exc) from exc
        size = len(seqs) if self.slab is not None else 1
        for s, t, n in zip(seqs, current, nxt):
            if id(s) in failed:
                continue
            tokens = row_work(s, lambda s=s, t=t: self._read_back(s, t))
            if id(s) in failed:
                continue
            if s.spec is not None:               # the drafter reads the reply as it is written
                s.spec.drafter.extend(tokens)
            out[id(s)] = RowOutput(tokens, size)
            self._settle[id(s)] = lambda v, s=s, n=n: ends(s, v) or self._keep(s, n)
        return out

    def _keep(self, s: Row, nxt: Any) -> bool:
        """A row that goes on: its next token is the one this step sampled."""
        s.pending = nxt
        return False

    def settle_rows(self, seqs: list[Row], failed: dict[int, BaseException], done: list[Row]) -> list[Row]:
        """After a step: failed rows leave without their KV (take_failed() hands them over),
        finished ones leave with theirs; returns the finished ones that left."""
        gone = [s for s in seqs if id(s) in failed]
        done = [s for s in done if id(s) not in failed]
        self._failed.extend((s, failed[id(s)]) for s in gone)
        if gone:
            self._discard(gone)
        if done:
            try:
                self._atomic(done, lambda: self._leave(done))
            except GroupReset:
                raise
            except Exception as exc:  # noqa: BLE001 - they could not take their caches: they fail
                self._failed.extend((s, exc) for s in done)
                self._discard(done)
                return []
        return done

    def _sample(self, s: Row, logits: mx.array) -> mx.array:
        faults.hit("sampler", s.job.request_id)
        return s.sampler.sample(logits)

    def _forward_one(self, model: Any, s: Row, t: mx.array) -> mx.array:
        faults.hit("decode_forward", s.job.request_id)
        s.live.maybe_quantize()
        logits = forward(model, t.reshape(1, 1), s.live.layers)[:, -1, :]
        s.live.advance(1)
        return self._sample(s, logits)

    @staticmethod
    def _read_back(s: Row, t: mx.array) -> list[int]:
        """The row's previous token, read back (none for a row that fed its last prompt token)."""
        if s.tail:
            s.tail = False
            return []
        return [int(t.item())]

    def _discard(self, gone: list[Row]) -> None:
        """Failed members leave without their KV (never stored); GroupReset if even that fails."""
        try:
            self._atomic(gone, lambda: self._leave(gone, keep_cache=False))
        except GroupReset:
            raise
        except Exception as exc:  # noqa: BLE001 - rolled back but they cannot leave: drop the batch
            raise GroupReset(self.reset(), exc) from exc

    def drop(self, seq: Row) -> None:
        """Remove a member after a failure (its KV is dropped, never stored)."""
        if any(s is seq for s in self.seqs):
            self._discard([seq])


def _arrays(layer: Any) -> list[mx.array]:
    """The arrays a batched layer holds (to evaluate them once built)."""
    if hasattr(layer, "cache"):                            # ArraysCache
        return [a for a in layer.cache if a is not None]
    return [a for a in (layer.keys, layer.values) if a is not None]


@dataclass
class _Paused:
    """A batch set aside whole while a more urgent request decodes alone (``DecodeGroup.preempt``)."""
    slab: list[Any]
    rows: int
    row: dict[int, int]
    seqs: list[Row]


def _batch_rows(rows: int, members: int) -> int:
    """Rows a batch of ``members`` has, from one of ``rows`` (0: none yet): none for a group of one
    (it decodes on its own cache); a power of two, grown when full and rebuilt smaller once at
    most a quarter is used; else the same rows (its free ones wait for the next join)."""
    if members <= 1:
        return 0
    if rows == 0 or members > rows or members <= rows // 4:
        return _pow2(members)
    return rows


def _pow2(n: int) -> int:
    return 1 << max(1, (max(1, n) - 1).bit_length())


def batching_support(ctx: RunnerContext) -> tuple[bool, str]:
    """Whether this model decodes correctly in one batched forward: plain KV layers (slab rows),
    sliding windows and recurrent / conv state (mlx-lm's BatchRotatingKVCache and batched
    ArraysCache); not chunked attention or CacheList (no batched form in mlx-lm), no uniform KV
    quantisation (TurboQuant rows are float rows with codes beside them), not a VLM -- and a real
    check: two sequences of different lengths stepped together give the logits each gives alone."""
    ctx = context_of(ctx)
    layout = ctx.layout
    if ctx.is_vlm:
        return False, "vision-language models prefill through mlx-vlm's own path"
    if not layout.supported or any(k not in BATCHABLE_KINDS for k in layout.kinds):
        return False, f"cache layout {layout.describe()} has no batched form"
    quant = ctx.kv_quant
    if quant is not None and quant.scheme != "turboquant":
        return False, "KV_BITS (uniform): mlx-lm's quantised KV layers have no batched form"
    from .generate import feed

    model = ctx.model
    try:
        lives = []
        for n in (5, 9):
            live = ctx.new_cache()
            feed(model, live, list(range(100, 100 + n)), 16)
            lives.append(live)
        nxt = mx.array([[7], [11]], dtype=mx.int32)
        alone = [forward(model, nxt[i:i + 1], lv.layers)[:, -1, :] for i, lv in enumerate(lives)]
        lives2 = []
        for n in (5, 9):
            live = ctx.new_cache()
            feed(model, live, list(range(100, 100 + n)), 16)
            lives2.append(live)
        batch = stack_layers([live.layers for live in lives2], quant=quant)
        together = forward(model, nxt, batch)[:, -1, :]
        for out in (*alone, together):   # one forward per eval: its sends / receives in one order on every rank
            mx.eval(out)
        ok = all([mx.allclose(together[i], alone[i][0], atol=1e-3, rtol=1e-3).item() for i in range(2)])
        why = "" if ok else "batched logits differ from single-sequence logits"
    except Exception as exc:  # noqa: BLE001 - any failure: this model decodes one sequence at a time
        ok, why = False, f"batched forward failed ({type(exc).__name__}: {exc})"
    group = ctx.rank_group
    if group is not None:   # ranks decide alike (a rank batching alone runs other collectives)
        from ..models.sharding import agree

        every = agree(group, False, ok)[1]
        ok, why = every, ("" if every else why or "another rank's batched check failed")
    return ok, why
