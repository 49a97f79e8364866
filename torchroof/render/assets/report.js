// torchroof's interactive report (torchroof/render/html.py writes the page around it).
//
// The page holds every estimate's kernels (W, Q, the ceiling each is timed against,
// Python's time and schedule) and every shipped accelerator. Switching the accelerator or
// moving an efficiency slider re-prices every kernel with the rules of
// torchroof.timing.roofline.time_kernel (pure roofline), torchroof.pricing.collectives.time_collective and
// torchroof.timing.streams.schedule, written here in the same floating-point order so that the
// totals are Python's to the last digit (tests/test_html_browser.py checks them).
(function () {
  "use strict";

  const DATA = JSON.parse(document.getElementById("torchroof-data").textContent);
  const PHASES = ["forward", "backward", "recompute", "optimizer"];
  const CATEGORIES = [
    ["weights", "weights"],
    ["activations", "activations"],
    ["kv_cache", "KV cache"],
    ["gradients", "gradients"],
    ["optimizer_state", "optimizer state"],
    ["network", "network (sent)"],
  ];
  const COLOURS = {
    forward: "#4c78a8", backward: "#f58518", recompute: "#54a24b", optimizer: "#b279a2",
    communication: "#e45756", compute: "#4c78a8", memory: "#f58518", network: "#e45756",
    weights: "#4c78a8", activations: "#72b7b2", kv_cache: "#f58518", gradients: "#54a24b",
    optimizer_state: "#b279a2", "network (sent)": "#e45756",
  };
  const ON_CHIP = ["l2", "smem", "registers"]; // torchroof.timing.hierarchy's levels inside the chip
  const PLOT_CONFIG = { displaylogo: false, responsive: true };
  const state = { accelerator: "", computeEfficiency: null, bandwidthEfficiency: null, view: 0 };
  const expanded = new Set();

  // ---- formatting (torchroof.render.units: ms, GB, GFLOP) ----------------------------------
  const ms = (s) => (s * 1e3).toFixed(3);
  const us = (s) => (s * 1e6).toFixed(2);
  const gb = (b) => (b / 1e9).toFixed(3);
  const gib = (b) => (b / 2 ** 30).toFixed(2); // capacities, as vendors quote them (80 GB = 80 GiB)
  const gflop = (w) => (w / 1e9).toFixed(2);
  const pct = (x) => (100 * x).toFixed(1);
  const thousands = (x) => x.toLocaleString("en-US", { maximumFractionDigits: 1, minimumFractionDigits: 1 });
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
  }
  const accelerator = (name) => DATA.accelerators.find((a) => a.name === name);

  // ---- pricing ---------------------------------------------------------------------------
  // The accelerator an estimate is priced on in the current state (null: Python's numbers).
  function pricedOn(est) {
    const ce = state.computeEfficiency ?? est.compute_efficiency;
    const be = state.bandwidthEfficiency ?? est.bandwidth_efficiency;
    const name = state.accelerator || est.hardware;
    const moved = ce !== est.compute_efficiency || be !== est.bandwidth_efficiency;
    if (!state.accelerator && !moved) return { acc: null, ce, be };
    return { acc: accelerator(name) || null, ce, be, name };
  }

  // Why ``est`` cannot be priced on ``acc`` ('' when it can).
  function refusal(est, acc, name) {
    if (est.why_not_repriced) return est.why_not_repriced;
    if (!acc) return `${name} is not among the page's accelerators`;
    const own = acc.name === est.hardware;
    if (own && (acc.hbm_bytes_per_s !== est.hbm_bytes_per_s || acc.peaks[est.reference_key] !== est.reference_peak_flops_per_s)) {
      return `this estimate's ${name} has other figures than the shipped file of that name (a file of its own): re-price it in Python`;
    }
    for (const key of est.keys) {
      if (acc.peaks[key] === null) return acc.unsupported[key];
    }
    return "";
  }

  // torchroof.timing.roofline.time_kernel in the pure mode: peak = hardware.peak(unit, dtype) *
  // compute_efficiency; bandwidth = beta * bandwidth_efficiency; compute_s = W / peak (0
  // without FLOPs); memory_s = Q / bandwidth; time = max (or the sum without overlap) +
  // launch overhead; bound "compute" when compute_s > memory_s, else "memory". A
  // collective over a link (torchroof.pricing.collectives.time_collective): max(memory_s, network_s),
  // no launch, bound "network" when the link is the slower pipe.
  function reprice(est, acc, ce, be) {
    const k = est.kernels;
    const n = k.flops.length;
    const time = new Array(n);
    const bound = new Array(n);
    const bandwidth = acc.hbm_bytes_per_s * be;
    const peaks = est.keys.map((key) => acc.peaks[key] * ce);
    for (let i = 0; i < n; i++) {
      const peak = k.peak[i] >= 0 ? peaks[k.peak[i]] : Infinity; // no pipe: no FLOP ceiling
      const compute = k.flops[i] ? k.flops[i] / peak : 0;
      const memory = k.bytes[i] / bandwidth;
      if (k.unit[i] === "network" && k.link[i] && k.link[i] !== "none") {
        time[i] = Math.max(memory, k.network_s[i]);
        bound[i] = k.network_s[i] >= memory ? "network" : "memory";
      } else {
        const body = est.overlap ? Math.max(compute, memory) : compute + memory;
        time[i] = body + est.launch_overhead_s;
        bound[i] = compute > memory ? "compute" : "memory";
      }
    }
    return { time, bound, ...lay(est, time) };
  }

  // torchroof.timing.streams.schedule over the waits each kernel keeps (schedule.waits); a step
  // without collectives runs its kernels back to back.
  function lay(est, time) {
    const k = est.kernels;
    const n = time.length;
    const start = new Array(n);
    const end = new Array(n);
    const exposed = new Array(n).fill(0);
    const communication = (i) => k.stream[i] === "communication";
    if (!est.scheduled || !est.overlap_communication) {
      let clock = 0;
      for (let i = 0; i < n; i++) {
        start[i] = clock;
        clock += time[i];
        end[i] = clock;
        if (est.scheduled && communication(i)) exposed[i] = time[i];
      }
      return { start, exposed, step: clock };
    }
    let computeFree = 0;
    const laneFree = new Map(); // each communication stream's last end (k.lane: the link's)
    const lane = (i) => (k.lane ? k.lane[i] : "");
    const idle = [];
    const runs = [];
    for (let i = 0; i < n; i++) {
      let ready = 0;
      for (const j of k.waits_on[i]) ready = Math.max(ready, end[j]);
      if (communication(i)) {
        start[i] = Math.max(laneFree.get(lane(i)) || 0, ready);
        end[i] = start[i] + time[i];
        laneFree.set(lane(i), end[i]);
        runs.push(i);
      } else {
        start[i] = Math.max(computeFree, ready);
        if (start[i] > computeFree) idle.push([computeFree, start[i]]);
        end[i] = computeFree = start[i] + time[i];
      }
    }
    let communicationFree = 0;
    for (const free of laneFree.values()) communicationFree = Math.max(communicationFree, free);
    if (communicationFree > computeFree) idle.push([computeFree, communicationFree]);
    charge(idle, runs, start, end, time, exposed);
    return { start, exposed, step: Math.max(computeFree, communicationFree) };
  }

  // torchroof.timing.streams._charge: each idle interval to the runs in it, a run alone charged
  // its overlap, several at once an equal share of each instant.
  function charge(idle, runs, start, end, time, exposed) {
    const order = runs.slice().sort((x, y) => start[x] - start[y] || x - y);
    let following = 0;
    let live = [];
    for (const [a, b] of idle) {
      while (following < order.length && start[order[following]] < b) live.push(order[following++]);
      live = live.filter((i) => end[i] > a);
      const inside = live.filter((i) => start[i] < b);
      let apart = true;
      for (let j = 1; j < inside.length; j++) if (end[inside[j - 1]] > start[inside[j]]) apart = false;
      if (apart) {
        for (const i of inside) {
          if (a <= start[i] && end[i] <= b) exposed[i] += time[i];
          else exposed[i] += Math.max(0, Math.min(end[i], b) - Math.max(start[i], a));
        }
        continue;
      }
      const cuts = new Set([a, b]);
      for (const i of inside) for (const t of [start[i], end[i]]) if (a < t && t < b) cuts.add(t);
      const sorted = [...cuts].sort((x, y) => x - y);
      for (let j = 0; j + 1 < sorted.length; j++) {
        const [lo, hi] = [sorted[j], sorted[j + 1]];
        const running = inside.filter((i) => start[i] <= lo && hi <= end[i]);
        for (const i of running) exposed[i] += (hi - lo) / running.length;
      }
    }
  }

  // The estimate as Python priced it.
  function asEstimated(est) {
    const k = est.kernels;
    const start = [];
    let clock = 0;
    for (let i = 0; i < k.time_s.length; i++) {
      start.push(k.start_s[i] ?? clock);
      clock += k.time_s[i];
    }
    return { time: k.time_s, bound: k.bound, start, step: est.time_s, exposed: k.exposed_s };
  }

  // Every figure the page shows for ``est`` in the current state.
  function figures(est) {
    const on = pricedOn(est);
    let priced;
    let note = "";
    let acc = on.acc;
    if (on.acc === null && !on.name) {
      priced = asEstimated(est);
    } else {
      note = refusal(est, on.acc, on.name);
      if (note) {
        priced = asEstimated(est);
        acc = null;
      } else {
        priced = reprice(est, on.acc, on.ce, on.be);
      }
    }
    const referencePeak = acc ? acc.peaks[est.reference_key] : est.reference_peak_flops_per_s;
    const hbm = acc ? acc.hbm_bytes_per_s : est.hbm_bytes_per_s;
    const capacity = acc ? acc.capacity_bytes : est.capacity_bytes;
    const step = priced.step;
    let memoryBound = 0;
    let exposed = 0;
    let communication = 0;
    let kernelSum = 0; // the kernels back to back: the layer table's shares are of this
    const byPhase = {};
    for (let i = 0; i < priced.time.length; i++) {
      const phase = est.kernels.phase[i];
      kernelSum += priced.time[i];
      // torchroof.render.summary_parts.compute_stream_s: with collectives on their own stream, a phase is its
      // time on the compute stream (a collective counts the part the compute stream waited on)
      const onCommunication = est.communicates && est.kernels.stream[i] === "communication";
      byPhase[phase] = (byPhase[phase] || 0) + (onCommunication ? priced.exposed[i] : priced.time[i]);
      if (priced.bound[i] === "memory") memoryBound += priced.time[i];
      if (onCommunication) {
        communication += priced.time[i];
        exposed += priced.exposed[i];
      }
    }
    const ridge = referencePeak / hbm;
    // analysis.tokens_per_s and its per-GPU split: the pp·tp·cp GPUs of a replica share its
    // tokens; a pipelined step's memory-bound share is of its kernels' (one micro-batch each)
    const tokensPerS = step && est.tokens ? est.tokens / step : 0;
    const boundOf = est.pipelined ? kernelSum : step;
    return {
      ...priced,
      note,
      display: acc ? acc.display : est.hardware_display,
      repriced: acc !== null,
      hbm,
      referencePeak,
      byPhase,
      mfu: step ? est.flops / (step * referencePeak) : 0,
      tokensPerS,
      tokensPerGpu: tokensPerS / est.shared,
      kernelSum,
      memoryBoundShare: boundOf ? memoryBound / boundOf : 0,
      exposedCommunication: exposed,
      hiddenCommunication: communication - exposed,
      capacity,
      fits: est.memory_bytes === null || capacity === null ? null : est.memory_bytes <= capacity,
      ridgeBatch: est.weight_intensity ? (est.batch * ridge) / est.weight_intensity : null,
    };
  }

  // ---- page skeleton ---------------------------------------------------------------------
  function controls() {
    const select = el("select", { id: "accelerator" });
    const own = DATA.estimates.length === 1 ? ` (${DATA.estimates[0].hardware_display})` : "";
    select.append(el("option", { value: "", text: `as estimated${own}` }));
    for (const acc of DATA.accelerators) {
      select.append(el("option", { value: acc.name, text: `${acc.display} (${acc.name})` }));
    }
    select.addEventListener("change", () => {
      state.accelerator = select.value;
      render();
    });
    const first = DATA.estimates[0];
    const slider = (id, label, value, key) => {
      const input = el("input", { type: "range", id, min: "0.05", max: "1", step: "0.01", value: String(value) });
      const shown = el("span", { class: "slider-value", id: `${id}-value`, text: `${Math.round(value * 100)}%` });
      input.addEventListener("input", () => {
        state[key] = Number(input.value);
        shown.textContent = `${Math.round(state[key] * 100)}%`;
        render();
      });
      return el("label", { class: "control" }, `${label} `, input, shown);
    };
    return el(
      "div",
      { class: "controls" },
      el("label", { class: "control" }, "accelerator ", select),
      slider("compute-efficiency", "compute efficiency (share of π)", first.compute_efficiency, "computeEfficiency"),
      slider("bandwidth-efficiency", "bandwidth efficiency (share of β)", first.bandwidth_efficiency, "bandwidthEfficiency"),
    );
  }

  // ---- a grid: a slider per axis picks the point shown ------------------------------------
  function gridControls() {
    const box = el("div", { class: "controls", id: "grid-sliders" });
    DATA.grid.axes.forEach((axis, a) => {
      const at = DATA.grid.points[state.view][a];
      const input = el("input", { type: "range", id: `grid-axis-${a}`, min: "0", max: String(axis.values.length - 1), step: "1", value: String(at) });
      const shown = el("span", { class: "slider-value", id: `grid-axis-${a}-value`, text: axis.values[at] });
      input.addEventListener("input", () => {
        shown.textContent = axis.values[Number(input.value)];
        const wanted = DATA.grid.axes.map((_, b) => Number(document.getElementById(`grid-axis-${b}`).value));
        const found = DATA.grid.points.findIndex((p) => p.every((v, b) => v === wanted[b]));
        if (found < 0) return; // every combination is a point: not reached
        state.view = found;
        expanded.clear();
        const pick = document.getElementById("variant");
        if (pick) pick.value = String(found);
        render();
      });
      box.append(el("label", { class: "control" }, `${axis.key} `, input, shown));
    });
    return box;
  }

  function syncGridSliders() {
    DATA.grid.points[state.view].forEach((at, a) => {
      document.getElementById(`grid-axis-${a}`).value = String(at);
      document.getElementById(`grid-axis-${a}-value`).textContent = DATA.grid.axes[a].values[at];
    });
  }

  // Step time over the first two axes (any further axis at the shown point's value), as
  // re-priced in the page; the shown point ringed. One axis: a line.
  function renderGrid(all) {
    const axes = DATA.grid.axes;
    const at = DATA.grid.points[state.view];
    const layout = { height: 440, margin: { l: 90, r: 20, t: 40, b: 60 }, showlegend: false };
    if (axes.length === 1) {
      Plotly.react("grid-chart", [
        { type: "scatter", mode: "lines+markers", x: axes[0].values, y: all.map((f) => f.step * 1e3), name: "step time (ms)" },
        { type: "scatter", mode: "markers", x: [axes[0].values[at[0]]], y: [all[state.view].step * 1e3], marker: { symbol: "circle-open", size: 18, color: "#d62728", line: { width: 3 } }, hoverinfo: "skip" },
      ], { ...layout, title: { text: `step time (ms) over ${axes[0].key}`, x: 0.01, xanchor: "left" }, xaxis: { title: { text: axes[0].key }, type: "category" }, yaxis: { title: { text: "ms" } } }, PLOT_CONFIG);
      return;
    }
    const z = axes[0].values.map(() => axes[1].values.map(() => null));
    const fit = axes[0].values.map(() => axes[1].values.map(() => ""));
    const over = { x: [], y: [] }; // points whose step does not fit the accelerator's memory
    DATA.grid.points.forEach((p, i) => {
      if (!p.slice(2).every((v, b) => v === at[b + 2])) return;
      z[p[0]][p[1]] = all[i].step * 1e3;
      if (all[i].fits === false) {
        fit[p[0]][p[1]] = " (does NOT fit)";
        over.x.push(axes[1].values[p[1]]);
        over.y.push(axes[0].values[p[0]]);
      }
    });
    const rest = axes.slice(2).map((axis, b) => `${axis.key}=${axis.values[at[b + 2]]}`).join(", ");
    Plotly.react("grid-chart", [
      { type: "heatmap", x: axes[1].values, y: axes[0].values, z, text: fit, colorscale: "Viridis", colorbar: { title: { text: "ms" } }, hovertemplate: `${axes[0].key}=%{y}, ${axes[1].key}=%{x}: %{z:.3f} ms%{text}<extra></extra>` },
      { type: "scatter", mode: "markers", x: over.x, y: over.y, marker: { symbol: "x", size: 12, color: "#ffffff" }, hoverinfo: "skip" },
      { type: "scatter", mode: "markers", x: [axes[1].values[at[1]]], y: [axes[0].values[at[0]]], marker: { symbol: "circle-open", size: 18, color: "#d62728", line: { width: 3 } }, hoverinfo: "skip" },
    ], {
      ...layout, title: { text: `step time (ms)${rest ? ` at ${rest}` : ""}${over.x.length ? "; × does not fit" : ""}`, x: 0.01, xanchor: "left" },
      xaxis: { title: { text: axes[1].key }, type: "category" }, yaxis: { title: { text: axes[0].key }, type: "category" },
    }, PLOT_CONFIG);
  }

  function section(id, title, ...children) {
    return el("section", { id }, el("h2", { text: title }), ...children);
  }

  function build() {
    const app = document.getElementById("app");
    app.append(el("h1", { text: DATA.title }));
    app.append(
      el("p", { class: "lede", text: "T = max(W/π, Q/β) per kernel: the roofline model (Williams, Waterman and Patterson, 2009). Switch the accelerator or move a slider: every kernel is re-priced from its W and Q in this page, with torchroof's rule." }),
    );
    app.append(controls());
    app.append(el("p", { id: "pricing-note", class: "note" }));
    if (DATA.kind === "comparison") {
      app.append(section("side-by-side", "Variants side by side", el("div", { id: "variants-table" }), el("div", { id: "compare-chart", class: "chart" })));
    }
    if (DATA.kind === "sweep") {
      app.append(section("sweep", `Sweep over ${DATA.sweep.key}`, el("div", { id: "sweep-chart", class: "chart" }), el("div", { id: "sweep-traffic-chart", class: "chart" }), el("div", { id: "variants-table" })));
    }
    if (DATA.kind === "grid") {
      app.append(section("grid", `Grid over ${DATA.grid.axes.map((a) => a.key).join(" x ")}`, gridControls(), el("div", { id: "grid-chart", class: "chart" }), el("div", { id: "variants-table" })));
    }
    if (DATA.estimates.length > 1) {
      const pick = el("select", { id: "variant" });
      DATA.estimates.forEach((est, i) => pick.append(el("option", { value: String(i), text: est.label })));
      pick.addEventListener("change", () => {
        state.view = Number(pick.value);
        expanded.clear();
        if (DATA.kind === "grid") syncGridSliders();
        render();
      });
      app.append(el("div", { class: "controls" }, el("label", { class: "control" }, "details of ", pick)));
    }
    app.append(section("summary", "Summary", el("div", { id: "summary-figures", class: "figures" })));
    app.append(
      section(
        "layers",
        "Per-layer budget",
        el("div", { class: "pair" }, el("div", { id: "layers-chart", class: "chart" }), el("div", { id: "traffic-chart", class: "chart" })),
        el("p", { class: "note", text: "Click a row to list its kernels (a collapsed run of identical blocks lists its first block's)." }),
        el("table", { id: "layer-table" }),
      ),
    );
    app.append(section("roofline", "Roofline: every kernel with FLOPs", el("div", { id: "roofline-chart", class: "chart tall" }), el("p", { id: "roofline-note", class: "note" })));
    app.append(section("timeline", "Predicted kernel timeline", el("div", { id: "timeline-chart", class: "chart" })));
    app.append(
      section(
        "assumptions",
        "Assumptions and coverage",
        el("p", { id: "coverage" }),
        el("ul", { id: "assumption-list" }),
        el("details", {}, el("summary", { text: "the text summary, as estimated" }), el("pre", { id: "text-summary" })),
      ),
    );
  }

  // ---- views -----------------------------------------------------------------------------
  function renderSummary(est, f) {
    const box = document.getElementById("summary-figures");
    box.replaceChildren();
    const add = (label, value, id) => box.append(el("div", { class: "figure" }, el("div", { class: "label", text: label }), el("div", { class: "value", id: id || "", text: value })));
    add("accelerator", f.display + (est.cluster ? ` in ${est.cluster}` : ""), "summary-accelerator");
    add("step time", `${ms(f.step)} ms`, "step-time");
    const expected = est.expected;
    if (expected.none) add("expected", `no range: ${expected.none}`, "expected-range");
    else add(`expected (${expected.of})`, `${ms(f.step * expected.low)}–${ms(f.step * expected.high)} ms`, "expected-range");
    const phases = PHASES.filter((p) => f.byPhase[p] > 0);
    let byPhase = est.pipelined ? "the kernels listed (one micro-batch each), by phase" : "by phase";
    if (est.communicates) byPhase += ", on the compute stream";
    if (phases.length > 1) add(byPhase, phases.map((p) => `${p} ${ms(f.byPhase[p])} ms`).join(", "));
    if (est.communicates) add("communication", `${ms(f.exposedCommunication)} ms exposed, ${ms(f.hiddenCommunication)} ms hidden`, "communication");
    if (f.tokensPerS && est.gpus > 1) {
      const replica = est.shared > 1 && est.shared < est.gpus ? `, ${thousands(f.tokensPerS)} per replica of ${est.shared} GPUs` : "";
      add("throughput", `${thousands(f.tokensPerGpu)} tokens/s per GPU${replica}, ${thousands(f.tokensPerGpu * est.gpus)} over the ${est.gpus} GPUs`, "tokens-per-s");
    } else if (f.tokensPerS) add("throughput", `${thousands(f.tokensPerS)} tokens/s`, "tokens-per-s");
    add("MFU", `${pct(f.mfu)}%`, "mfu");
    add("time memory-bound", `${(100 * f.memoryBoundShare).toFixed(0)}%`);
    if (est.memory_bytes !== null && f.capacity !== null) {
      const verdict = f.fits ? "fits" : `does NOT fit: ${gib(est.memory_bytes - f.capacity)} GiB missing`;
      add("memory", `${gib(est.memory_bytes)} GiB of ${gib(f.capacity)} GiB: ${verdict}`, "memory-fit");
    }
    if (est.batching && f.ridgeBatch) add("B* (weight GEMMs reach the ridge)", f.ridgeBatch.toFixed(0));
    if (est.batching && est.kv_crossover_batch) add("KV reads overtake weight reads at batch", est.kv_crossover_batch.toFixed(0));
    const note = document.getElementById("pricing-note");
    const links = est.cluster ? ` with ${est.cluster}'s links (collectives keep their network time)` : "";
    note.textContent = f.note ? `Shown as estimated: ${f.note}.` : f.repriced ? `Re-priced in this page on ${f.display}${links}.` : `As torchroof estimated it (${est.mode} mode).`;
    note.className = f.note ? "note warning" : "note";
  }

  // A row's totals and the pipe holding most of its time (report.LayerRow.bound).
  function rowFigures(est, row, f) {
    const phase = {};
    let time = 0;
    let flops = 0;
    let bytes = 0;
    let memory = 0;
    let network = 0;
    for (const i of row.kernels) {
      time += f.time[i];
      flops += est.kernels.flops[i];
      bytes += est.kernels.bytes[i];
      phase[est.kernels.phase[i]] = (phase[est.kernels.phase[i]] || 0) + f.time[i];
      if (est.kernels.stream[i] === "communication") network += f.time[i];
      else if (f.bound[i] === "memory") memory += f.time[i];
    }
    let bound;
    if (!network) bound = memory * 2 >= time ? "memory" : "compute";
    else {
      const compute = time - memory - network;
      bound = memory >= Math.max(network, compute) ? "memory" : network >= compute ? "network" : "compute";
    }
    return { phase, time, flops, bytes, bound };
  }

  function renderLayers(est, f) {
    const rows = est.rows.map((row) => ({ row, ...rowFigures(est, row, f) }));
    const names = rows.map((r) => r.row.label || r.row.name).reverse();
    const phaseTraces = PHASES.filter((p) => rows.some((r) => r.phase[p])).map((p) => ({
      type: "bar", orientation: "h", name: p, y: names, marker: { color: COLOURS[p] },
      x: rows.map((r) => (r.phase[p] || 0) * 1e3).reverse(),
      hovertemplate: `%{y}<br>${p}: %{x:.3f} ms<extra></extra>`,
    }));
    const height = Math.max(260, 22 * rows.length + 120);
    Plotly.react("layers-chart", phaseTraces, {
      title: { text: "time by phase (ms)", x: 0.01, xanchor: "left" }, barmode: "stack", height, margin: { l: 220, r: 10, t: 40, b: 40 },
      xaxis: { title: { text: "ms" } }, legend: { orientation: "h" },
    }, PLOT_CONFIG);
    const categories = CATEGORIES.filter(([key]) => rows.some((r) => r.row.traffic[key]));
    const trafficTraces = categories.map(([key, label]) => ({
      type: "bar", orientation: "h", name: label, y: names, marker: { color: COLOURS[key] },
      x: rows.map((r) => (r.row.traffic[key] || 0) / 1e9).reverse(),
      hovertemplate: `%{y}<br>${label}: %{x:.3f} GB<extra></extra>`,
    }));
    Plotly.react("traffic-chart", trafficTraces, {
      title: { text: "bytes by traffic kind (GB): HBM, and sent over links", x: 0.01, xanchor: "left" }, barmode: "stack", height, margin: { l: 220, r: 10, t: 40, b: 40 },
      xaxis: { title: { text: "GB" } }, legend: { orientation: "h" },
    }, PLOT_CONFIG);
    const table = document.getElementById("layer-table");
    table.replaceChildren();
    table.append(el("tr", {}, ...["layer", "kernels", "GFLOP", "GB", "time (ms)", "share", "bound", "MFU"].map((h) => el("th", { text: h }))));
    rows.forEach((r, position) => {
      const open = expanded.has(position);
      const tr = el("tr", { class: `layer-row${open ? " open" : ""}`, "data-row": String(position) },
        el("td", { text: `${open ? "▾" : "▸"} ${r.row.label || r.row.name}` }),
        el("td", { text: String(r.row.kernels.length) }),
        el("td", { text: gflop(r.flops) }),
        el("td", { text: gb(r.bytes) }),
        el("td", { class: "row-time", text: ms(r.time) }),
        el("td", { text: `${f.kernelSum ? pct(r.time / f.kernelSum) : "0.0"}%` }),
        el("td", { text: r.bound }),
        el("td", { text: `${r.time ? pct(r.flops / (r.time * f.referencePeak)) : "0.0"}%` }),
      );
      tr.addEventListener("click", () => {
        if (expanded.has(position)) expanded.delete(position);
        else expanded.add(position);
        renderLayers(est, f);
      });
      table.append(tr);
      if (!open) return;
      const header = el("tr", { class: "kernel-row kernel-header" }, ...["#", "kernel (member ops)", "phase", "GFLOP", "MB", "FLOP/B", "time (µs)", "bound"].map((h) => el("th", { text: h })));
      table.append(header);
      if (r.row.blocks > 1) table.append(el("tr", { class: "kernel-row" }, el("td", { colspan: "8", class: "note", text: `first of ${r.row.blocks} identical blocks` })));
      for (const i of r.row.first) {
        const k = est.kernels;
        const intensity = k.bytes[i] ? (k.flops[i] / k.bytes[i]).toFixed(2) : "inf";
        table.append(el("tr", { class: "kernel-row" },
          el("td", { text: String(i) }),
          el("td", { text: k.ops[i] ? `${k.name[i]} (${k.ops[i]})` : k.name[i], title: k.module[i] }),
          el("td", { text: k.phase[i] }),
          el("td", { text: gflop(k.flops[i]) }),
          el("td", { text: (k.bytes[i] / 1e6).toFixed(3) }),
          el("td", { text: intensity }),
          el("td", { text: us(f.time[i]) }),
          el("td", { text: f.bound[i] }),
        ));
      }
    });
  }

  function pointLabel(est, f, i) {
    const boundary = est.kernels.boundary[i];
    // the hierarchical verdict was Python's, on the estimate's own accelerator
    if (!f.repriced && ON_CHIP.includes(boundary)) return `${f.bound[i]} (at ${boundary} on chip)`;
    if (!f.repriced && boundary === "latency") return `${f.bound[i]} (latency-bound)`;
    return f.bound[i];
  }

  function renderRoofline(est, f) {
    const k = est.kernels;
    const groups = {};
    let skipped = 0;
    let skippedTime = 0;
    let lo = Infinity;
    let hi = 0;
    for (let i = 0; i < k.flops.length; i++) {
      if (!k.flops[i] || !k.bytes[i] || !f.time[i]) {
        skipped += 1;
        skippedTime += f.time[i];
        continue;
      }
      const label = pointLabel(est, f, i);
      const g = groups[label] || (groups[label] = { x: [], y: [], text: [], size: [] });
      const intensity = k.flops[i] / k.bytes[i];
      lo = Math.min(lo, intensity);
      hi = Math.max(hi, intensity);
      g.x.push(intensity);
      g.y.push(k.flops[i] / f.time[i] / 1e12);
      g.size.push(Math.max(5, Math.min(18, 4 + Math.sqrt((f.time[i] / f.step) * 4000))));
      g.text.push(`${k.name[i]}${k.ops[i] ? ` (${k.ops[i]})` : ""}<br>module: ${k.module[i] || "(outside any module)"}<br>W ${gflop(k.flops[i])} GFLOP, Q ${(k.bytes[i] / 1e6).toFixed(3)} MB<br>time ${us(f.time[i])} µs, ${f.bound[i]}-bound${k.tile[i] ? `, tile ${k.tile[i]}` : ""}`);
    }
    const traces = Object.entries(groups).map(([label, g]) => ({
      type: "scatter", mode: "markers", name: label, x: g.x, y: g.y, text: g.text,
      marker: { size: g.size, color: COLOURS[label.split(" ")[0]], opacity: 0.75, symbol: label.includes("latency") ? "diamond" : "circle", line: { width: label.includes("on chip") ? 1.5 : 0, color: "#222" } },
      hovertemplate: "%{text}<br>I %{x:.2f} FLOP/B, %{y:.1f} TFLOP/s<extra></extra>",
    }));
    if (Number.isFinite(lo)) {
      const acc = f.repriced ? accelerator(pricedOn(est).name) : accelerator(est.hardware);
      const bandwidth = f.hbm * (f.repriced ? pricedOn(est).be : est.bandwidth_efficiency);
      const xs = [];
      for (let e = Math.floor(Math.log10(lo)) - 1; e <= Math.ceil(Math.log10(hi)) + 1; e += 0.05) xs.push(10 ** e);
      const roofs = new Map(); // one roof per distinct ceiling, named by the pipes at it
      for (const p of new Set(k.peak.filter((p) => p >= 0))) {
        const key = est.keys[p];
        const peak = acc ? acc.peaks[key] : null;
        if (!peak) continue;
        const pi = peak * (f.repriced ? pricedOn(est).ce : est.compute_efficiency);
        roofs.set(pi, [...(roofs.get(pi) || []), key.replace("|", " ").replace("|tf32", " (tf32)")]);
      }
      for (const [pi, names] of roofs) {
        traces.push({
          type: "scatter", mode: "lines", name: `roof: ${names.join(", ")}`, x: xs,
          y: xs.map((x) => Math.min(pi, bandwidth * x) / 1e12), line: { width: 1.5, dash: "dot" }, hoverinfo: "name",
        });
      }
    }
    Plotly.react("roofline-chart", traces, {
      height: 520, margin: { l: 70, r: 10, t: 20, b: 50 },
      xaxis: { type: "log", title: { text: "arithmetic intensity I = W/Q (FLOP/B)" } },
      yaxis: { type: "log", title: { text: "attained W/T (TFLOP/s)" } },
      legend: { orientation: "h", y: -0.2 },
    }, PLOT_CONFIG);
    document.getElementById("roofline-note").textContent =
      `Every kernel with FLOPs and bytes is a point, sized by its share of the step; ${skipped} kernels without FLOPs (copies, collectives) are not plotted (${ms(skippedTime)} ms). ` +
      (f.repriced ? "Re-priced points are coloured by their HBM-boundary bound." : "A ringed point is bound on chip (the hierarchical verdict on the estimate's own accelerator).");
  }

  function renderTimeline(est, f) {
    const k = est.kernels;
    const tracks = {};
    for (let i = 0; i < f.time.length; i++) {
      const track = k.stream[i] === "communication" ? "communication" : k.phase[i];
      const t = tracks[track] || (tracks[track] = { base: [], x: [], text: [] });
      t.base.push(f.start[i] * 1e3);
      t.x.push(f.time[i] * 1e3);
      t.text.push(`#${i} ${k.name[i]}<br>${k.module[i] || "(outside any module)"}<br>${us(f.time[i])} µs, ${f.bound[i]}`);
    }
    const order = [...PHASES, "communication"].filter((t) => tracks[t]);
    const traces = order.map((track) => ({
      type: "bar", orientation: "h", name: track, y: tracks[track].x.map(() => track), base: tracks[track].base,
      x: tracks[track].x, text: tracks[track].text, textposition: "none", marker: { color: COLOURS[track] },
      hovertemplate: "%{text}<extra></extra>",
    }));
    Plotly.react("timeline-chart", traces, {
      height: 120 + 50 * order.length, barmode: "overlay", margin: { l: 110, r: 10, t: 20, b: 40 },
      xaxis: { title: { text: "ms from the step's start" } }, yaxis: { categoryorder: "array", categoryarray: order.slice().reverse() },
      showlegend: false,
    }, PLOT_CONFIG);
  }

  function renderAssumptions(est) {
    document.getElementById("coverage").textContent = est.coverage;
    const list = document.getElementById("assumption-list");
    list.replaceChildren(...est.assumptions.map((a) => el("li", { text: a })));
    document.getElementById("text-summary").textContent = est.summary;
  }

  function renderVariants(all) {
    const box = document.getElementById("variants-table");
    const table = el("table", { class: "variants" });
    table.append(el("tr", {}, ...["variant", "accelerator", "GPUs", "step time (ms)", "tokens/s per GPU", "MFU", "exposed comm (ms)", "memory"].map((h) => el("th", { text: h }))));
    DATA.estimates.forEach((est, i) => {
      const f = all[i];
      const memory = est.memory_bytes === null || f.capacity === null ? "" : `${gib(est.memory_bytes)} / ${gib(f.capacity)} GiB${f.fits ? "" : " (does NOT fit)"}`;
      table.append(el("tr", { class: "variant-row" },
        el("td", { text: est.label }), el("td", { text: f.display + (f.note ? " (as estimated)" : "") }),
        el("td", { text: String(est.gpus) }),
        el("td", { class: "variant-time", text: ms(f.step) }), el("td", { text: f.tokensPerS ? thousands(f.tokensPerGpu) : "" }),
        el("td", { text: `${pct(f.mfu)}%` }), el("td", { text: est.communicates ? ms(f.exposedCommunication) : "" }), el("td", { text: memory })));
    });
    box.replaceChildren(table);
  }

  function renderCompare(all) {
    const names = [];
    for (const est of DATA.estimates) for (const s of est.stacks) if (!names.includes(s.name.split(" (x")[0])) names.push(s.name.split(" (x")[0]);
    const traces = DATA.estimates.map((est, v) => {
      const byName = {};
      for (const s of est.stacks) byName[s.name.split(" (x")[0]] = s.kernels.reduce((sum, i) => sum + all[v].time[i], 0);
      return { type: "bar", orientation: "h", name: est.label, y: names.slice().reverse(), x: names.map((n) => (byName[n] || 0) * 1e3).reverse(), hovertemplate: `${est.label}<br>%{y}: %{x:.3f} ms<extra></extra>` };
    });
    Plotly.react("compare-chart", traces, {
      title: { text: "time per stack of layers (ms)", x: 0.01, xanchor: "left" }, barmode: "group", height: Math.max(300, 40 * names.length * DATA.estimates.length / 2 + 120),
      margin: { l: 220, r: 10, t: 40, b: 40 }, xaxis: { title: { text: "ms" } }, legend: { orientation: "h" },
    }, PLOT_CONFIG);
  }

  function renderSweep(all) {
    const xs = DATA.sweep.values;
    const key = DATA.sweep.key;
    Plotly.react("sweep-chart", [
      { type: "scatter", mode: "lines+markers", name: "step time (ms)", x: xs, y: all.map((f) => f.step * 1e3) },
      { type: "scatter", mode: "lines+markers", name: "tokens/s per GPU", x: xs, y: all.map((f) => f.tokensPerGpu), yaxis: "y2" },
      ...sweepMarks(all),
    ], {
      title: { text: `step time and throughput over ${key}`, x: 0.01, xanchor: "left" }, height: 420, margin: { l: 60, r: 70, t: 40, b: 50 },
      xaxis: { title: { text: key }, type: "log" }, yaxis: { title: { text: "step time (ms)" } },
      yaxis2: { title: { text: "tokens/s per GPU" }, overlaying: "y", side: "right" },
      legend: { orientation: "h", y: -0.2 },
    }, PLOT_CONFIG);
    const categories = CATEGORIES.filter(([c]) => DATA.estimates.some((est) => est.rows.some((r) => r.traffic[c])));
    Plotly.react("sweep-traffic-chart", categories.map(([c, label]) => ({
      type: "bar", name: label, x: xs.map(String), marker: { color: COLOURS[c] },
      y: DATA.estimates.map((est) => est.rows.reduce((sum, r) => sum + (r.traffic[c] || 0), 0) / 1e9),
    })), {
      title: { text: `HBM bytes per step by kind (GB) over ${key}`, x: 0.01, xanchor: "left" }, barmode: "stack", height: 360, margin: { l: 60, r: 10, t: 40, b: 50 },
      xaxis: { title: { text: key }, type: "category" }, yaxis: { title: { text: "GB" } }, legend: { orientation: "h", y: -0.25 },
    }, PLOT_CONFIG);
  }

  // B* and the KV crossover (compare.Sweep: taken from the first point) on a batch sweep,
  // as vertical lines over the step-time axis.
  function sweepMarks(all) {
    if (DATA.sweep.key !== "batch") return [];
    const top = Math.max(...all.map((f) => f.step * 1e3));
    const marks = [["B*", all[0].ridgeBatch, "#222222"], ["KV crossover", DATA.estimates[0].kv_crossover_batch, "#9467bd"]];
    return marks.filter(([, x]) => x).map(([label, x, colour]) => ({
      type: "scatter", mode: "lines", name: `${label} ≈ ${x.toFixed(0)}`, x: [x, x], y: [0, top],
      line: { color: colour, dash: "dash", width: 1.5 }, hoverinfo: "name",
    }));
  }

  function render() {
    const all = DATA.estimates.map(figures);
    window.torchroofFigures = all; // read by the browser test
    if (DATA.kind !== "estimate") renderVariants(all);
    if (DATA.kind === "comparison") renderCompare(all);
    if (DATA.kind === "sweep") renderSweep(all);
    if (DATA.kind === "grid") renderGrid(all);
    const est = DATA.estimates[state.view];
    const f = all[state.view];
    renderSummary(est, f);
    renderLayers(est, f);
    renderRoofline(est, f);
    renderTimeline(est, f);
    renderAssumptions(est);
    document.body.setAttribute("data-rendered", String(Number(document.body.getAttribute("data-rendered") || 0) + 1));
  }

  // For the browser test: estimate ``view`` priced on accelerator ``name`` at the given
  // efficiencies (the page's state is left as it was).
  window.torchroofPrice = (view, name, computeEfficiency, bandwidthEfficiency) => {
    const saved = { ...state };
    Object.assign(state, { accelerator: name, computeEfficiency, bandwidthEfficiency });
    try {
      const f = figures(DATA.estimates[view]);
      return { step: f.step, time: f.time, note: f.note, mfu: f.mfu, exposed: f.exposed };
    } finally {
      Object.assign(state, saved);
    }
  };

  build();
  render();
})();
