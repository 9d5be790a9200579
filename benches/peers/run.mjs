// Side-by-side comparison of valem with the systems a user would otherwise pick, on the same
// shapes and sizes, in one run (scripts/bench-peers runs this after installing the peers).
//
//   node run.mjs --valem PATH [--sizes 1000,10000,100000] [--out DIR] [--budget SECONDS]
//                [--warmup SECONDS]
//
// Shapes (as `valem bench` defines them):
//   fanout  total_i = price_i * qty_i; one op writes one random price_k and reads total_k
//   chain   f_0 = seed + 1, f_i = f_{i-1} + 1; one op writes seed and reads f_{n-1}
//   items   items[*].total = price * qty, sum = $sum(items.total); one op writes one item's qty
//           and reads sum
// Per system, shape and size (each in its own child process, so memory and a slow peer are
// isolated): build time (the model/sheet/template created with its data), the median and p90
// latency of one op after the same warm-up for every system (untimed ops for --warmup seconds,
// default 1: caches warm, V8's JIT and valem's tiers compiled), resident memory after the run.
// A cell that passes the time budget is reported as "-" (skipped), never hangs the run.
//
// Peers: HyperFormula (a spreadsheet engine; licenseKey 'gpl-v3', installed here from npm only
// to measure), stated-js (reactive JSON templates over JSONata), and jsonata-js alone (the
// hand-written baseline: every derivation re-evaluated after each write, in dependency order).

import { spawn } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';

const SHAPES = ['fanout', 'chain', 'items'];
const SYSTEMS = ['valem', 'hyperformula', 'stated-js', 'jsonata'];

function arg(name, dflt) {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : dflt;
}

// --- child: one measurement --------------------------------------------------------------------

let seed = 1;
function rand(n) {
  seed = (seed * 1103515245 + 12345) % 2147483648;
  return seed % n;
}

/** Run `op` untimed for `warmup` seconds, then time it until `maxOps` ran or `seconds` passed
 * (at least 3 ops); latencies in µs. */
async function timeOps(op, maxOps, seconds, warmup) {
  const w0 = performance.now();
  let warmup_ops = 0;
  while (performance.now() - w0 < warmup * 1000) await op(warmup_ops++);
  const times = [];
  const start = performance.now();
  for (let i = 0; i < maxOps; i++) {
    const t = performance.now();
    await op(i);
    times.push((performance.now() - t) * 1000);
    if (i >= 2 && performance.now() - start > seconds * 1000) break;
  }
  times.sort((a, b) => a - b);
  const pct = (p) => times[Math.min(times.length - 1, Math.ceil(times.length * p) - 1)];
  return { warmup_ops, ops: times.length, p50_us: pct(0.5), p90_us: pct(0.9) };
}

async function hyperformula(shape, n) {
  const { HyperFormula } = await import('hyperformula');
  const rows = [];
  const t0 = performance.now();
  if (shape === 'fanout') {
    for (let i = 0; i < n; i++) rows.push([i + 1, 2, `=A${i + 1}*B${i + 1}`]);
  } else if (shape === 'chain') {
    rows.push([0, '=A1+1']);
    for (let i = 1; i < n; i++) rows.push([null, `=B${i}+1`]);
  } else {
    for (let i = 0; i < n; i++) rows.push([(i % 97) + 1, 2, `=A${i + 1}*B${i + 1}`, i === 0 ? `=SUM(C1:C${n})` : null]);
  }
  // The default sheet is 40,000 rows at most.
  const hf = HyperFormula.buildFromArray(rows, { licenseKey: 'gpl-v3', maxRows: Math.max(40000, n + 1) });
  const build_ms = performance.now() - t0;
  let v = 1000;
  const op = {
    fanout: () => {
      const k = rand(n);
      hf.setCellContents({ sheet: 0, row: k, col: 0 }, [[++v]]);
      return hf.getCellValue({ sheet: 0, row: k, col: 2 });
    },
    chain: () => {
      hf.setCellContents({ sheet: 0, row: 0, col: 0 }, [[++v]]);
      return hf.getCellValue({ sheet: 0, row: n - 1, col: 1 });
    },
    items: () => {
      hf.setCellContents({ sheet: 0, row: rand(n), col: 1 }, [[++v]]);
      return hf.getCellValue({ sheet: 0, row: 0, col: 3 });
    },
  }[shape];
  return { build_ms, op };
}

async function stated(shape, n) {
  const { default: TemplateProcessor } = await import('stated-js');
  const tpl = {};
  if (shape === 'fanout') {
    for (let i = 0; i < n; i++) {
      tpl[`price_${i}`] = i + 1;
      tpl[`qty_${i}`] = 2;
      tpl[`total_${i}`] = `\${price_${i} * qty_${i}}`;
    }
  } else if (shape === 'chain') {
    tpl.seed = 0;
    for (let i = 0; i < n; i++) tpl[`f_${i}`] = i === 0 ? '${seed + 1}' : `\${f_${i - 1} + 1}`;
  } else {
    tpl.items = Array.from({ length: n }, (_, i) => ({ price: (i % 97) + 1, qty: 2, total: '${price * qty}' }));
    tpl.sum = '${$sum(items.total)}';
  }
  const t0 = performance.now();
  const tp = new TemplateProcessor(tpl);
  await tp.initialize();
  const build_ms = performance.now() - t0;
  let v = 1000;
  const op = {
    fanout: () => tp.setData(`/price_${rand(n)}`, ++v),
    chain: () => tp.setData('/seed', ++v),
    items: () => tp.setData(`/items/${rand(n)}/qty`, ++v),
  }[shape];
  return { build_ms, op };
}

async function jsonataAlone(shape, n) {
  const { default: jsonata } = await import('jsonata');
  const t0 = performance.now();
  let doc = {};
  let derive;
  if (shape === 'fanout') {
    const exprs = [];
    for (let i = 0; i < n; i++) {
      doc[`price_${i}`] = i + 1;
      doc[`qty_${i}`] = 2;
      exprs.push([`total_${i}`, jsonata(`price_${i} * qty_${i}`)]);
    }
    derive = async () => {
      for (const [k, e] of exprs) doc[k] = await e.evaluate(doc);
    };
  } else if (shape === 'chain') {
    doc.seed = 0;
    const exprs = [];
    for (let i = 0; i < n; i++) exprs.push([`f_${i}`, jsonata(i === 0 ? 'seed + 1' : `f_${i - 1} + 1`)]);
    derive = async () => {
      for (const [k, e] of exprs) doc[k] = await e.evaluate(doc);
    };
  } else {
    doc.items = Array.from({ length: n }, (_, i) => ({ price: (i % 97) + 1, qty: 2 }));
    const line = jsonata('price * qty');
    const sum = jsonata('$sum(items.total)');
    derive = async () => {
      for (const it of doc.items) it.total = await line.evaluate(it);
      doc.sum = await sum.evaluate(doc);
    };
  }
  await derive();
  const build_ms = performance.now() - t0;
  let v = 1000;
  const op = {
    fanout: () => { doc[`price_${rand(n)}`] = ++v; return derive(); },
    chain: () => { doc.seed = ++v; return derive(); },
    items: () => { doc.items[rand(n)].qty = ++v; return derive(); },
  }[shape];
  return { build_ms, op };
}

/** One peer's cell: its model built (each peer function returns the build time and one op),
 * then the op timed. */
async function child(system, shape, n, seconds, warmup) {
  const f = { hyperformula, 'stated-js': stated, jsonata: jsonataAlone }[system];
  const { build_ms, op } = await f(shape, n);
  const r = { build_ms, ...(await timeOps(op, 1000, seconds, warmup)) };
  r.rss_mb = process.memoryUsage().rss / 1048576;
  process.stdout.write(JSON.stringify(r) + '\n');
}

// --- parent: the run ---------------------------------------------------------------------------

function runChild(cmd, args, timeoutS) {
  return new Promise((resolve) => {
    const p = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    p.stdout.on('data', (d) => (out += d));
    p.stderr.on('data', (d) => (err += d));
    const timer = setTimeout(() => p.kill('SIGKILL'), timeoutS * 1000);
    p.on('close', (code, signal) => {
      clearTimeout(timer);
      if (signal) return resolve({ skipped: `over ${timeoutS} s` });
      try {
        resolve(JSON.parse(out.trim().split('\n').pop()));
      } catch {
        resolve({ skipped: `failed (exit ${code}): ${err.trim().split('\n').slice(-1)[0] || 'no output'}` });
      }
    });
  });
}

async function measure(system, shape, n, valem, budget, warmup) {
  const seconds = Math.max(1, budget / 4);
  if (system === 'valem') {
    const r = await runChild(valem, ['bench', '--json', '--shape', shape, '--n', String(n), '--count', '1000', '--max-seconds', String(seconds), '--warmup', String(warmup)], budget);
    if (r.skipped) return r;
    return { build_ms: r.compile_ms + r.first_cycle_ms, warmup_ops: r.warmup_mutations, ops: r.mutations, p50_us: r.p50_us, p90_us: r.p90_us, rss_mb: r.rss_mb };
  }
  return runChild(process.execPath, [process.argv[1], '--child', system, shape, String(n), String(seconds), String(warmup)], budget);
}

function fmtUs(us) {
  if (us === undefined) return '-';
  if (us >= 1e6) return `${(us / 1e6).toFixed(2)} s`;
  if (us >= 1e3) return `${(us / 1e3).toFixed(2)} ms`;
  return `${us.toFixed(1)} µs`;
}

function table(results, sizes) {
  const lines = [];
  const head = ['shape', 'N', 'metric', ...SYSTEMS, ...SYSTEMS.slice(1).map((s) => `${s}/valem`)];
  lines.push(head);
  for (const shape of SHAPES) {
    for (const n of sizes) {
      for (const [metric, key, fmt] of [
        ['op p50', 'p50_us', fmtUs],
        ['build', 'build_ms', (ms) => (ms === undefined ? '-' : fmtUs(ms * 1000))],
        ['memory', 'rss_mb', (mb) => (mb === undefined ? '-' : `${mb.toFixed(0)} MB`)],
      ]) {
        const cells = SYSTEMS.map((s) => results[s]?.[shape]?.[n]);
        const ours = cells[0]?.[key];
        const ratio = (c) => (ours > 0 && c?.[key] !== undefined ? `${(c[key] / ours).toFixed(1)}×` : '-');
        lines.push([shape, String(n), metric, ...cells.map((c) => (c?.skipped ? '-' : fmt(c?.[key]))), ...cells.slice(1).map(ratio)]);
      }
    }
  }
  const w = head.map((_, i) => Math.max(...lines.map((l) => l[i].length)));
  return lines.map((l) => l.map((c, i) => (i < 3 ? c.padEnd(w[i]) : c.padStart(w[i]))).join('  ')).join('\n');
}

/** Latency of one op vs N, log-log, one panel per shape. */
function svg(results, sizes) {
  const colors = { valem: '#d62728', hyperformula: '#1f77b4', 'stated-js': '#2ca02c', jsonata: '#9467bd' };
  const W = 300, H = 240, M = 50;
  let all = [];
  for (const s of SYSTEMS) for (const sh of SHAPES) for (const n of sizes) {
    const v = results[s]?.[sh]?.[n]?.p50_us;
    if (v > 0) all.push(v);
  }
  const lo = Math.floor(Math.log10(Math.min(...all, 1)));
  const hi = Math.ceil(Math.log10(Math.max(...all, 10)));
  const x = (n) => M + ((Math.log10(n) - Math.log10(sizes[0])) / Math.max(1e-9, Math.log10(sizes[sizes.length - 1]) - Math.log10(sizes[0]))) * (W - M - 10);
  const y = (v) => H - M + 20 - ((Math.log10(v) - lo) / (hi - lo)) * (H - M - 10);
  let out = `<svg xmlns="http://www.w3.org/2000/svg" width="${W * SHAPES.length}" height="${H + 40}" font-family="sans-serif" font-size="11">\n`;
  out += `<rect width="100%" height="100%" fill="white"/>\n`;
  SHAPES.forEach((sh, pi) => {
    out += `<g transform="translate(${pi * W},0)"><text x="${W / 2}" y="14" text-anchor="middle" font-weight="bold">${sh}: one op, p50</text>\n`;
    for (let e = lo; e <= hi; e++) {
      out += `<line x1="${M}" x2="${W - 10}" y1="${y(10 ** e)}" y2="${y(10 ** e)}" stroke="#ddd"/><text x="${M - 4}" y="${y(10 ** e) + 4}" text-anchor="end">${fmtUs(10 ** e)}</text>\n`;
    }
    for (const n of sizes) out += `<text x="${x(n)}" y="${H - M + 36}" text-anchor="middle">${n >= 1000 ? `${n / 1000}k` : n}</text>\n`;
    for (const s of SYSTEMS) {
      const pts = sizes.map((n) => [n, results[s]?.[sh]?.[n]?.p50_us]).filter(([, v]) => v > 0);
      if (pts.length) {
        out += `<polyline fill="none" stroke="${colors[s]}" stroke-width="2" points="${pts.map(([n, v]) => `${x(n).toFixed(1)},${y(v).toFixed(1)}`).join(' ')}"/>\n`;
        for (const [n, v] of pts) out += `<circle cx="${x(n).toFixed(1)}" cy="${y(v).toFixed(1)}" r="3" fill="${colors[s]}"/>\n`;
      }
    }
    out += '</g>\n';
  });
  SYSTEMS.forEach((s, i) => {
    out += `<rect x="${20 + i * 140}" y="${H + 22}" width="12" height="12" fill="${colors[s]}"/><text x="${36 + i * 140}" y="${H + 32}">${s}</text>\n`;
  });
  return out + '</svg>\n';
}

async function main() {
  if (process.argv[2] === '--child') {
    const [, , , system, shape, n, seconds, warmup] = process.argv;
    return child(system, shape, Number(n), Number(seconds), Number(warmup));
  }
  const valem = arg('valem');
  if (!valem) throw new Error('--valem PATH (the release valem binary) is required');
  const sizes = arg('sizes', '1000,10000,100000').split(',').map(Number).filter((n) => n > 0);
  const out = arg('out', 'bench-peers');
  const budget = Number(arg('budget', '60'));
  const warmup = Number(arg('warmup', '1'));
  if (!(warmup >= 0 && warmup < budget / 2)) throw new Error(`--warmup must be from 0 to half the budget (${budget / 2} s); got ${arg('warmup')}`);
  const results = {};
  for (const shape of SHAPES) {
    for (const n of sizes) {
      for (const system of SYSTEMS) {
        // A peer that was skipped at a smaller N is not run at a larger one.
        const smaller = sizes.filter((m) => m < n).map((m) => results[system]?.[shape]?.[m]);
        const r = smaller.some((c) => c?.skipped)
          ? { skipped: 'skipped at a smaller N' }
          : await measure(system, shape, n, valem, budget, warmup);
        ((results[system] ??= {})[shape] ??= {})[n] = r;
        process.stderr.write(`${shape} n=${n} ${system}: ${r.skipped ? r.skipped : `p50 ${fmtUs(r.p50_us)}, build ${fmtUs(r.build_ms * 1000)}`}\n`);
      }
    }
  }
  mkdirSync(out, { recursive: true });
  const text = table(results, sizes);
  writeFileSync(join(out, 'results.json'), JSON.stringify({ sizes, warmup_s: warmup, results }, null, 2) + '\n');
  writeFileSync(join(out, 'table.txt'), text + '\n');
  writeFileSync(join(out, 'latency.svg'), svg(results, sizes));
  console.log(text);
  console.log(`\nlatency: p50 and p90 of one op after ${warmup} s of untimed ops (--warmup), the same for every system`);
  console.log(`\nwritten: ${join(out, 'results.json')}, ${join(out, 'table.txt')}, ${join(out, 'latency.svg')}`);
}

main().catch((e) => {
  console.error(`bench-peers: ${e.message}`);
  process.exit(1);
});
