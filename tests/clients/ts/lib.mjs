// Shared helpers for the `valem mcp` end-to-end tests: spawn the real binary behind the official
// TypeScript MCP SDK client, record the wire traffic, validate results with our own Ajv 2020.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { CallToolResultSchema } from '@modelcontextprotocol/sdk/types.js';
import Ajv2020 from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';

export const HERE = path.dirname(fileURLToPath(import.meta.url));
export const REPO = path.resolve(HERE, '..', '..', '..');
export const VALEM_BIN = process.env.VALEM_BIN || path.join(REPO, 'target', 'debug', 'valem');
export const EXAMPLES_DIR = path.join(REPO, 'examples');

/** Per-test timeout (ms) for node:test. */
export const TEST_TIMEOUT = 60_000;

/** A fresh Ajv for draft 2020-12 (strict off: tool schemas carry descriptions, `title`, …). */
export function newAjv() {
  const ajv = new Ajv2020({ strict: false, allErrors: true, validateFormats: true });
  addFormats(ajv);
  return ajv;
}

/** Compile a schema with a fresh Ajv 2020 (throws with a readable message if it does not compile). */
export function compile(schema) {
  return newAjv().compile(schema);
}

export function ajvErrors(validate) {
  return JSON.stringify(validate.errors, null, 1);
}

/** Wait (polling the file system, not sleeping blindly) until the binary exists: it is rebuilt now and then. */
async function waitForBinary(deadlineMs = 120_000) {
  const until = Date.now() + deadlineMs;
  for (;;) {
    try {
      fs.accessSync(VALEM_BIN, fs.constants.X_OK);
      return;
    } catch {
      if (Date.now() > until) throw new Error(`VALEM_BIN ${VALEM_BIN} is missing or not executable`);
      await new Promise((r) => setTimeout(r, 500));
    }
  }
}

/**
 * A transport wrapper that records every JSON-RPC message in both directions
 * (so a test can see the exact initialize exchange), forwarding everything else.
 */
class RecordingTransport {
  constructor(inner) {
    this.inner = inner;
    this.sent = [];
    this.received = [];
    inner.onmessage = (m) => {
      this.received.push(m);
      this.onmessage?.(m);
    };
    inner.onerror = (e) => this.onerror?.(e);
    inner.onclose = () => this.onclose?.();
  }
  start() {
    return this.inner.start();
  }
  send(m, opts) {
    this.sent.push(m);
    return this.inner.send(m, opts);
  }
  close() {
    return this.inner.close();
  }
  get stderr() {
    return this.inner.stderr;
  }
  get pid() {
    return this.inner.pid;
  }
}

/**
 * Spawn `valem mcp` and connect an SDK client. `before(client)` runs before `connect` (to install
 * notification handlers that must see messages sent right after the handshake).
 * Returns { client, transport, stderr(), notifications, waitFor, close }.
 */
export async function connect({ before, listTools = true, env } = {}) {
  await waitForBinary();
  const inner = new StdioClientTransport({
    command: VALEM_BIN,
    args: ['mcp'],
    stderr: 'pipe',
    env: { ...process.env, ...(env || {}) },
  });
  let stderrText = '';
  inner.stderr?.on('data', (d) => {
    stderrText += d.toString();
  });
  const transport = new RecordingTransport(inner);
  const client = new Client({ name: 'valem-ts-e2e', version: '1.0.0' }, { capabilities: {} });

  // Every notification, in arrival order, plus waiters for a predicate over them.
  const notifications = [];
  const waiters = [];
  const push = (n) => {
    notifications.push(n);
    for (const w of [...waiters]) {
      if (w.pred(n)) {
        waiters.splice(waiters.indexOf(w), 1);
        clearTimeout(w.timer);
        w.resolve(n);
      }
    }
  };
  client.fallbackNotificationHandler = async (n) => push(n);
  const waitFor = (pred, ms = 10_000, what = 'notification') => {
    const hit = notifications.find(pred);
    if (hit) return Promise.resolve(hit);
    return new Promise((resolve, reject) => {
      const w = { pred, resolve };
      w.timer = setTimeout(() => {
        waiters.splice(waiters.indexOf(w), 1);
        reject(new Error(`timed out after ${ms} ms waiting for ${what}; got ${JSON.stringify(notifications)}`));
      }, ms);
      waiters.push(w);
    });
  };
  if (before) await before(client, push);
  await client.connect(transport, { timeout: 15_000 });
  let tools = null;
  if (listTools) {
    // listTools also makes the SDK cache the output validators that callTool applies.
    tools = (await client.listTools()).tools;
  }
  let closed = false;
  const close = async () => {
    if (closed) return;
    closed = true;
    await client.close();
  };
  return { client, transport, tools, stderr: () => stderrText, notifications, push, waitFor, close };
}

/** Run `fn(session)` against a fresh server, always closing it. */
export async function withServer(fn, opts) {
  const s = await connect(opts);
  try {
    return await fn(s);
  } finally {
    await s.close();
  }
}

/** The parsed JSON of a result's single text block. */
export function textJson(result) {
  assert.ok(Array.isArray(result.content) && result.content.length >= 1, 'result has a content block');
  const block = result.content[0];
  assert.equal(block.type, 'text');
  return JSON.parse(block.text);
}

const validatorCache = new Map();
function outputValidator(tool) {
  if (!validatorCache.has(tool)) validatorCache.set(tool, compile(tool.outputSchema));
  return validatorCache.get(tool);
}

/**
 * Check the envelope rules of the contract on any tools/call result:
 *  - one text block; for an object result structuredContent equals the parsed text;
 *  - array/scalar results have no structuredContent;
 *  - successful structuredContent validates (our Ajv 2020) against the tool's outputSchema.
 */
export function checkEnvelope(tools, name, result) {
  assert.equal(typeof result.isError, 'boolean', `${name}: isError is a boolean`);
  assert.equal(result.content.length, 1, `${name}: exactly one content block`);
  assert.equal(result.content[0].type, 'text');
  let parsed;
  try {
    parsed = JSON.parse(result.content[0].text);
  } catch {
    parsed = undefined; // a plain-message failure
  }
  if (parsed !== null && typeof parsed === 'object' && !Array.isArray(parsed)) {
    if (!(result.isError && parsed.error === 'Result too large')) {
      assert.deepEqual(result.structuredContent, parsed, `${name}: structuredContent equals the parsed text block`);
    }
  } else {
    assert.equal(result.structuredContent, undefined, `${name}: no structuredContent for a non-object result`);
  }
  const tool = tools?.find((t) => t.name === name);
  if (tool?.outputSchema && !result.isError) {
    assert.ok(result.structuredContent, `${name}: has outputSchema so a success carries structuredContent`);
    const v = outputValidator(tool);
    assert.ok(v(result.structuredContent), `${name}: structuredContent matches outputSchema: ${ajvErrors(v)}`);
  }
  return parsed;
}

/**
 * Call a tool through the SDK's own callTool (which validates structuredContent against the
 * outputSchema), then apply checkEnvelope. Returns { result, json }.
 */
export async function call(s, name, args = {}) {
  const result = await s.client.callTool({ name, arguments: args }, undefined, { timeout: 30_000 });
  const json = checkEnvelope(s.tools, name, result);
  return { result, json };
}

/** A successful call: isError false; returns the parsed JSON. */
export async function ok(s, name, args = {}) {
  const { result, json } = await call(s, name, args);
  assert.equal(result.isError, false, `${name} should succeed, got: ${result.content?.[0]?.text}`);
  return json;
}

/** A failing call (tool-level): isError true with a non-empty message; returns { result, json, text }. */
export async function fails(s, name, args = {}) {
  const { result, json } = await call(s, name, args);
  assert.equal(result.isError, true, `${name} should fail, got: ${result.content?.[0]?.text}`);
  const text = result.content[0].text;
  assert.ok(text.length > 0, `${name}: failure has a message`);
  return { result, json, text };
}

/**
 * tools/call over the raw request API (still through the SDK transport and CallToolResultSchema),
 * bypassing the SDK's client-side outputSchema check, so the server's structured failure bodies
 * can be inspected even where the SDK's callTool would refuse them.
 */
export async function rawCall(s, name, args = {}) {
  const result = await s.client.request(
    { method: 'tools/call', params: { name, arguments: args } },
    CallToolResultSchema,
    { timeout: 30_000 },
  );
  const json = checkEnvelope(s.tools, name, result);
  return { result, json };
}

// --- fixtures ------------------------------------------------------------------------------

/** The contract's worked-example spec, verbatim. */
export const WORKED_DEMO = {
  id: 'demo',
  version: '1',
  schema: {},
  derivations: [{ path: '$.total', expr: 'price * qty' }],
  constraints: [],
  metaDerivations: [],
  tests: [],
};

/** A small shop spec with a schema, a rollback and a flag constraint, a view and a library. */
export function shopSpec(id = 'shop') {
  return {
    id,
    version: '1.0.0',
    schema: {
      type: 'object',
      properties: {
        price: { type: 'number', minimum: 0 },
        qty: { type: 'integer', minimum: 0 },
        total: { type: 'number', readOnly: true },
        items: { type: 'array', items: { type: 'string' } },
        note: { type: 'string' },
        attachment: { type: 'string' },
      },
    },
    library: '( $money := function($n) { $round($n, 2) }; ["money"] )',
    derivations: [{ path: '$.total', expr: '$money(price * qty)' }],
    constraints: [
      { id: 'cap', expr: 'total = null or total <= 1000', message: 'The total may not exceed 1000', policy: 'rollback' },
      { id: 'bulk', expr: 'qty = null or qty < 50', message: 'Bulk order: check stock', policy: 'flag' },
    ],
    tests: [{ description: 'two at 2.5', given: { '$.price': 2.5, '$.qty': 2 }, expect: { '$.total': 5 } }],
    viewDefinition: {
      defaultView: 'main',
      views: [
        {
          id: 'main',
          label: 'Shop',
          components: [
            { id: 'priceField', type: 'numericField', label: 'Price', bind: '$.price' },
            { id: 'qtyField', type: 'numericField', label: 'Quantity', bind: '$.qty' },
            { id: 'totalField', type: 'numericField', label: 'Total', bind: '$.total', readOnly: true },
          ],
        },
      ],
    },
  };
}

export function loadExamples() {
  return fs
    .readdirSync(EXAMPLES_DIR)
    .filter((f) => f.endsWith('.json'))
    .sort()
    .map((f) => ({ file: f, name: f.replace(/\.json$/, ''), spec: JSON.parse(fs.readFileSync(path.join(EXAMPLES_DIR, f), 'utf8')) }));
}
