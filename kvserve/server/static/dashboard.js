// The live KV map (kvserve/server/dashboard.py): reads /dashboard/events with the admin key and
// draws each event. Plain JS, no build step, no library. A browser EventSource cannot send an
// Authorization header, so the stream is read with fetch() and a ReadableStream. The server ends
// each stream after a while (so that an open page never holds a shutdown up); the page opens the
// next one at once.
"use strict";
(() => {
  const KEY_STORAGE = "kvserve.dashboard.adminKey";
  const HISTORY_POINTS = 120;           // a minute at 2 events a second
  const COLORS = {
    free: "#e6e9ed", cached: "#5c8fd6", pinned: "#e8a317", held: "#9775d6", offline: "#4a5058",
    loading: "#12b886", unlisted: "#868e96", noTenant: "#adb5bd", inUse: "#d9480f",
  };
  const HEAT_STOPS = [[0, [49, 54, 149]], [0.25, [116, 173, 209]], [0.5, [254, 224, 144]],
                      [0.75, [244, 109, 67]], [1, [165, 0, 38]]];
  const FORMAT_COLORS = ["#3b8ea5", "#f2a541", "#8e6c8a", "#5fad56", "#c75146"];
  const STATE_LABELS = {
    free: "free", running: "held by a request", shared: "held and shared (in the prefix cache)",
    loading: "loading from a tier", cached: "cached prefix (evictable)", pinned: "pinned prefix",
    held: "held for a swapped-out or tiered request", offline: "offline (memory given back)",
  };

  // What the page knows, in one object: the browser test reads it (window.kvMapState).
  const state = window.kvMapState = {
    connected: false, events: 0, streams: 0, colorMode: "owner", hz: 2, last: null, previous: null,
    trees: [], tiers: {}, history: [], rates: {}, error: null,
  };
  let controller = null;
  let retryDelay = 500;
  const $ = (id) => document.getElementById(id);

  // --- colours --------------------------------------------------------------------------------
  const hue = (index, offset) => (index * 137.508 + offset) % 360;
  const requestColor = (index, light) => index < 0 ? COLORS.unlisted
    : `hsl(${hue(index, 10).toFixed(1)}, 68%, ${light ? 70 : 44}%)`;
  const tenantColor = (index) => `hsl(${hue(index, 200).toFixed(1)}, 60%, 52%)`;
  function heatColor(value) {
    const t = Math.max(0, Math.min(1, value / 100));
    for (let i = 1; i < HEAT_STOPS.length; i++) {
      const [t1, c1] = HEAT_STOPS[i];
      if (t <= t1) {
        const [t0, c0] = HEAT_STOPS[i - 1];
        const f = (t - t0) / (t1 - t0);
        return `rgb(${c0.map((c, k) => Math.round(c + (c1[k] - c) * f)).join(",")})`;
      }
    }
    return "rgb(165,0,38)";
  }
  function formatColor(format) {
    const formats = state.formats || (state.formats = []);
    let index = formats.indexOf(format);
    if (index < 0) { formats.push(format); index = formats.length - 1; }
    return FORMAT_COLORS[index % FORMAT_COLORS.length];
  }
  function cellColor(tier, stateName, i, map) {
    if (stateName === "free") return COLORS.free;
    if (stateName === "offline") return COLORS.offline;
    const mode = state.colorMode;
    if (mode === "heat") return heatColor(tier.heat[i]);
    if (mode === "format") return formatColor(tier.kv_format);
    if (mode === "tenant") {
      const t = tier.tenants[i];
      return t < 0 || map.tenants[t] === null ? COLORS.noTenant : tenantColor(t);
    }
    if (stateName === "running" || stateName === "shared") return requestColor(tier.requests[i], stateName === "shared");
    return COLORS[stateName] || COLORS.unlisted;
  }

  // --- formatting -----------------------------------------------------------------------------
  const int = (n) => n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US");
  const pct = (x) => x === null || x === undefined || !isFinite(x) ? "–" : (100 * x).toFixed(1) + "%";
  function bytes(n) {
    if (!isFinite(n)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + units[i];
  }
  const rate = (x) => x === undefined || x === null ? "–" : (x >= 100 ? x.toFixed(0) : x.toFixed(1));
  const age = (s) => s === null || s === undefined ? "–" : s < 60 ? s.toFixed(1) + " s" : (s / 60).toFixed(1) + " min";
  const tenantName = (t) => t === null || t === undefined ? "(no tenant)" : t;
  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }
  function fillTable(table, rows, emptyText, columns) {
    const body = table.tBodies[0];
    body.replaceChildren();
    if (!rows.length) {
      const tr = body.insertRow();
      const td = cell(emptyText, "empty");
      td.colSpan = columns;
      tr.append(td);
      return;
    }
    for (const row of rows) {
      const tr = body.insertRow();
      for (const value of row) {
        if (value instanceof Node) { const td = document.createElement("td"); td.append(value); tr.append(td); }
        else if (typeof value === "object" && value !== null) tr.append(cell(value.text, value.cls));
        else tr.append(cell(String(value)));
      }
    }
  }
  const num = (text) => ({ text, cls: "num" });
  function swatch(color) {
    const span = document.createElement("span");
    span.className = "swatch";
    span.style.background = color;
    return span;
  }

  // --- the stream -----------------------------------------------------------------------------
  function setStatus(kind, text) {
    const el = $("status");
    el.dataset.state = kind;
    el.textContent = text;
  }
  function showMessage(text) {
    const el = $("message");
    el.hidden = !text;
    el.textContent = text || "";
  }
  function showKeyForm(show) {
    $("key-form").hidden = !show;
    $("forget-key").hidden = show;
  }
  async function connect() {
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (!key) { showKeyForm(true); setStatus("idle", "not connected"); return; }
    showKeyForm(false);
    if (controller) controller.abort();
    const mine = controller = new AbortController();
    let response;
    try {
      response = await fetch(`/dashboard/events?hz=${state.hz}`, {
        headers: { Authorization: `Bearer ${key}` }, cache: "no-store", signal: mine.signal });
    } catch (error) {
      if (mine.signal.aborted) return;
      return retry("cannot reach the server");
    }
    if (response.status === 401 || response.status === 403) {
      let message = `the key was refused (${response.status})`;
      try { message += ": " + (await response.json()).error.message; } catch (_) { /* not JSON */ }
      sessionStorage.removeItem(KEY_STORAGE);
      showMessage(message);
      setStatus("error", "key refused");
      showKeyForm(true);
      return;
    }
    if (!response.ok || !response.body) return retry(`the server answered ${response.status}`);
    showMessage("");
    state.connected = true;
    state.streams++;
    retryDelay = 500;
    setStatus("live", "live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          handleBlock(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
    } catch (error) {
      if (mine.signal.aborted) return;
      state.connected = false;
      return retry("the stream broke off");
    }
    state.connected = false;
    if (mine === controller && !document.hidden) setTimeout(connect, 50);   // the server ended it: next one
  }
  function retry(why) {
    state.connected = false;
    setStatus("error", `${why}; retrying`);
    setTimeout(connect, retryDelay);
    retryDelay = Math.min(retryDelay * 2, 10000);
  }
  function handleBlock(block) {
    if (block.startsWith(": unchanged")) { noteUnchanged(); return; }
    const data = block.split("\n").filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("\n");
    if (!data || block.startsWith("event: end")) return;
    try { onEvent(JSON.parse(data)); } catch (error) { console.error("kvserve dashboard: bad event", error); }
  }

  // --- each event -----------------------------------------------------------------------------
  function onEvent(event) {
    const map = event.kv_map;
    if (map.prefix_trees !== null) state.trees = map.prefix_trees;
    state.previous = state.last;
    state.last = event;
    state.events++;
    computeRates(event, state.previous);
    $("model").textContent = event.model;
    $("pace").textContent = `every ${event.interval_s.toFixed(2)} s · map made in ${(1000 * map.build_seconds).toFixed(1)} ms`;
    draw();
  }
  function noteUnchanged() {
    // Nothing changed since the last event: every total is where it was, so every rate is zero.
    for (const key of Object.keys(state.rates)) state.rates[key].perSecond = 0;
    if (state.last) { renderRates(state.last); renderTiles(state.last); }
  }
  function computeRates(event, previous) {
    const engine = event.engine;
    const totals = {};
    const add = (key, label, value) => { if (value !== undefined && value !== null) totals[key] = { label, value }; };
    const prefix = engine.prefix_cache;
    if (prefix) {
      for (const [policy, count] of Object.entries(prefix.evictions)) add("evict:" + policy, `GPU evictions (${policy})`, count);
    }
    const host = engine.kv_host;
    if (host) {
      add("host_written", "host tier: blocks written", host.blocks_written);
      add("host_loaded", "host tier: blocks loaded", host.blocks_loaded);
      add("host_evicted", "host tier: evictions", host.blocks_evicted);
      add("swapped_out", "swap-outs", host.swapped_out);
      add("swapped_in", "swap-ins", host.swapped_in);
    }
    if (engine.kv_transfers) add("to_device", "bytes to the GPU", engine.kv_transfers.bytes_to_device);
    for (const store of engine.kv_cold) {
      add(`cold_read:${store.name}`, `${store.name}: blocks read`, store.hits);
      add(`cold_written:${store.name}`, `${store.name}: blocks written`, store.blocks_written);
      add(`cold_evicted:${store.name}`, `${store.name}: evictions`, store.evictions);
    }
    add("preemptions", "preemptions", engine.num_preemptions_total);
    add("prompt_tokens", "prompt tokens", engine.prompt_tokens_total);
    add("generated_tokens", "generated tokens", engine.generation_tokens_total);
    const dt = previous ? event.monotonic_time - previous.monotonic_time : 0;
    const rates = {};
    for (const [key, { label, value }] of Object.entries(totals)) {
      const before = state.rates[key];
      rates[key] = { label, total: value,
                     perSecond: before && dt > 0 ? Math.max(0, value - before.total) / dt : before ? before.perSecond : null };
    }
    state.rates = rates;
    // Hit rate over the interval (not since start): what the cache does now.
    let intervalHit = null;
    if (previous && prefix && previous.engine.prefix_cache) {
      const queried = prefix.query_tokens - previous.engine.prefix_cache.query_tokens;
      if (queried > 0) intervalHit = (prefix.hit_tokens - previous.engine.prefix_cache.hit_tokens) / queried;
    }
    const gpu = event.kv_map.tiers[0];
    const counts = gpu.state_counts;
    state.history.push({ held: (counts.running + counts.shared + counts.loading) / gpu.num_blocks,
                         cached: (counts.cached + counts.pinned) / gpu.num_blocks, hit: intervalHit });
    if (state.history.length > HISTORY_POINTS) state.history.shift();
  }

  // --- drawing --------------------------------------------------------------------------------
  function draw() {
    const event = state.last;
    if (!event) return;
    renderTiles(event);
    renderTiers(event.kv_map);
    renderLegend(event.kv_map);
    renderRequests(event.kv_map);
    renderTrees(event.kv_map);
    renderHitRates(event);
    renderRates(event);
    renderPins(event.kv_map);
    renderBandwidth(event.engine);
    renderConfigEvents(event.engine);
    renderHistory();
  }
  function renderTiles(event) {
    const gpu = event.kv_map.tiers[0], c = gpu.state_counts, engine = event.engine;
    const held = c.running + c.shared + c.loading, cached = c.cached + c.pinned;
    const setTile = (id, value, text, note) => {
      const el = $(id);
      el.dataset.value = value;
      el.replaceChildren(text, Object.assign(document.createElement("small"), { textContent: note }));
    };
    setTile("gpu-used", held, int(held), pct(held / gpu.num_blocks));
    setTile("gpu-cached", cached, int(cached), pct(cached / gpu.num_blocks));
    setTile("gpu-free", c.free, int(c.free), pct(c.free / gpu.num_blocks));
    const requests = $("requests-count");
    requests.dataset.running = engine.num_running;
    requests.dataset.waiting = engine.num_waiting;
    requests.textContent = `${engine.num_running} / ${engine.num_waiting}`;
    $("hit-rate").textContent = engine.prefix_cache ? pct(engine.prefix_cache.hit_rate) : "off";
    const sum = (prefix) => Object.entries(state.rates).filter(([k]) => k.startsWith(prefix))
      .reduce((s, [, r]) => s + (r.perSecond || 0), 0);
    const perSecond = (id, value) => $(id).replaceChildren(rate(value),
      Object.assign(document.createElement("small"), { textContent: "blocks/s" }));
    perSecond("eviction-rate", sum("evict:"));
    perSecond("load-rate", sum("host_loaded") + sum("cold_read:"));
    const bw = engine.bandwidth;
    $("bandwidth-tile").textContent = bw ? pct(bw.recent_utilization) : "–";
  }
  function renderTiers(map) {
    const container = $("tiers");
    const names = new Set(map.tiers.map((t) => t.name));
    for (const el of [...container.children]) if (!names.has(el.dataset.tier)) el.remove();
    for (const tier of map.tiers) {
      let box = container.querySelector(`[data-tier="${tier.name}"]`);
      if (!box) {
        box = document.createElement("div");
        box.className = "tier";
        box.dataset.tier = tier.name;
        box.innerHTML = "<h2></h2><canvas></canvas><div class='counts'></div>";
        container.append(box);
        const canvas = box.querySelector("canvas");
        canvas.addEventListener("mousemove", (e) => showTooltip(e, tier.name));
        canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
      }
      const title = tier.name === "gpu" ? "GPU pool" : tier.name === "host" ? "Host tier" : tier.name;
      const cells = tier.states.length;
      const tokens = tier.num_blocks * map.block_size;
      box.querySelector("h2").innerHTML = "";
      box.querySelector("h2").append(title, Object.assign(document.createElement("span"), {
        className: "muted",
        textContent: `${int(tier.num_blocks)} blocks · ${int(tokens)} tokens · ${bytes(tier.num_blocks * map.kv_bytes_per_block)}` +
          ` · ${tier.blocks_per_cell === 1 ? "a cell a block" : `a cell ${tier.blocks_per_cell} blocks`} · ${tier.kv_format}`,
      }));
      const layout = drawGrid(box.querySelector("canvas"), tier, map);
      const counts = Object.entries(tier.state_counts).filter(([, n]) => n > 0)
        .map(([s, n]) => `${s} ${int(n)}`).join(" · ");
      box.querySelector(".counts").textContent = counts;
      state.tiers[tier.name] = { cells, drawnCells: layout.drawn, blocksPerCell: tier.blocks_per_cell,
                                 numBlocks: tier.num_blocks, counts: { ...tier.state_counts }, layout };
    }
  }
  function drawGrid(canvas, tier, map) {
    const cells = tier.states.length;
    const width = Math.max(200, canvas.parentElement.clientWidth);
    // Cells as large as fit a grid about 240 px high, between 3 and 16 px.
    const size = Math.max(3, Math.min(16, Math.floor(Math.sqrt((width * 240) / Math.max(1, cells)))));
    const columns = Math.max(1, Math.floor(width / size));
    const rows = Math.ceil(cells / columns);
    const ratio = window.devicePixelRatio || 1;
    canvas.style.height = rows * size + "px";
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(rows * size * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, rows * size);
    const gap = size >= 6 ? 1 : 0;
    const stateNames = map.block_states;
    let drawn = 0;
    for (let i = 0; i < cells; i++) {
      const name = stateNames[tier.states[i]];
      ctx.fillStyle = cellColor(tier, name, i, map);
      ctx.fillRect((i % columns) * size, Math.floor(i / columns) * size, size - gap, size - gap);
      drawn++;
    }
    return { size, columns, rows, drawn };
  }
  function showTooltip(e, tierName) {
    const event = state.last, info = state.tiers[tierName];
    if (!event || !info) return;
    const map = event.kv_map, tier = map.tiers.find((t) => t.name === tierName);
    const rect = e.target.getBoundingClientRect();
    const { size, columns } = info.layout;
    const column = Math.floor((e.clientX - rect.left) / size), row = Math.floor((e.clientY - rect.top) / size);
    const i = row * columns + column;
    const tip = $("tooltip");
    if (!tier || column >= columns || i < 0 || i >= tier.states.length) { tip.hidden = true; return; }
    const first = i * tier.blocks_per_cell, last = Math.min(first + tier.blocks_per_cell, tier.num_blocks) - 1;
    const name = map.block_states[tier.states[i]];
    const lines = [first === last ? `block ${first}` : `blocks ${first}-${last} (most are ${name})`,
                   STATE_LABELS[name] || name];
    const r = tier.requests[i];
    if (r >= 0 && map.requests[r]) lines.push(`request ${map.requests[r].request_id} (${map.requests[r].state})`);
    const t = tier.tenants[i];
    if (t >= 0) lines.push(`tenant ${tenantName(map.tenants[t])}`);
    if (name !== "free" && name !== "offline") lines.push(`heat ${tier.heat[i]} / 100`);
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    tip.style.left = e.clientX + 14 + "px";
    tip.style.top = e.clientY + 12 + "px";
  }
  function renderLegend(map) {
    const legend = $("legend");
    legend.replaceChildren();
    const item = (color, text) => {
      const span = document.createElement("span");
      span.className = "item";
      span.append(swatch(color), text);
      legend.append(span);
    };
    const mode = state.colorMode;
    item(COLORS.free, "free");
    if (mode === "owner") {
      map.requests.slice(0, 8).forEach((r, index) => item(requestColor(index, false), `request ${r.request_id}`));
      if (map.requests.length > 8) item(COLORS.unlisted, `… ${map.requests.length - 8} more requests`);
      item(requestColor(0, true), "lighter: shared (in the prefix cache)");
      for (const s of ["loading", "cached", "pinned", "held"]) item(COLORS[s], STATE_LABELS[s]);
    } else if (mode === "tenant") {
      map.tenants.forEach((t, index) => item(t === null ? COLORS.noTenant : tenantColor(index), tenantName(t)));
    } else if (mode === "format") {
      for (const tier of map.tiers) item(formatColor(tier.kv_format), `${tier.name}: ${tier.kv_format}`);
    } else {
      const bar = document.createElement("span");
      bar.className = "heat-bar";
      bar.style.background = `linear-gradient(to right, ${HEAT_STOPS.map(([t, c]) => `rgb(${c}) ${t * 100}%`).join(", ")})`;
      const span = document.createElement("span");
      span.className = "item";
      span.append("cold", bar, "hot (recent uses u: 100·u/(u+1); 50 = one use)");
      legend.append(span);
    }
    item(COLORS.offline, "offline");
  }
  function renderRequests(map) {
    const now = map.monotonic_time;
    const rows = map.requests.map((r, index) => [
      swatch(requestColor(index, false)), r.request_id, r.state, tenantName(r.tenant), r.qos_class || "–",
      num(int(r.num_prompt_tokens)), num(int(r.num_output_tokens)), num(int(r.num_kv_tokens)),
      num(int(r.gpu_blocks)), num(bytes(r.gpu_blocks * map.kv_bytes_per_block)), num(int(r.host_blocks)),
      num(age(now - r.arrival_time))]);
    fillTable($("requests"), rows, "no request in the engine", 12);
    const held = map.requests.reduce((s, r) => s + r.gpu_blocks, 0);
    $("requests-note").textContent = `${map.num_requests} in the engine` +
      (map.num_requests > map.requests.length ? `, the first ${map.requests.length} listed` : "") +
      ` · ${int(held)} GPU blocks in their tables (shared ones counted once per request)`;
  }
  function renderTrees(map) {
    const box = $("trees");
    box.replaceChildren();
    const trees = state.trees || [];
    $("trees-note").textContent = trees.length ? `the ${trees.length} largest of ${map.num_prefix_trees} · ` +
      "a row per branch, x: place in the chain · colour: heat, orange: in use now, amber outline: pinned" : "";
    if (!trees.length) {
      box.append(Object.assign(document.createElement("p"), { className: "muted", textContent: "no cached prefix" }));
      return;
    }
    const now = map.monotonic_time;
    for (const tree of trees) {
      const row = document.createElement("div");
      row.className = "tree";
      const facts = document.createElement("div");
      facts.className = "facts";
      facts.textContent = `${tenantName(tree.tenant)}: ${int(tree.num_blocks)} blocks (${int(tree.num_blocks * map.block_size)} tokens)` +
        ` · depth ${tree.max_depth + 1} · branches ${tree.num_branches} · uses ${int(tree.hits)}` +
        (tree.pinned_blocks ? ` · ${tree.pinned_blocks} pinned` : "") +
        (tree.held_blocks ? ` · ${tree.held_blocks} in use` : "");
      const canvas = document.createElement("canvas");
      row.append(facts, canvas);
      box.append(row);
      drawTree(canvas, tree, now);
    }
  }
  function drawTree(canvas, tree, now) {
    // An icicle: x is the block's place in the chain, a row per leaf; a segment spans its leaves.
    const nodes = tree.nodes, kids = nodes.map(() => []);
    nodes.forEach((n, i) => { if (n.parent >= 0) kids[n.parent].push(i); });
    const top = new Array(nodes.length), span = new Array(nodes.length);
    let leaves = 0;
    const place = (i) => {
      top[i] = leaves;
      if (!kids[i].length) leaves++;
      for (const k of kids[i]) place(k);
      span[i] = Math.max(1, leaves - top[i]);
    };
    nodes.forEach((n, i) => { if (n.parent < 0) place(i); });
    const width = Math.max(200, canvas.parentElement.clientWidth - 340);
    const rowPx = Math.max(3, Math.min(10, Math.floor(60 / Math.max(1, leaves))));
    const height = Math.max(rowPx, leaves * rowPx);
    const ratio = window.devicePixelRatio || 1;
    canvas.style.height = height + "px";
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const scale = width / Math.max(1, tree.max_depth + 1);
    nodes.forEach((n, i) => {
      const recent = n.last_use === null ? 0 : Math.pow(0.5, (now - n.last_use) / 120);
      ctx.fillStyle = n.held_blocks ? COLORS.inUse : heatColor(100 * (n.hits * recent) / (n.hits * recent + 1));
      ctx.fillRect(n.depth * scale, top[i] * rowPx, Math.max(1, n.num_blocks * scale - 1), span[i] * rowPx - 1);
      if (n.pinned_blocks) {
        ctx.strokeStyle = COLORS.pinned;
        ctx.lineWidth = 2;
        ctx.strokeRect(n.depth * scale + 1, top[i] * rowPx + 1, Math.max(1, n.num_blocks * scale - 3), span[i] * rowPx - 3);
      }
    });
  }
  function renderHitRates(event) {
    const engine = event.engine, prefix = engine.prefix_cache;
    const rows = [];
    const query = prefix ? prefix.query_tokens : 0;
    if (prefix) rows.push(["GPU prefix cache", num(pct(prefix.hit_rate)), num(int(prefix.hit_tokens)),
                           { text: `${int(prefix.cached_blocks)} cached · ${int(prefix.evictable_blocks)} evictable`, cls: "note" }]);
    if (engine.kv_host) rows.push(["host tier", num(query ? pct(engine.kv_host.hit_tokens / query) : "–"),
                                   num(int(engine.kv_host.hit_tokens)),
                                   { text: `${int(engine.kv_host.used_blocks)} of ${int(engine.kv_host.num_blocks)} used`, cls: "note" }]);
    for (const store of engine.kv_cold) {
      const tokens = engine.kv_cold_hit_tokens[store.name] || 0;
      const looked = store.hits + store.misses;
      rows.push([store.name, num(query ? pct(tokens / query) : "–"), num(int(tokens)),
                 { text: `${looked ? pct(store.hits / looked) : "–"} of blocks looked up found${store.available ? "" : " · unavailable"}`,
                   cls: "note" }]);
    }
    fillTable($("hit-rates"), rows, "prefix caching is off", 4);
    const policy = [];
    if (prefix) {
      policy.push(["configured", prefix.policy], ["ranking now", prefix.active_policy]);
      if (prefix.adaptive) {
        for (const [arm, hit] of Object.entries(prefix.adaptive.shadow_hit_rates))
          policy.push([`shadow ${arm}`, { text: pct(hit) + (arm === prefix.adaptive.active ? " (active)" : ""), cls: "num" }]);
        policy.push(["switches", num(int(prefix.adaptive.num_switches))]);
      }
    }
    fillTable($("policy"), policy, "no eviction policy (prefix caching off)", 2);
  }
  function renderRates(event) {
    const rows = Object.values(state.rates).map((r) => [r.label, num(rate(r.perSecond)), num(int(r.total))]);
    fillTable($("rates"), rows, "nothing yet", 3);
  }
  function renderPins(map) {
    const rows = map.pins.map((p) => [p.pin_id, tenantName(p.tenant), num(int(p.num_blocks)),
                                      num(int(p.num_cached_blocks)), num(age(p.expires_in_s))]);
    fillTable($("pins"), rows, "no active pin", 5);
  }
  function renderBandwidth(engine) {
    const bw = engine.bandwidth;
    const rows = bw ? [["last second", num(pct(bw.recent_utilization))],
                       ["mean over steps", num(bw.steps ? pct(bw.utilization_sum / bw.steps) : "–")],
                       ["last step read", num(bytes(bw.last_bytes_read) + ` in ${(bw.last_step_s * 1000).toFixed(2)} ms`)],
                       ["peak", num(`${(bw.peak_bytes_per_s / 1e9).toFixed(1)} GB/s`)], ["measured by", bw.peak_source],
                       ["steps measured", num(int(bw.steps))]] : [];
    fillTable($("bandwidth"), rows, "no step measured yet", 2);
  }
  function renderConfigEvents(engine) {
    const rows = [...engine.config_events].reverse().map((e) => [
      new Date(e.time * 1000).toLocaleTimeString(), e.source, e.field, `${e.old} → ${e.new}`]);
    fillTable($("config-events"), rows, "no change since start", 4);
  }
  function renderHistory() {
    const canvas = $("history-usage");
    const width = Math.max(200, canvas.parentElement.clientWidth - 24), height = 110;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.strokeStyle = "#eef0f3";
    for (const f of [0, 0.5, 1]) { ctx.beginPath(); ctx.moveTo(0, 4 + (1 - f) * (height - 8)); ctx.lineTo(width, 4 + (1 - f) * (height - 8)); ctx.stroke(); }
    const points = state.history, step = width / Math.max(1, points.length - 1);
    const line = (key, color) => {
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      points.forEach((p, i) => {
        if (p[key] === null) { started = false; return; }
        const x = i * step, y = 4 + (1 - p[key]) * (height - 8);
        if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
      });
      ctx.stroke();
    };
    line("held", "#d9480f");
    line("cached", "#5c8fd6");
    line("hit", "#2b8a3e");
  }

  // --- controls -------------------------------------------------------------------------------
  function init() {
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("admin-key").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORAGE, key);
      $("admin-key").value = "";
      connect();
    });
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORAGE);
      if (controller) controller.abort();
      state.connected = false;
      showKeyForm(true);
      setStatus("idle", "not connected");
    });
    for (const input of document.querySelectorAll("#color-mode input")) {
      input.addEventListener("change", () => { state.colorMode = input.value; draw(); });
    }
    $("rate").addEventListener("change", (e) => { state.hz = Number(e.target.value); connect(); });
    // A hidden tab asks the engine for nothing.
    document.addEventListener("visibilitychange", () => {
      if (document.hidden) { if (controller) controller.abort(); state.connected = false; setStatus("idle", "paused (tab hidden)"); }
      else connect();
    });
    window.addEventListener("resize", () => draw());
    connect();
  }
  init();
})();
