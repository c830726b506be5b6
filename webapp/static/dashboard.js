/* Operators' latency dashboard: polls /dashboard/data and draws every figure from it. Text goes in as text only. */
(() => {
  "use strict";

  const root = document.getElementById("dashboard");
  const dataUrl = root.dataset.dataUrl;
  const loginUrl = root.dataset.loginUrl;
  const pollMs = Math.max(1, Number(root.dataset.pollSeconds) || 5) * 1000;
  const LATENCIES = ["queue_wait", "ttft", "tpot", "e2e"];
  const QUANTILES = ["p50", "p90", "p99"];
  const REASON_LABELS = {stop: "Finished", length: "Hit the length limit", cancelled: "Stopped by the customer",
                         error: "Failed"};
  const REASON_ORDER = Object.keys(REASON_LABELS);

  let windowKey = root.dataset.window;
  let xRange = [0, 1];
  let timer = null;
  let latest = 0;   // the newest refresh; answers to older ones are dropped
  const charts = {};

  // ---- formatting -------------------------------------------------------------------------

  function fmtSeconds(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    if (v === 0) return "0";
    if (v < 0.01) return `${(v * 1000).toFixed(2)} ms`;
    if (v < 1) return `${(v * 1000).toFixed(0)} ms`;
    if (v < 60) return `${v.toFixed(v < 10 ? 2 : 1)} s`;
    const m = Math.floor(v / 60);
    return `${m} min ${Math.round(v - 60 * m)} s`;
  }

  function fmtNumber(v, digits = 0) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    return v.toLocaleString(undefined, {minimumFractionDigits: digits, maximumFractionDigits: digits});
  }

  // Rates over long windows are small: keep three significant digits rather than rounding them to 0.
  function fmtRate(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    if (v === 0) return "0";
    return Math.abs(v) < 10 ? v.toLocaleString(undefined, {maximumSignificantDigits: 3}) : fmtNumber(v, 1);
  }

  function fmtPercent(v) {
    return v === null || v === undefined ? "–" : `${(v * 100).toFixed(v < 0.1 && v > 0 ? 1 : 0)} %`;
  }

  function fmtTime(ts) {
    const d = new Date(ts * 1000);
    const today = new Date().toDateString() === d.toDateString();
    return today ? d.toLocaleTimeString() : d.toLocaleString();
  }

  function setText(id, text) {
    document.getElementById(id).textContent = text;
  }

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  // ---- charts -------------------------------------------------------------------------------

  function chartOptions(el, series, format) {
    const text = cssVar("--text-muted");
    const grid = cssVar("--border");
    return {
      width: Math.max(200, el.clientWidth),
      height: 190,
      scales: {
        x: {time: true, range: () => xRange},
        y: {range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1]},
      },
      series: [{value: (u, v) => (v === null ? "–" : fmtTime(v))},
        ...series.map((s) => ({label: s.label, stroke: s.color, width: 2, spanGaps: false,
                               points: {show: true, size: 5, fill: s.color}, value: (u, v) => format(v)}))],
      axes: [
        {stroke: text, grid: {stroke: grid, width: 1}, ticks: {stroke: grid, width: 1}},
        {stroke: text, grid: {stroke: grid, width: 1}, ticks: {stroke: grid, width: 1}, size: 64,
         values: (u, splits) => splits.map(format)},
      ],
    };
  }

  function makeChart(name, series, format) {
    const el = root.querySelector(`[data-chart="${name}"]`);
    const empty = [[], ...series.map(() => [])];
    const chart = new uPlot(chartOptions(el, series, format), empty, el);
    new ResizeObserver(() => chart.setSize({width: Math.max(200, el.clientWidth), height: 190})).observe(el);
    charts[name] = {chart, el};
  }

  function setChart(name, t, columns) {
    const {chart, el} = charts[name];
    chart.setData([t, ...columns]);
    el.dataset.points = String(columns.reduce((n, col) => n + col.filter((v) => v !== null).length, 0));
  }

  function buildCharts() {
    const q = [
      {label: "p50", color: cssVar("--chart-p50")},
      {label: "p90", color: cssVar("--chart-p90")},
      {label: "p99", color: cssVar("--chart-p99")},
    ];
    LATENCIES.forEach((name) => makeChart(name, q, fmtSeconds));
    makeChart("tokens", [{label: "tokens/s", color: cssVar("--chart-p50")}], fmtRate);
    makeChart("requests", [{label: "requests/min", color: cssVar("--chart-p50")},
                           {label: "errors/min", color: cssVar("--chart-p99")}], fmtRate);
  }

  // ---- rendering ----------------------------------------------------------------------------

  function renderLive(live) {
    const workers = live.workers || [];
    setText("now-workers", live.error ? "?" : fmtNumber(workers.length));
    setText("now-model", live.error || [...new Set(workers.map((w) => w.model).filter(Boolean))].join(", ")
      || "no worker: start one");
    document.getElementById("tile-workers").dataset.tone = live.error || !workers.length ? "bad" : "good";
    setText("now-queue", fmtNumber(live.queue_depth));
    setText("now-running", fmtNumber(live.running));
    setText("now-waiting", live.waiting === null ? "" : `${fmtNumber(live.waiting)} waiting for a slot`);
    setText("now-kv", fmtPercent(live.kv_cache_usage));
    document.getElementById("now-kv-meter").style.width = `${Math.min(100, (live.kv_cache_usage || 0) * 100)}%`;
  }

  function renderTotals(data) {
    const t = data.totals;
    setText("window-label", data.window.label);
    setText("kpi-requests", fmtNumber(t.requests));
    setText("kpi-rpm", `${fmtRate(t.requests_per_minute)} per minute`);
    setText("kpi-tps", fmtRate(t.tokens_per_second));
    setText("kpi-tokens", `${fmtNumber(t.completion_tokens)} tokens written`);
    setText("kpi-ttft", fmtSeconds(data.latency.ttft.p90));
    setText("kpi-e2e", fmtSeconds(data.latency.e2e.p90));
    setText("kpi-errors", fmtNumber(t.errors));
    setText("kpi-error-rate", t.error_rate === null ? "no requests" : `${fmtPercent(t.error_rate)} of requests`);
    document.getElementById("tile-errors").dataset.tone = t.errors > 0 ? "bad" : "";
    setText("kpi-batch", fmtNumber(t.mean_batch_size, 1));
    setText("kpi-prefix", t.prefix_cache_hit_rate === null ? "" : `${fmtPercent(t.prefix_cache_hit_rate)} of prompt tokens cached`);
  }

  function renderLatency(latency) {
    for (const name of LATENCIES) {
      const row = document.querySelector(`#latency-table tr[data-metric="${name}"]`);
      for (const q of QUANTILES) row.querySelector(`[data-q="${q}"]`).textContent = fmtSeconds(latency[name][q]);
      row.querySelector('[data-q="count"]').textContent = fmtNumber(latency[name].count);
    }
  }

  function renderSeries(data) {
    const s = data.series;
    const step = data.window.bucket_seconds;
    xRange = [data.generated_at - data.window.seconds, data.generated_at];
    // Points sit mid-bucket, where their requests finished on average; the current bucket's at now.
    const t = s.t.map((x) => Math.min(x + step / 2, data.generated_at));
    for (const name of LATENCIES) setChart(name, t, QUANTILES.map((q) => s[name][q]));
    setChart("tokens", t, [s.tokens_per_second]);
    setChart("requests", t, [s.requests_per_minute, s.errors_per_minute]);
  }

  function renderReasons(reasons) {
    const list = document.getElementById("finish-reasons");
    const total = Object.values(reasons).reduce((a, b) => a + b, 0);
    const rank = (reason) => (REASON_ORDER.includes(reason) ? REASON_ORDER.indexOf(reason) : REASON_ORDER.length);
    const entries = Object.entries(reasons).sort(([a], [b]) => rank(a) - rank(b) || a.localeCompare(b));
    list.replaceChildren(...entries.map(([reason, count]) => {
      const li = document.createElement("li");
      li.className = "bars__row";
      li.dataset.reason = reason;
      const label = document.createElement("span");
      label.className = "bars__label";
      label.textContent = REASON_LABELS[reason] || reason;
      const track = document.createElement("span");
      track.className = "bars__track";
      const fill = document.createElement("span");
      fill.className = "bars__fill";
      fill.style.width = `${total ? (100 * count) / total : 0}%`;
      track.append(fill);
      const value = document.createElement("span");
      value.className = "bars__value";
      value.textContent = total ? `${fmtNumber(count)} (${fmtPercent(count / total)})` : "0";
      li.append(label, track, value);
      return li;
    }));
  }

  function cell(tag, text, className) {
    const el = document.createElement(tag);
    el.textContent = text;
    if (className) el.className = className;
    return el;
  }

  function renderSlowest(rows) {
    const body = document.querySelector("#slowest tbody");
    body.replaceChildren(...rows.map((r) => {
      const tr = document.createElement("tr");
      tr.dataset.requestId = r.request_id;
      // An answer handed back mid-stream went on from what its customer had read: say how much of it came before.
      const tokens = `${fmtNumber(r.prompt_tokens)} / ${fmtNumber(r.completion_tokens)}` +
        (r.continued_tokens ? ` (${fmtNumber(r.continued_tokens)} before a hand-back)` : "");
      tr.append(cell("td", fmtTime(r.finished_at)), cell("td", r.request_id.slice(0, 12), "mono"),
                cell("td", r.source), cell("td", REASON_LABELS[r.finish_reason] || r.finish_reason || "–"),
                cell("td", fmtSeconds(r.queue_wait)), cell("td", fmtSeconds(r.ttft)),
                cell("td", fmtSeconds(r.tpot)), cell("td", fmtSeconds(r.e2e), "strong"), cell("td", tokens));
      tr.firstChild.title = r.request_id;
      return tr;
    }));
    document.getElementById("slowest-empty").hidden = rows.length > 0;
  }

  function renderErrors(errors) {
    const list = document.getElementById("recent-errors");
    list.replaceChildren(...errors.map((e) => {
      const li = document.createElement("li");
      li.className = "errors__item";
      const meta = cell("p", `${fmtTime(e.finished_at)} · ${e.source} · ${e.request_id.slice(0, 12)}`, "errors__meta");
      li.append(meta, cell("p", e.error || "(no message)", "errors__text"));
      return li;
    }));
    document.getElementById("errors-empty").hidden = errors.length > 0;
  }

  function renderKeys(keys) {
    const body = document.querySelector("#api-keys tbody");
    const rows = keys || [];
    body.replaceChildren(...rows.map((k) => {
      const tr = document.createElement("tr");
      tr.dataset.key = k.name;
      tr.dataset.revoked = String(Boolean(k.revoked));
      tr.dataset.deleted = String(k.deleted);
      const label = k.deleted ? `${k.name} (deleted)` : k.revoked ? `${k.name} (revoked)` : k.name;
      tr.append(cell("td", label), cell("td", k.prefix || "–", "mono"), cell("td", fmtNumber(k.requests)),
                cell("td", fmtNumber(k.prompt_tokens)), cell("td", fmtNumber(k.completion_tokens)));
      return tr;
    }));
    // null while catching up: the table empties and says nothing rather than something partial
    document.getElementById("api-keys-empty").hidden = keys === null || rows.length > 0;
  }

  function renderClasses(classes, live) {
    for (const [name, c] of Object.entries(classes || {})) {
      const row = document.querySelector(`#class-table tr[data-class="${name}"]`);
      if (!row) continue;
      const field = (f) => row.querySelector(`[data-f="${f}"]`);
      field("objective").textContent = `≤ ${fmtSeconds(c.objective_s)}`;
      field("attainment").textContent = c.attainment === null ? "–" : fmtPercent(c.attainment);
      row.dataset.tone = c.attainment === null ? "" : c.attainment >= 0.99 ? "good" : c.attainment < 0.9 ? "bad" : "";
      field("p50").textContent = fmtSeconds(c.ttft.p50);
      field("p99").textContent = fmtSeconds(c.ttft.p99);
      field("count").textContent = fmtNumber(c.count);
      const queued = live && live.queue_depths ? live.queue_depths[name] : null;
      field("queued").textContent = queued === null || queued === undefined ? "–" : fmtNumber(queued);
    }
  }

  function render(data) {
    renderLive(data.live);
    renderTotals(data);
    renderLatency(data.latency);
    renderSeries(data);
    renderReasons(data.totals.finish_reasons);
    renderSlowest(data.slowest);
    renderErrors(data.recent_errors);
    renderKeys(data.api_keys);
    renderClasses(data.classes, data.live);
    root.dataset.generatedAt = String(data.generated_at);
  }

  function setStatus(state, label) {
    document.getElementById("status").dataset.state = state;
    setText("status-label", label);
  }

  // ---- polling ------------------------------------------------------------------------------

  async function refresh() {
    clearTimeout(timer);
    const mine = ++latest;
    try {
      const response = await fetch(`${dataUrl}?window=${encodeURIComponent(windowKey)}`,
                                   {credentials: "same-origin", headers: {Accept: "application/json"}});
      if (response.status === 401) {
        window.location.assign(`${loginUrl}?next=${encodeURIComponent(location.pathname + location.search)}`);
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      if (mine === latest) {
        render(data);
        const sums = data.summaries;
        if (sums.catching_up) {
          setStatus("catching-up", `Catching up: ${fmtNumber(sums.pending_minutes)} minutes of this window still ` +
                    `being summarised (oldest ${fmtTime(sums.oldest_pending)}); their figures show when ready`);
        } else if (sums.stale) {
          setStatus("catching-up", sums.updated_at === null ? "Summaries not made yet: is housekeeping running?"
            : `Summaries last updated ${fmtTime(sums.updated_at)}: is housekeeping running?`);
        } else {
          setStatus("live", `Live · updated ${new Date().toLocaleTimeString()}`);
        }
      }
    } catch (err) {
      if (mine === latest) setStatus("error", `Cannot reach the server (${err.message}); retrying`);
    } finally {
      if (mine === latest) timer = setTimeout(refresh, pollMs);
    }
  }

  function chooseWindow(key) {
    windowKey = key;
    root.dataset.window = key;
    for (const btn of root.querySelectorAll(".segmented__btn")) {
      btn.setAttribute("aria-pressed", String(btn.dataset.window === key));
    }
    const url = new URL(window.location.href);
    url.searchParams.set("window", key);
    history.replaceState(null, "", url);
    refresh();
  }

  for (const btn of root.querySelectorAll(".segmented__btn")) {
    btn.addEventListener("click", () => chooseWindow(btn.dataset.window));
  }
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") refresh();
  });

  buildCharts();
  refresh();
})();
