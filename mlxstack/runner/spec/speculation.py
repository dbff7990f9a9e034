"""Speculative decoding inside continuous batching: every row drafts, one forward verifies all.

    spec = Speculation(settings)                 # per engine (SPECULATIVE, SPEC_MAX_DRAFT)
    seq.spec = spec.row(seq)                     # per request at begin_decode (None: never drafts)
    budgets = spec_budgets(group.seqs)           # per step: drafts each row may try (0: none)
    if wants_step(group, budgets):
        done = speculative_step(group, budgets)  # instead of DecodeGroup's one-token step

A speculative step (runner/batch.py calls it when a row has a draft worth trying):
1. every row's pending token is read back -- as the plain step does, only before the forward
   instead of after it (a row it ends by plain data, a stop token or its last token, drafts nothing);
2. each row proposes up to its budget of drafts (runner/spec/drafting.py: prompt lookup over the
   prompt and the reply so far; runner/spec/draft_model.py: a draft model's greedy tokens; a grammar
   cuts what it refuses and drafts the text it forces), capped by its token limit and by what its
   cache can take back (``LiveCache.room``: plain and quantised KV any amount, a sliding window
   until it rotates; recurrent state, a rotated window and chunked attention none -- those rows
   are put back and replayed instead, alone);
3. ONE forward feeds ``[pending, d1..dk]`` for every row: the batch's slab rows padded to the
   longest row (cache/slab.py), or each row on its own cache;
4. each row verifies its own drafts against its own sampler: at each position the token plain
   decoding would produce there (greedy: the argmax; sampled: the draw keyed by the reply's
   position, runner/sampling.py), so the accepted tokens are exactly what plain decoding
   produces, sampled rows included (a draft is kept with probability p(draft), as the rejection
   rule would keep it, and a seeded reply is the same with or without speculation) -- and keeps
   the longest accepted prefix plus the model's own next token;
5. the tokens go back to the engine core, which consumes them (streaming, stop rules: a stop string
   may end a reply inside its drafts) and says how many each row used; each row (``settle``) takes
   back what it did not keep, on its own: a slab row moves its end back (ragged
   rows), an own cache is cut (``LiveCache.cut``). The prompt cache, snapshots and salvage later
   see exactly the accepted tokens: nothing else is in the KV.

Rows without drafts ride along with one token. ``DraftControl`` (per row) grows the draft length
while drafts are accepted and pauses a row whose drafts keep failing, so free text, high
temperatures and grammars that reject the drafts fall back to plain steps, which stay pipelined.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...config import faults
from .drafting import Chained, DraftControl, NgramDrafter, accepted_prefix, best_width
from ..generate import cache_arrays
from ..mlx_stream import generation_stream
from ..sampling import Sampler
from .step_costs import StepCosts
from .draft_model import DraftModel
from ..rows import GroupReset, Row, RowOutput, Verdict, row_ids, run_row
from ..forward import forward

MODES = ("auto", "ngram", "draft")        # SPECULATIVE values that draft (off: never)
DRAFT_MODEL_MODES = ("auto", "draft")     # ... with the draft model, when DRAFT_MODEL is set


@dataclass(eq=False)
class RowSpec:
    """One request's drafter (prompt lookup, the draft model, or the one then the other) and
    draft-length control."""
    drafter: Any
    control: DraftControl


class Speculation:
    def __init__(self, settings: Any, vlm: bool = False, draft: DraftModel | None = None) -> None:
        self.mode = settings.speculative
        self.max_draft = settings.spec_max_draft
        self.ngram = (settings.spec_ngram_min, settings.spec_ngram_max)
        self.draft = draft if self.mode in DRAFT_MODEL_MODES else None
        self.lookup = self.mode in ("auto", "ngram")
        # a VLM decodes through its language model with multimodal RoPE positions kept per
        # request (engine/vlm_chat.py): drafts are not verified there yet
        self.enabled = (self.mode in MODES and self.max_draft > 0 and not vlm
                        and (self.lookup or self.draft is not None))
        # what a wider step costs here, timed by the decode group: speculation's cost model
        self.costs = StepCosts(prior=COST_PER_POSITION)
        self.calibrate = settings.spec_calibrate == "auto" and settings.distributed == "off"

    def calibrated(self, model: Any, max_rows: int) -> None:
        """Time the decode model's wider forwards once (runner/spec/calibration.py): the width
        chooser's prior. Not for ranks in lockstep (each rank would time its own)."""
        if self.enabled and self.calibrate:
            from .calibration import calibrate

            self.costs.table = calibrate(model, rows=sorted({1, max(1, min(8, max_rows))}))

    def stats(self) -> dict:
        return self.costs.snapshot()

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        parts = [f"prompt lookup ({self.ngram[0]}..{self.ngram[1]}-token suffixes)"] if self.lookup else []
        if self.draft is not None:
            parts.append(f"draft model {self.draft.name} (~{self.draft.cost:.2f} of a step per draft)")
        return f"{self.mode}: {' then '.join(parts)}, up to {self.max_draft} drafts a row"

    def row(self, seq: Row) -> RowSpec | None:
        """The request's drafting state, or None when it never drafts (speculation off, or a
        cache that can neither be cut nor put back and replayed)."""
        if not self.enabled or (seq.live.room() < 2 and not seq.live.replayable):
            return None
        lo, hi = self.ngram
        tokens = seq.prep.model_tokens
        lookup = NgramDrafter(tokens, max_n=max(lo, hi), min_n=min(lo, hi)) if self.lookup else None
        scope = getattr(getattr(seq, "job", None), "scope", "")
        model = self.draft.drafter(tokens, scope) if self.draft is not None else None
        drafter = Chained(lookup, model) if lookup and model else (lookup or model)
        return RowSpec(drafter, DraftControl(self.max_draft))


# One more token position through the model, per row, costs this fraction of a plain decode step
# (measured on the embedded model, 2-core CPU, ~500 tokens of context: 8 rows x 7 positions cost
# 2.27 plain steps, 1 row x 7 positions 1.27). A GPU has more room (cheaper positions). Only the
# prior: once steps have been timed here, ``Speculation.costs`` (runner/spec/step_costs.py) answers.
COST_PER_POSITION = 0.03


def spec_budgets(seqs: list[Row]) -> dict[int, int]:
    """Drafts each row may try this step (a paused row counts its pause down here, once a step)."""
    return {id(s): s.spec.control.budget() for s in seqs if s.spec is not None}


def wants_step(group: Any, budgets: dict[int, int]) -> bool:
    """Whether this step should verify drafts, and how many per row (``budgets`` is capped in
    place). The drafts a row would get are estimated from its tokens read so far (the pending
    token is not read yet: reading it would stall the pipeline), weighted by its acceptance so far;
    a speculative step runs when it is expected to produce more tokens per unit of time than a
    plain one (``best_width``), at what steps of each width were measured to cost here
    (``Speculation.costs``; a plain step first, and now and then, as the yardstick). Rows on their
    own caches are costed one by one."""
    if not budgets or (group.slab is not None and not group.dense):
        return False
    costs = group.ctx.speculation.costs
    price = costs.cost
    if group.ctx.replicated:
        # decide from tokens alone (the prior), never from wall times: ranks in lockstep must take
        # the same steps (each rank's clock differs: they would part and wait on each other's
        # collectives forever). A seeded row needs nothing of the kind: its draws are keyed by
        # position (runner/sampling.py), whichever steps verify them
        price = costs.prior_cost
    elif (group.slab is not None or len(group.seqs) == 1) and costs.wants_plain(group.forward_rows):
        return False                       # the yardstick a wider step is measured against (timed)
    rows = []
    for s in group.seqs:
        k = budgets.get(id(s), 0)
        k, cost = plan(s, k) if k > 0 else (0, 0.0)
        rows.append((s, (k, s.spec.control.rate if s.spec is not None else 0.0, cost)))
    if group.slab is not None:
        n = group.rows
        width = best_width([r for _, r in rows], lambda w: price(n, w))
        for s, _ in rows:
            if id(s) in budgets:
                budgets[id(s)] = min(budgets[id(s)], width - 1)
        return width > 1
    any_row = False
    for s, r in rows:
        width = best_width([r], lambda w: price(1, w))
        if id(s) in budgets:
            budgets[id(s)] = min(budgets[id(s)], width - 1)
        any_row |= width > 1
    return any_row


def _row_limit(group: Any, s: Row, budget: int) -> int:
    """Drafts row ``s`` may feed now: its budget, its token limit, what its cache can take back
    (a cache that can be put back as it was -- recurrent state, a rotated window -- takes any
    number: what it did not keep is replayed), never across the KV quantisation start."""
    left = s.params.max_tokens - s.produced - 1        # the token after the drafts counts too
    if group.slab is not None:         # a slab row codes from exactly the start: a forward may reach it
        quant = s.live.quant
        if quant is not None and s.live.depth < quant.start:
            left = min(left, quant.start - s.live.depth - 1)
        return max(0, min(budget, left))
    live = s.live
    room = live.room() - 1
    if room < budget and live.replayable:
        room = live.quant_room() - 1
    return max(0, min(budget, left, room))


def _fast(s: Row) -> bool:
    """Nothing that depends on the tokens before each position: every position's token in one
    evaluation (``Sampler.targets``; a sampler class that processes logits its own way is verified
    position by position)."""
    smp = s.sampler
    return (smp.rep is None and smp.counts is None and smp.constraint is None
            and not smp.p.logprobs and type(smp)._process is Sampler._process)


def speculative_step(group: Any, budgets: dict[int, int]) -> dict[int, RowOutput]:
    """One step of ``group`` (runner/batch.DecodeGroup) with drafts; returns what each row read
    back -- its pending token, then the drafts it accepted -- unjudged, and leaves ``group`` what
    its ``settle`` needs to keep what the engine core consumed and take the rest back. Failures
    are handled as the plain step handles them."""
    ctx = group.ctx
    model = ctx.decode_model
    seqs = list(group.seqs)
    failed = group._step_failed
    out: dict[int, RowOutput] = {}

    def row_work(s: Row, work: Any) -> Any:
        return run_row(failed, s, work)

    # 1. read every pending token back (one evaluation); a row it ends by plain data (a stop token,
    #    its last token) drafts nothing: its row is fed filler and rewound
    mx.eval([s.pending for s in seqs])
    firsts: dict[int, int] = {}
    tails: dict[int, bool] = {}
    ended: list[Row] = []
    for s in seqs:
        def read(s: Row = s) -> bool:
            tok = int(s.pending.item())
            firsts[id(s)] = tok
            tails[id(s)] = s.tail
            if s.tail:
                s.tail = False
                return False
            if tok in s.params.stop_token_ids or s.produced + 1 >= s.params.max_tokens:
                return True
            s.sampler.accept(s.pending)
            if s.spec is not None:               # the drafter reads the reply as it is written
                s.spec.drafter.extend((tok,))
            return False
        if row_work(s, read):
            ended.append(s)
    going = [s for s in seqs if id(s) not in failed and all(s is not e for e in ended)]

    # 2. drafts
    drafts: dict[int, list[int]] = {}
    for s in going:
        k = _row_limit(group, s, budgets.get(id(s), 0)) if s.spec is not None else 0
        drafts[id(s)] = (row_work(s, lambda s=s, k=k: propose(s, k)) or []) if k > 0 else []
    going = [s for s in going if id(s) not in failed]
    width = 1 + max((len(d) for d in drafts.values()), default=0)
    group.last_width = width

    # 3. one forward
    stream = generation_stream()
    logits: dict[int, mx.array] = {}
    fed: dict[int, int] = {}
    marks: dict[int, tuple] = {}      # rows whose cache is put back and the kept tokens replayed
    with mx.stream(stream):
        if group.slab is not None and going:
            try:
                faults.hit("decode_forward", row_ids(going))
                rows = [[0] * width for _ in range(group.rows)]
                for s in going:
                    first = firsts[id(s)]
                    d = drafts[id(s)]
                    rows[group.row[id(s)]] = [first] + d + [first] * (width - 1 - len(d))
                fwd = forward(model, mx.array(rows, dtype=mx.int32), group.slab)
            except Exception as exc:  # noqa: BLE001 - the shared forward: every member is lost
                raise GroupReset(group.reset(), exc) from exc
            for s in going:
                s.live.advance(width)
                fed[id(s)] = width
                logits[id(s)] = fwd[group.row[id(s)]]
            for s in ended:                 # ended on their pending token: their row was fed filler
                if id(s) in group.row:
                    _rewind_row(group, group.row[id(s)], width)
        else:
            for s in going:
                def alone(s: Row = s) -> None:
                    faults.hit("decode_forward", s.job.request_id)
                    s.live.maybe_quantize()
                    toks = [firsts[id(s)]] + drafts[id(s)]
                    if len(toks) > s.live.room():          # cannot cut back: keep the state before
                        marks[id(s)] = s.live.mark()
                    fwd = forward(model, mx.array([toks], dtype=mx.int32), s.live.layers)
                    s.live.advance(len(toks))
                    fed[id(s)] = len(toks)
                    logits[id(s)] = fwd[0]
                row_work(s, alone)
        going = [s for s in going if id(s) not in failed]

        # 4. verify: rows without per-position state in one evaluation, the rest in order
        targets = {}
        for s in going:
            if _fast(s):
                def target(s: Row = s) -> mx.array:
                    faults.hit("sampler", s.job.request_id)
                    return s.sampler.targets(logits[id(s)][:len(drafts[id(s)]) + 1])
                targets[id(s)] = row_work(s, target)
        try:
            mx.eval([t for t in targets.values() if t is not None])
        except Exception as exc:  # noqa: BLE001 - one evaluation for every row: all are lost
            raise GroupReset(group.reset(), exc) from exc
        verdicts: dict[int, tuple[int, mx.array]] = {}
        for s in going:
            if id(s) in failed:
                continue
            d = drafts[id(s)]
            if id(s) in targets:
                t = targets[id(s)]
                a = accepted_prefix(t.tolist(), d)
                s.sampler.skip(a + 1)
                verdicts[id(s)] = (a, t[a])
            else:
                verdicts[id(s)] = row_work(s, lambda s=s, d=d: _verify_in_order(s, logits[id(s)], d))

    # 5. the tokens read back; what each row keeps is the core's to say (``settle``)
    size = len(going) if group.slab is not None else 1
    proposed = accepted = 0
    for s in ended:
        if id(s) not in failed:
            out[id(s)] = RowOutput([firsts[id(s)]], size)
            group._settle[id(s)] = lambda v: True       # a stop token or its last token: it ends
    for s in going:
        if id(s) in failed:
            continue
        d = drafts[id(s)]
        a, nxt = verdicts[id(s)]
        if d:
            s.spec.control.record(len(d), a)
            proposed += len(d)
            accepted += a
        read = ([] if tails[id(s)] else [firsts[id(s)]]) + d[:a]
        out[id(s)] = RowOutput(read, size)
        if a and s.spec is not None:
            s.spec.drafter.extend(d[:a])

        def keep(v: Verdict, s: Row = s, d: list[int] = d, nxt: mx.array = nxt, tail: bool = tails[id(s)]) -> bool:
            used = max(0, v.used - (0 if tail else 1))      # drafts the core consumed
            if id(s) in marks:
                if used < fed[id(s)] - 1:
                    _replay(model, s, marks[id(s)], [firsts[id(s)]] + d[:used])
                    ctx.counters.bump("spec_replays")
            else:
                _take_back(group, s, fed[id(s)] - 1 - used)
            if v.done:
                return True
            s.pending = nxt
            return False
        group._settle[id(s)] = keep

    def settled() -> None:
        if group.slab is not None:
            alive = [group.row[id(s)] for s in seqs if id(s) not in failed and id(s) in group.row]
            for i in group.kv_idx:
                group.slab[i].settle(alive)
    group._settle_after = settled
    counters = ctx.counters
    counters.bump("spec_steps")
    if proposed:
        counters.bump("spec_proposed", proposed)
        counters.bump("spec_accepted", accepted)
    return out


def plan(s: Row, k: int) -> tuple[int, float]:
    """(drafts ``propose(s, k)`` is expected to give, cost of one in plain steps), without drafting:
    the drafter's, else the text a constrained row's grammar forces (free). The grammar has not
    seen the pending token yet: an estimate, as the drafter's is."""
    n, cost = s.spec.drafter.plan(k)
    c = s.sampler.constraint
    if c is not None and not n:
        return len(c.forced(k)), 0.0
    return n, cost


def propose(s: Row, k: int) -> list[int]:
    """Row ``s``'s drafts: its drafter's, cut where its grammar would refuse them; a constrained row
    whose drafter has none drafts the text its grammar forces next."""
    drafts = s.spec.drafter.propose(k)
    c = s.sampler.caught_up()
    if c is None:
        return drafts
    drafts = drafts[:c.fits(drafts)]
    return drafts or c.forced(k)


def _verify_in_order(s: Row, logits: mx.array, drafts: list[int]) -> tuple[int, mx.array]:
    """Verify position by position with the row's own sampler (penalties, grammar, logprobs and
    sampling see each accepted token before the next position, as plain decoding does)."""
    faults.hit("sampler", s.job.request_id)
    smp = s.sampler
    accepted = 0
    with mx.stream(generation_stream()):
        for j in range(len(drafts) + 1):
            tok = smp.sample(logits[j])
            value = int(tok.item())
            if j < len(drafts) and value == drafts[j]:
                smp.accept(tok)
                accepted += 1
                continue
            return accepted, tok
    raise AssertionError("unreachable: the last position always returns")


def _replay(model: Any, s: Row, mark: tuple, kept: list[int]) -> None:
    """Put the row's cache back as it was before the step and feed only the tokens it kept (for
    caches that cannot be cut: recurrent / conv state, a rotated sliding window)."""
    s.live.restore(mark)
    with mx.stream(generation_stream()):
        forward(model, mx.array([kept], dtype=mx.int32), s.live.layers)
        s.live.advance(len(kept))
        mx.eval(cache_arrays(s.live))


def _take_back(group: Any, s: Row, n: int) -> None:
    """Remove the last ``n`` fed tokens of row ``s`` from its KV (drafts it did not keep)."""
    if n <= 0:
        return
    if group.slab is not None and id(s) in group.row:
        _rewind_row(group, group.row[id(s)], n)
        s.live.depth -= n
    else:
        s.live.cut(s.live.depth - n)


def _rewind_row(group: Any, row: int, n: int) -> None:
    """Take the last ``n`` tokens of slab row ``row`` back in every KV layer (settle() follows)."""
    for i in group.kv_idx:
        group.slab[i].rewind(row, n)
