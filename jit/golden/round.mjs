// Writes round.json: $round(x, p) as the reference jsonata-js computes it, for the JIT's
// golden test (jit/tests/golden.rs). Run through ./generate, which installs jsonata from npm.
import jsonata from "jsonata";
import { writeFileSync } from "node:fs";

// xorshift32, seeded: the same cases on every run.
let s = 0x9e3779b9;
const rnd = () => {
  s ^= s << 13; s >>>= 0;
  s ^= s >>> 17;
  s ^= s << 5; s >>>= 0;
  return s / 4294967296;
};

const cases = [
  [2.675, 2], [0.125, 2], [0.375, 2], [1.005, 2], [1.015, 2], [2.5, 0], [3.5, 0], [-2.5, 0],
  [-3.5, 0], [0.5, 0], [-0.5, 0], [1250, -2], [1350, -2], [-1250, -2], [2.665, 2],
  [2.66500000001, 2], [0.50000000001, 0], [1e21, 2], [1.5e-7, 7], [2.5e-7, 7], [123.456, -1],
  [9007199254740991, 0], [4503599627370495.5, 0], [-0.0001, 2], [0, 3], [-0, 0], [1e-10, 10],
  [5e-324, 0], [1.7976931348623157e308, -300], [0.045, 2], [0.055, 2], [1.455, 2], [8.345, 2],
];
const precisions = [-3, -2, -1, 0, 1, 2, 3, 4, 6, 10];
for (let i = 0; i < 3000; i++) {
  const p = precisions[Math.floor(rnd() * precisions.length)];
  const kind = i % 4;
  let x;
  if (kind === 0) {
    // A decimal with a 5 just past the precision: a tie in decimal, rarely in binary.
    const digits = Math.max(p + 1, 1);
    const int = Math.floor(rnd() * 100000);
    x = +(`${int}e-${digits - 1}`) + 5 * Math.pow(10, -digits);
    x = +x.toPrecision(15);
  } else if (kind === 1) {
    x = (rnd() - 0.5) * Math.pow(10, Math.floor(rnd() * 12) - 4);
  } else if (kind === 2) {
    x = Math.round((rnd() - 0.5) * 2e6) / 1000;
  } else {
    x = (rnd() - 0.5) * Math.pow(10, Math.floor(rnd() * 40) - 20);
  }
  if (rnd() < 0.5) x = -x;
  cases.push([x, p]);
}

const expr = jsonata("$round(x, p)");
const out = [];
for (const [x, p] of cases) {
  let r = await expr.evaluate({ x, p });
  if (!Number.isFinite(r)) continue;
  out.push([x, p, r]);
}
writeFileSync(
  new URL("./round.json", import.meta.url),
  JSON.stringify({ generator: "jit/golden/round.mjs", jsonata: (await import("jsonata/package.json", { with: { type: "json" } })).default.version, cases: out }) + "\n",
);
console.log(`round.json: ${out.length} cases`);
