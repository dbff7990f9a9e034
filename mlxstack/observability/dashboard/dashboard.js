// Live prompt-cache dashboard: polls /v1/cache/stats every 2 s and redraws (no build step).
// window.dashboardState exposes what is drawn (point counts per chart, counters) for tests.
(function () {
  "use strict";
  const REFRESH_MS = 2000;
  const MEM_HISTORY = 300;            // memory samples kept client-side (10 min at 2 s)
  const MATCH_ORDER = ["prefix", "supersequence", "lcp", "exact", "session", "snapshot"];
  const C = { cached: "#16a34a", prefilled: "#f59e0b", accent: "#2563eb", decode: "#7c3aed", budget: "#dc2626" };

  const state = window.dashboardState = {
    refreshes: 0, errors: 0, lastError: null, lastUpdate: null, ready: false,
    points: { ttft: 0, speed: 0, match: 0, memory: 0 },
    correctness: {}, hits: {}, misses: 0, recentRows: 0,
  };
  const memHistory = { t: [], used: [], budget: [] };
  const charts = {};

  const $ = (id) => document.getElementById(id);
  const fmtInt = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
  const fmtNum = (n, d = 1) => (n == null || isNaN(n) ? "–" : Number(n).toFixed(d));
  function fmtBytes(b) {
    if (b == null) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0, v = Number(b);
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return v.toFixed(i ? 1 : 0) + " " + u[i];
  }
  function esc(s) {
    return String(s == null ? "" : s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }

  // ------------------------------------------------------------------ charts
  function width(el) { return Math.max(240, el.clientWidth || 400); }

  const INT_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];
  const TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
  const clock = (u, vals) => vals.map((v) => new Date(v * 1000).toLocaleTimeString());

  // opts: height, xlabel, ylabel, xtime (x is epoch seconds, else request #), yvalues, yrange, xrange
  function makeChart(id, series, opts) {
    const el = $(id);
    const xaxis = opts.xtime
      ? { incrs: TIME_INCRS, values: clock, space: 70, size: 30 }
      : { label: opts.xlabel || "request #", labelSize: 16, size: 40, incrs: INT_INCRS, space: 40 };
    const xscale = { time: !!opts.xtime };
    if (opts.xrange) xscale.range = opts.xrange;
    const yaxis = { label: opts.ylabel || "", labelSize: 16, size: opts.ysize || 60 };
    if (opts.yvalues) yaxis.values = opts.yvalues;   // uPlot takes a present-but-undefined key literally
    const u = new uPlot({
      width: width(el), height: opts.height || 220,
      scales: { x: xscale, y: { range: opts.yrange || ((u, min, max) => [0, max > 0 ? max * 1.1 : 1]) } },
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      axes: [xaxis, yaxis],
      series: [{ label: opts.xlabel || "request #" }].concat(series),
    }, [[]].concat(series.map(() => [])), el);
    charts[id] = u;
    return u;
  }

  function bars() { return uPlot.paths.bars({ size: [0.7, 40] }); }

  function initCharts() {
    makeChart("c-ttft", [
      { label: "TTFT (s)", stroke: C.accent, width: 2, points: { show: true, size: 7, fill: C.accent } },
    ], { ylabel: "seconds" });
    makeChart("c-speed", [
      { label: "prefill tok/s", stroke: C.prefilled, width: 2, points: { show: true, size: 7, fill: C.prefilled } },
      { label: "decode tok/s", stroke: C.decode, width: 2, points: { show: true, size: 6, fill: C.decode } },
    ], { ylabel: "tokens / s" });
    // Stacked by hand: "prefilled" is drawn as cached+prefilled first, "from cache" on top of its lower part.
    charts.matchRaw = { cached: [], prefilled: [] };
    makeChart("c-match", [
      { label: "prefilled", fill: C.prefilled, stroke: C.prefilled, paths: bars(), points: { show: false } },
      { label: "from cache", fill: C.cached, stroke: C.cached, paths: bars(), points: { show: false } },
    ], { ylabel: "prompt tokens", xrange: (u, min, max) => [min - 0.6, max + 0.6] });
    // The budget is usually far above what is used: keep the axis on usage unless the budget is near.
    makeChart("c-mem", [
      { label: "used", stroke: C.accent, width: 2, fill: "rgba(37,99,235,0.12)" },
      { label: "budget", stroke: C.budget, width: 1, dash: [6, 4] },
    ], { height: 140, xtime: true, ysize: 70, yvalues: (u, vals) => vals.map(fmtBytes),
         yrange: (u) => {
           const used = Math.max(1, ...memHistory.used), budget = Math.max(0, ...memHistory.budget);
           return [0, budget && budget < used * 2 ? budget * 1.05 : used * 1.25];
         } });
    window.addEventListener("resize", () => {
      for (const id of ["c-ttft", "c-speed", "c-match", "c-mem"]) {
        const u = charts[id];
        if (u) u.setSize({ width: width($(id)), height: u.height });
      }
    });
  }

  // ------------------------------------------------------------------ render
  function renderCharts(rows, firstIndex) {
    const xs = rows.map((_, i) => firstIndex + i);
    charts["c-ttft"].setData([xs, rows.map((r) => r.ttft_s)]);
    charts["c-speed"].setData([xs,
      rows.map((r) => (r.prefilled_tokens > 0 && r.prefill_tok_s > 0 ? r.prefill_tok_s : null)),
      rows.map((r) => (r.completion_tokens > 1 && r.decode_tok_s > 0 ? r.decode_tok_s : null))]);
    const m = charts.matchRaw;
    m.cached = rows.map((r) => r.cached_tokens || 0);
    m.prefilled = rows.map((r) => r.prefilled_tokens || 0);
    charts["c-match"].setData([xs, rows.map((r, i) => m.cached[i] + m.prefilled[i]), m.cached]);
    state.points.ttft = rows.filter((r) => r.ttft_s != null).length;
    state.points.speed = rows.filter((r) => r.prefill_tok_s > 0 || r.decode_tok_s > 0).length;
    state.points.match = rows.length;
  }

  function renderMemory(s) {
    const used = s.bytes || 0, budget = s.budget_bytes || 0;
    const pct = budget ? (100 * used) / budget : 0;
    const fill = $("mem-fill");
    fill.style.width = used ? `max(3px, ${Math.min(100, pct).toFixed(1)}%)` : "0";
    fill.classList.toggle("high", pct > 90);
    $("mem-text").textContent = `${fmtBytes(used)} of ${fmtBytes(budget)} (${pct.toFixed(pct < 1 ? 2 : 1)}%) · ` +
      `${fmtInt(s.entries)} entries, ${fmtInt(s.tokens)} tokens, ${fmtInt(s.evictions)} evicted`;
    memHistory.t.push(Date.now() / 1000);
    memHistory.used.push(used);
    memHistory.budget.push(budget);
    if (memHistory.t.length > MEM_HISTORY) { memHistory.t.shift(); memHistory.used.shift(); memHistory.budget.shift(); }
    charts["c-mem"].setData([memHistory.t, memHistory.used, memHistory.budget]);
    state.points.memory = memHistory.t.length;
  }

  function renderHits(s) {
    const hits = s.hits || {};
    const names = MATCH_ORDER.concat(Object.keys(hits).filter((k) => !MATCH_ORDER.includes(k)));
    const rows = names.map((k) => [k, hits[k] || 0]).concat([["miss", s.misses || 0]]);
    const max = Math.max(1, ...rows.map((r) => r[1]));
    $("hits").innerHTML = rows.map(([k, n]) =>
      `<div class="row${k === "miss" ? " miss" : ""}"><div>${esc(k)}</div>` +
      `<div class="bar"><div style="width:${((100 * n) / max).toFixed(1)}%"></div></div><div class="n">${fmtInt(n)}</div></div>`).join("");
    state.hits = hits;
    state.misses = s.misses || 0;
  }

  function ctile(label, n, judged) {
    const cls = judged ? (n ? "ctile nonzero" : "ctile") : "ctile neutral";
    return `<div class="${cls}" data-counter="${esc(label)}"><div class="label">${esc(label)}</div><div class="value">${fmtInt(n)}</div></div>`;
  }

  function renderCounters(s) {
    const corr = s.correctness || {};
    $("correctness").innerHTML = Object.keys(corr).map((k) => ctile(k, corr[k], true)).join("");
    const c = s.counters || {};
    const robust = { disconnects: c.disconnects || 0, watchdog_aborts: c.watchdog_aborts || 0,
                     cache_key_safety_fallback: c.cache_key_safety_fallback || 0 };
    $("robust").innerHTML = Object.keys(robust).map((k) => ctile(k, robust[k], false)).join("");
    state.correctness = corr;
  }

  function renderTiers(s) {
    const d = s.disk || null, c = s.counters || {};
    const tiles = d ? { "disk entries": d.entries, "disk hits": d.hits, "disk writes": d.writes,
                        "disk evictions": d.evictions, "corrupt dropped": d.corrupt_dropped,
                        "salvaged tokens": c.salvaged_prefill_tokens || 0 }
                    : { "salvaged tokens": c.salvaged_prefill_tokens || 0 };
    $("tiers").innerHTML = Object.keys(tiles).map((k) => ctile(k, tiles[k] || 0, k === "corrupt dropped")).join("");
    const q = s.kv_quant ? `KV ${s.kv_quant.scheme === "turboquant" ? "TurboQuant " : ""}${s.kv_quant.bits}-bit from ${fmtInt(s.kv_quant.start)} tokens, ` +
      `${fmtBytes(s.quantized_bytes || 0)} quantised in RAM` : "KV quantisation off";
    $("tiers-text").textContent = (d ? `disk ${fmtBytes(d.bytes)} of ${fmtBytes(d.max_bytes)} · ` : "disk tier off · ") + q;
    state.tiers = tiles;
  }

  function renderTiles(s, rows) {
    const c = s.counters || {};
    const hitsTotal = Object.values(s.hits || {}).reduce((a, b) => a + b, 0);
    const lookups = hitsTotal + (s.misses || 0);
    const cached = c.cached_tokens || 0, pre = c.prefilled_tokens || 0;
    $("t-requests").textContent = fmtInt(c.requests || 0);
    $("t-hitrate").textContent = lookups ? ((100 * hitsTotal) / lookups).toFixed(0) + "%" : "–";
    $("t-cachedshare").textContent = cached + pre ? ((100 * cached) / (cached + pre)).toFixed(0) + "%" : "–";
    const last = rows[rows.length - 1];
    $("t-ttft").textContent = last ? fmtNum(last.ttft_s, 3) + " s" : "–";
    $("t-entries").textContent = fmtInt(s.entries);
    $("t-queue").textContent = fmtInt(s.queue_depth);
    const sc = s.scheduler || {};
    $("t-flight").textContent = `${fmtInt(sc.active || 0)} / ${fmtInt(sc.last_batch_size || 0)}`;
    $("t-preempt").textContent = sc.priority_scheduling
      ? `${fmtInt(sc.preempted || 0)} / ${fmtInt(sc.preemptions_total || 0)}` : "off";
    const byPrio = (o) => Object.entries(o || {}).map(([p, n]) => `priority ${p}: ${n}`).join(", ") || "none";
    $("t-preempt").title = `in flight by priority: ${byPrio(sc.in_flight_by_priority)}\n` +
      `queued by priority: ${byPrio(sc.queued_by_priority)} (lower goes first; PRIORITY_SCHEDULING)`;
    const proposed = c.spec_proposed || 0, accepted = c.spec_accepted || 0;
    $("t-spec").textContent = proposed ? `${fmtInt(accepted)} / ${fmtInt(proposed)}` : "–";
    $("t-spec").title = proposed ? `${((100 * accepted) / proposed).toFixed(0)}% of draft tokens accepted ` +
      `(speculative decoding: each saved one decode step)` : "no drafts yet (SPECULATIVE)";
    const kv = s.kv_bytes || 0, live = s.live_kv_bytes || 0;
    $("t-kv").textContent = fmtBytes(kv);
    $("t-kv").title = `in flight ${fmtBytes(live)} + cache tier ${fmtBytes(s.bytes || 0)} ` +
      `(cache budget ${fmtBytes(s.budget_bytes || 0)})`;
    $("model").textContent = s.model || "";
    const d = s.distributed;
    $("t-ranks").textContent = d ? `${d.ranks} · ${d.mode}` : "1";
    $("t-ranks").title = d ? (d.per_rank || []).map((r) => `rank ${r.rank}: MLX ${fmtBytes(r.active_memory)} ` +
      `(peak ${fmtBytes(r.peak_memory)}), RSS ${fmtBytes(r.rss)}`).join("\n") +
      `\nbroadcast ${fmtNum(d.share_us_per_turn)} µs per step` : "one process (DISTRIBUTED=off)";
  }

  function renderTable(rows, firstIndex) {
    const body = $("recent").tBodies[0];
    if (!rows.length) { body.innerHTML = '<tr><td colspan="13" class="muted">no requests yet</td></tr>'; return; }
    const out = [];
    for (let i = rows.length - 1; i >= Math.max(0, rows.length - 25); i--) {
      const r = rows[i];
      const when = r.time ? new Date(r.time * 1000).toLocaleTimeString() : "";
      const mt = r.match_type || "";
      out.push(`<tr><td>${firstIndex + i}</td><td>${esc(when)}</td><td><code>${esc(r.request_id)}</code></td>` +
        `<td><code>${esc(r.session)}</code></td><td class="${mt === "miss" ? "miss" : "hit"}">${esc(mt)}</td>` +
        `<td class="num">${fmtInt(r.prompt_tokens)}</td><td class="num">${fmtInt(r.cached_tokens)}</td>` +
        `<td class="num">${fmtInt(r.prefilled_tokens)}</td><td class="num">${fmtInt(r.completion_tokens)}</td>` +
        `<td class="num">${fmtNum(r.ttft_s, 3)}</td><td class="num">${fmtNum(r.prefill_tok_s)}</td>` +
        `<td class="num">${fmtNum(r.decode_tok_s)}</td><td>${esc(r.finish_reason)}</td></tr>`);
    }
    body.innerHTML = out.join("");
  }

  // A request's cache explanation in words: the same words as mlxstack/observability/cache_explain.py
  // (scripts/explain_cache.py), from the row's cache_diagnosis (cache/diagnosis.py as_dict).
  const PARTS = { model: "model", prompt_cache_key: "prompt_cache_key", system: "system prompt", tools: "tools" };
  function divergence(d) {
    if (!d || !d.where) return "";
    if (d.where === "reply") return `the previous reply (message ${d.message})`;
    if (d.where === "messages") return `message ${d.message} ${(d.field || "").replace("(volatile)", "(volatile field)")}`;
    if (d.where.startsWith("settings.")) return "setting " + d.where.slice("settings.".length);
    return PARTS[d.where] || d.where;
  }
  function explanation(r) {
    if (r.cache_explain === "off") return "cache off";
    const d = r.cache_diagnosis;
    if (!d) return "first request of its session";
    if (d.status === "hit") return `hit: continues the previous request (${d.common || 0} tokens in common)`;
    if (d.status === "unavailable") return `unavailable: the prompt continues the previous request ` +
      `(${d.common || 0} tokens in common) but its entry is gone (evicted or expired)`;
    if (d.status === "miss") return `miss: ${divergence(d)} changed; ${d.missed || 0} of ${d.previous || 0} ` +
      `reusable tokens not reused, the prompts part at token ${d.common || 0}`;
    return String(d.status);
  }

  function renderExplain(rows, firstIndex) {
    const body = $("explain").tBodies[0];
    if (!rows.length) { body.innerHTML = '<tr><td colspan="10" class="muted">no requests yet</td></tr>'; return; }
    const out = [];
    for (let i = rows.length - 1; i >= Math.max(0, rows.length - 25); i--) {
      const r = rows[i], d = r.cache_diagnosis;
      const when = r.time ? new Date(r.time * 1000).toLocaleTimeString() : "";
      const miss = d && d.status === "miss";
      out.push(`<tr class="${miss ? "missrow" : ""}" data-request="${esc(r.request_id)}"><td>${firstIndex + i}</td>` +
        `<td>${esc(when)}</td><td>${esc(r.api)}</td><td><code>${esc(r.session)}</code></td>` +
        `<td>${esc(r.cache_tier)}</td><td class="num">${fmtInt(r.prompt_tokens)}</td>` +
        `<td class="num">${fmtInt(r.cached_tokens)}</td><td class="num">${fmtInt(r.cache_written)}</td>` +
        `<td class="${miss ? "miss" : ""}">${esc(miss ? divergence(d) : "")}</td><td>${esc(explanation(r))}</td></tr>`);
    }
    body.innerHTML = out.join("");
  }

  function setStatus(text, cls) {
    const el = $("status");
    el.textContent = text;
    el.className = "pill " + (cls || "");
  }

  async function refresh() {
    try {
      const resp = await fetch("/v1/cache/stats", { cache: "no-store" });
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      const s = await resp.json();
      if (s.ready === false) { setStatus("model loading", ""); return; }
      const rows = s.recent || [];
      const total = (s.counters && s.counters.requests) || rows.length;
      const firstIndex = Math.max(1, total - rows.length + 1);
      renderCharts(rows, firstIndex);
      renderMemory(s);
      renderHits(s);
      renderCounters(s);
      renderTiers(s);
      renderTiles(s, rows);
      renderTable(rows, firstIndex);
      renderExplain(rows, firstIndex);
      state.ready = true;
      state.recentRows = rows.length;
      state.refreshes++;
      state.lastUpdate = new Date().toISOString();
      setStatus("live · " + new Date().toLocaleTimeString(), "ok");
    } catch (err) {
      state.errors++;
      state.lastError = String(err);
      setStatus("error: " + err, "err");
    }
  }

  initCharts();
  refresh();
  setInterval(refresh, REFRESH_MS);
})();
