// prefixgate cache dashboard: polls /admin/dashboard/data (one request at a time, at most one per second, paused
// while the tab is hidden) and draws each panel with uPlot (vendored in /admin/static/uplot, MIT).
// Tables are built with textContent only (no HTML from the data). A panel's data-state is "ready" once its
// chart has at least one value, "empty" while the gateway has nothing to show there yet.
"use strict";

(function () {
  const POLL_MS = 1000;
  const COLORS = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#be185d", "#4d7c0f",
    "#92400e", "#475569"];
  const charts = {};

  // ---- number formats (units on every axis) -----------------------------------------------------------
  function si(v, unit) {
    if (v == null || !isFinite(v)) return "–";
    const a = Math.abs(v);
    const [d, p] = a >= 1e12 ? [1e12, "T"] : a >= 1e9 ? [1e9, "G"] : a >= 1e6 ? [1e6, "M"] : a >= 1e3 ? [1e3, "k"] : [1, ""];
    const n = v / d;
    return (Math.abs(n) >= 100 || n === Math.round(n) ? n.toFixed(0) : n.toPrecision(3)) + " " + p + unit;
  }
  function bytes(v) {
    if (v == null || !isFinite(v)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v.toFixed(0) : v.toPrecision(3)) + " " + units[i];
  }
  function pct(v) { return v == null || !isFinite(v) ? "–" : (100 * v).toFixed(v >= 0.1 || v === 0 ? 0 : 1) + " %"; }
  function usd(v) {
    if (v == null || !isFinite(v)) return "–";
    return "$" + (Math.abs(v) >= 1 ? v.toFixed(2) : Math.abs(v) >= 0.01 ? v.toFixed(3) : v.toPrecision(2));
  }
  function secs(v) {
    if (v == null || !isFinite(v)) return "–";
    return Math.abs(v) >= 1 || v === 0 ? v.toPrecision(3) + " s" : (v * 1000).toPrecision(3) + " ms";
  }
  const fmt = { tokens: (v) => si(v, "tok"), rps: (v) => si(v, "req/s"), tps: (v) => si(v, "tok/s"),
    count: (v) => si(v, ""), blocks: (v) => si(v, "blocks"), perSec: (v) => si(v, "/s"), requests: (v) => si(v, "req"),
    pct: pct, usd: usd, secs: secs, bytes: bytes };

  // tick steps of the axes of whole units (bytes, tokens, blocks, requests, counts): whole numbers only, so an
  // empty or small range never gets fractional ticks that round to repeated labels ("1 B, 1 B, 0 B" for 0.25 to
  // 1 B); bytes step by powers of two (512 KiB, 1 MiB, ...), the others by 1, 2, 5 x 10^k
  const WHOLE_STEPS = [];
  for (let e = 0; e <= 15; e++) [1, 2, 5].forEach((m) => WHOLE_STEPS.push(m * 10 ** e));
  const BYTE_STEPS = Array.from({ length: 51 }, (_, i) => 2 ** i);
  const STEPS = new Map([[bytes, BYTE_STEPS], [fmt.tokens, WHOLE_STEPS], [fmt.count, WHOLE_STEPS],
    [fmt.blocks, WHOLE_STEPS], [fmt.requests, WHOLE_STEPS]]);

  // ---- charts -----------------------------------------------------------------------------------------
  // the axis grows with its longest tick label, so labels never run into the axis title
  function fitSize(u, values) {
    return values ? 30 + 7 * Math.max(3, ...values.map((v) => String(v).length)) : 50;
  }
  function axis(label, formatter, side) {
    const spec = { label: label, side: side, size: fitSize, values: (u, splits) => splits.map(formatter),
      grid: { show: side !== 1 } };
    if (STEPS.has(formatter)) spec.incrs = STEPS.get(formatter);
    return spec;
  }
  function sizeOf(el) { return { width: Math.max(el.clientWidth, 260), height: 240 }; }

  // spec: {key, series: [{label, scale, fmt}], scales: {name: {label, fmt, side, range}}, x: "time" | labels[]}
  function draw(panelId, spec, data) {
    const panel = document.getElementById(panelId);
    const el = panel.querySelector(".chart");
    const shape = JSON.stringify([spec.series.map((s) => s.label), spec.x === "time" ? "t" : spec.x]);
    let entry = charts[panelId];
    if (entry && entry.shape !== shape) { entry.chart.destroy(); entry = null; }
    if (!entry) {
      const bars = spec.x !== "time";
      const scales = { x: bars ? { time: false, range: [-0.5, spec.x.length - 0.5] } : { time: true } };
      const axes = [bars
        ? { label: spec.xLabel, splits: () => spec.x.map((_, i) => i), size: 40,
            // as many labels as fit (about 90 px each): every step-th bar is named
            values: (u, splits) => {
              const step = Math.max(1, Math.ceil(spec.x.length * 90 / Math.max(u.width, 1)));
              return splits.map((i) => (Number.isInteger(i) && i % step === 0 ? spec.x[i] || "" : ""));
            } }
        : { label: "time (local)", size: 62 }];
      for (const [name, s] of Object.entries(spec.scales)) {
        scales[name] = s.range ? { range: s.range } : { range: (u, min, max) => [Math.min(0, min), max > 0 ? max * 1.1 : 1] };
        axes.push(Object.assign(axis(s.label, s.fmt, s.side || 3), { scale: name }));
      }
      // bars: one series centred on its label, two side by side (left / right of the label)
      const n = spec.series.length;
      const align = n === 2 ? [-1, 1] : spec.series.map(() => 0);
      const series = [{ label: bars ? spec.xLabel : "time", value: bars ? (u, i) => (i == null ? "–" : spec.x[i]) : undefined }]
        .concat(spec.series.map((s, i) => ({
          label: s.label, scale: s.scale, stroke: COLORS[i % COLORS.length], width: bars ? 1 : 2,
          fill: bars ? COLORS[i % COLORS.length] + "aa" : undefined,
          value: (u, v) => spec.scales[s.scale].fmt(v), spanGaps: false,
          paths: bars ? uPlot.paths.bars({ size: [n === 2 ? 0.4 : 0.6, 80], align: align[i] }) : undefined,
          points: { show: !bars },
        })));
      const opts = Object.assign(sizeOf(el), { series: series, scales: scales, axes: axes,
        legend: { live: true }, cursor: { drag: { x: false, y: false } } });
      const chart = new uPlot(opts, data, el);
      entry = charts[panelId] = { chart: chart, shape: shape };
      new ResizeObserver(() => chart.setSize(sizeOf(el))).observe(el);
    } else {
      entry.chart.setData(data);
    }
    const hasData = data.slice(1).some((col) => col.some((v) => v != null && isFinite(v)));
    panel.dataset.state = hasData ? "ready" : "empty";
  }

  function perModel(series, key) {
    return Object.entries(series.models).map(([model, cols]) => ({ label: model, col: cols[key] }));
  }
  function lines(panelId, t, cols, scaleName, scaleSpec, extra) {
    const list = cols.concat(extra ? extra.cols : []);
    const scales = { [scaleName]: scaleSpec };
    if (extra) scales[extra.scaleName] = extra.scaleSpec;
    draw(panelId, {
      series: cols.map((c) => ({ label: c.label, scale: scaleName }))
        .concat(extra ? extra.cols.map((c) => ({ label: c.label, scale: extra.scaleName })) : []),
      scales: scales, x: "time",
    }, [t].concat(list.map((c) => c.col)));
  }

  // ---- panels -----------------------------------------------------------------------------------------
  function render(doc) {
    const s = doc.series;
    const t = s.t;
    tiles(doc);
    lines("panel-hit-rate", t, perModel(s, "hit_rate"), "pct", { label: "hit rate (%)", fmt: pct, range: [0, 1] });
    lines("panel-requests", t, perModel(s, "rps").map((c) => ({ label: c.label + " req/s", col: c.col })), "rps",
      { label: "requests (req/s)", fmt: fmt.rps },
      { cols: perModel(s, "rules_share").map((c) => ({ label: c.label + " rules on", col: c.col })), scaleName: "pct",
        scaleSpec: { label: "rewritten by rules (%)", fmt: pct, side: 1, range: [0, 1] } });
    lines("panel-saved", t, [{ label: "prompt tokens saved", col: s.tokens_saved }], "tok",
      { label: "tokens saved (tok)", fmt: fmt.tokens },
      { cols: [{ label: "prefill seconds saved", col: s.prefill_seconds_saved }], scaleName: "s",
        scaleSpec: { label: "prefill time saved (s)", fmt: secs, side: 1 } });
    lines("panel-money", t, [{ label: "saved by cache reads", col: s.usd_saved },
      { label: "cache-write waste", col: s.write_waste_usd }], "usd", { label: "US dollars ($)", fmt: usd });
    const causes = Object.entries(s.misses_per_s).map(([cause, col]) => ({ label: cause, col: col }));
    lines("panel-misses", t, causes, "mps", { label: "misses (per s)", fmt: fmt.perSec },
      { cols: [{ label: "learned slots awaiting review", col: s.learned_slots }], scaleName: "slots",
        scaleSpec: { label: "learned slots (count)", fmt: fmt.count, side: 1 } });
    learnedTable(doc.learned);
    lines("panel-pool", t, ["used", "cached", "free"].map((k) => ({ label: k, col: s.blocks[k] })), "blocks",
      { label: "KV blocks (blocks)", fmt: fmt.blocks });
    lines("panel-tiers", t, Object.entries(s.tier_bytes).map(([tier, col]) => ({ label: tier + " bytes held", col: col })),
      "bytes", { label: "held (bytes)", fmt: bytes },
      { cols: Object.entries(s.evictions).map(([lvl, col]) => ({ label: lvl + " evictions", col: col }))
          .concat(Object.entries(s.expirations).map(([lvl, col]) => ({ label: lvl + " expirations", col: col }))),
        scaleName: "n", scaleSpec: { label: "entries / blocks (count)", fmt: fmt.count, side: 1 } });
    ttft(doc.ttft);
    lines("panel-decode", t, perModel(s, "decode_tps"), "tps", { label: "decode speed (tok/s)", fmt: fmt.tps });
    prefixes(doc.prefixes);
    replicas(doc.replicas);
  }

  function ttft(h) {
    const all = h.buckets_s.map((b) => "≤" + secs(b)).concat(["> " + secs(h.buckets_s[h.buckets_s.length - 1])]);
    // only the buckets from one below the first filled to one above the last filled
    const filled = all.map((_, i) => (h.hit[i] || 0) + (h.miss[i] || 0) > 0);
    const first = Math.max(filled.indexOf(true) - 1, 0);
    const last = filled.lastIndexOf(true) < 0 ? all.length - 1 : Math.min(filled.lastIndexOf(true) + 1, all.length - 1);
    const labels = all.slice(first, last + 1);
    draw("panel-ttft", {
      series: [{ label: "hit (cached tokens > 0)", scale: "req" }, { label: "miss", scale: "req" }],
      scales: { req: { label: "requests (req)", fmt: fmt.requests } }, x: labels, xLabel: "TTFT bucket (upper bound)",
    }, [labels.map((_, i) => i), h.hit.slice(first, last + 1), h.miss.slice(first, last + 1)]);
  }

  function prefixes(rows) {
    const labels = rows.map((r) => r.prefix_key.slice(0, 8));
    draw("panel-prefixes", {
      series: [{ label: "requests", scale: "req" }, { label: "cached tokens", scale: "tok" }],
      scales: { req: { label: "requests (req)", fmt: fmt.requests }, tok: { label: "cached (tok)", fmt: fmt.tokens, side: 1 } },
      x: labels, xLabel: "prefix key (first 8 hex)",
    }, [labels.map((_, i) => i), rows.map((r) => r.requests), rows.map((r) => r.cached_tokens)]);
    table("prefix-table", ["prefix key", "model", "tenant", "level", "requests", "prompt tok", "cached tok", "hit rate", "cached now"],
      rows.map((r) => [[r.prefix_key, "hash"], r.model, r.tenant || "–", r.level || "–", [fmt.count(r.requests), "num"],
        [fmt.tokens(r.prompt_tokens), "num"], [fmt.tokens(r.cached_tokens), "num"], [pct(r.hit_rate), "num"],
        [r.cached_now_tokens == null ? "–" : fmt.tokens(r.cached_now_tokens), "num"]]));
  }

  function replicas(rows) {
    const labels = rows.map((r) => r.model + " " + r.replica.replace(/^https?:\/\//, ""));
    draw("panel-replicas", {
      series: [{ label: "share of the model's requests", scale: "pct" }],
      scales: { pct: { label: "share of requests (%)", fmt: pct, range: [0, 1] } }, x: labels, xLabel: "replica",
    }, [labels.map((_, i) => i), rows.map((r) => r.share)]);
    table("replica-table", ["model", "replica", "state", "in flight", "failures", "requests", "share", "spilled here"],
      rows.map((r) => [r.model, r.replica, r.state, [fmt.count(r.inflight), "num"], [fmt.count(r.failures), "num"],
        [fmt.count(r.requests), "num"], [pct(r.share), "num"],
        [r.away == null ? "\u2013" : fmt.count(r.away), "num"]]));
  }

  function learnedTable(learned) {
    document.getElementById("learned-count").textContent = String(learned.awaiting_review);
    table("learned-table", ["slot", "model", "tenant", "distinct values", "observations"],
      learned.slots.map((r) => [[r.id, "hash"], r.model, r.tenant || "–", [fmt.count(r.distinct_values), "num"],
        [fmt.count(r.observations), "num"]]));
  }

  function table(id, head, rows) {
    const el = document.getElementById(id);
    el.replaceChildren();
    const tr = document.createElement("tr");
    head.forEach((h) => { const th = document.createElement("th"); th.textContent = h; tr.appendChild(th); });
    const thead = document.createElement("thead"); thead.appendChild(tr); el.appendChild(thead);
    const tbody = document.createElement("tbody");
    rows.forEach((row) => {
      const r = document.createElement("tr");
      row.forEach((cell) => {
        const td = document.createElement("td");
        const [text, cls] = Array.isArray(cell) ? cell : [cell, ""];
        td.textContent = String(text);
        if (cls) td.className = cls;
        r.appendChild(td);
      });
      tbody.appendChild(r);
    });
    el.appendChild(tbody);
  }

  function tiles(doc) {
    const t = doc.totals;
    const items = [["requests", fmt.count(t.requests)], ["hit rate (tokens)", pct(t.hit_rate)],
      ["prompt tokens saved", fmt.tokens(t.tokens_saved)], ["prefill time saved", secs(t.prefill_seconds_saved)],
      ["money saved", usd(t.usd_saved)], ["cache-write waste", usd(t.write_waste_usd)],
      ["cache-write tokens", fmt.tokens(t.cache_creation_tokens)], ["pool evictions", fmt.count(t.evictions)]];
    const el = document.getElementById("tiles");
    el.replaceChildren();
    items.forEach(([label, value]) => {
      const d = document.createElement("div"); d.className = "tile";
      const l = document.createElement("div"); l.className = "label"; l.textContent = label;
      const v = document.createElement("div"); v.className = "value"; v.textContent = value;
      d.appendChild(l); d.appendChild(v); el.appendChild(d);
    });
  }

  // ---- polling ----------------------------------------------------------------------------------------
  const status = document.getElementById("status");
  async function poll() {
    if (document.hidden) { document.addEventListener("visibilitychange", poll, { once: true }); return; }
    const started = Date.now();
    try {
      const response = await fetch("/admin/dashboard/data", { credentials: "same-origin", cache: "no-store" });
      if (response.status === 401) { window.location.assign("/admin/login"); return; }
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
      status.textContent = "updated " + new Date().toLocaleTimeString();
      status.className = "status";
    } catch (err) {
      status.textContent = "no data: " + err.message;
      status.className = "status error";
    }
    setTimeout(poll, Math.max(POLL_MS - (Date.now() - started), 0));  // at most one request per second
  }
  poll();
})();
