// Shared helpers for the MCP end-to-end tests: spawn the real binary behind the official
// TypeScript MCP SDK client, record the wire traffic, validate results with our own Ajv 2020.
//
// VALEM_TRANSPORT picks how the client reaches valem (every test runs unchanged in each mode):
//   stdio  (default) `valem mcp`, the embedded engine, over stdio;
//   http   a fresh `valem serve` per test, reached over Streamable HTTP at /mcp;
//   proxy  a fresh `valem serve` per test, reached through `valem mcp --url` (the stdio proxy).
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { CallToolResultSchema } from '@modelcontextprotocol/sdk/types.js';
import Ajv2020 from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';

export const HERE = path.dirname(fileURLToPath(import.meta.url));
export const REPO = path.resolve(HERE, '..', '..', '..');
export const VALEM_BIN = process.env.VALEM_BIN || path.join(REPO, 'target', 'debug', 'valem');
export const EXAMPLES_DIR = path.join(REPO, 'examples');

export const TRANSPORT = process.env.VALEM_TRANSPORT || 'stdio';
if (!['stdio', 'http', 'proxy'].includes(TRANSPORT)) {
  throw new Error(`VALEM_TRANSPORT must be stdio, http or proxy, not ${JSON.stringify(TRANSPORT)}`);
}

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
}

/**
 * Start `valem serve` on a free loopback port; resolves { url, stop } once it prints its address
 * ("valem serve: listening on http://127.0.0.1:PORT"). `stop()` sends SIGTERM (a graceful drain)
 * and waits for the exit.
 */
export function startDaemon(env) {
  const child = spawn(VALEM_BIN, ['serve', '--listen', '127.0.0.1:0'], {
    env,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stderrText = '';
  child.stderr.on('data', (d) => {
    stderrText += d.toString();
  });
  const exited = new Promise((r) => child.once('exit', r));
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) child.kill('SIGTERM');
    const timer = setTimeout(() => child.kill('SIGKILL'), 10_000);
    await exited;
    clearTimeout(timer);
  };
  return new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`valem serve did not report its address within 15 s; stderr: ${stderrText}`));
    }, 15_000);
    child.stdout.on('data', (d) => {
      out += d.toString();
      const m = out.match(/http:\/\/(127\.0\.0\.1:\d+)/);
      if (m) {
        clearTimeout(timer);
        resolve({ url: `http://${m[1]}`, stop, stderr: () => stderrText });
      }
    });
    child.once('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`valem serve exited (${code}) before listening; stderr: ${stderrText}`));
    });
  });
}

/**
 * Start valem (per VALEM_TRANSPORT) and connect an SDK client. `before(client)` runs before
 * `connect` (to install notification handlers that must see messages sent right after the
 * handshake). Returns { client, transport, stderr(), notifications, waitFor, close }.
 */
export async function connect({ before, listTools = true, env } = {}) {
  await waitForBinary();
  const fullEnv = { ...process.env, ...(env || {}) };
  delete fullEnv.VALEM_API_KEY;
  const daemon = TRANSPORT === 'stdio' ? null : await startDaemon(fullEnv);
  let inner;
  let stderrText = '';
  if (TRANSPORT === 'http') {
    inner = new StreamableHTTPClientTransport(new URL(`${daemon.url}/mcp`));
  } else {
    inner = new StdioClientTransport({
      command: VALEM_BIN,
      args: daemon ? ['mcp', '--url', daemon.url] : ['mcp'],
      stderr: 'pipe',
      env: fullEnv,
    });
    inner.stderr?.on('data', (d) => {
      stderrText += d.toString();
    });
  }
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
  try {
    await client.connect(transport, { timeout: 15_000 });
  } catch (e) {
    await daemon?.stop();
    throw e;
  }
  let tools = null;
  if (listTools) {
    // listTools also makes the SDK cache the output validators that callTool applies.
    tools = (await client.listTools()).tools;
  }
  let closed = false;
  const close = async () => {
    if (closed) return;
    closed = true;
    try {
      // Over HTTP, end the session explicitly (DELETE /mcp) as a well-behaved client does.
      if (TRANSPORT === 'http') await inner.terminateSession().catch(() => {});
      await client.close();
    } finally {
      await daemon?.stop();
    }
  };
  const stderr = () => stderrText + (daemon ? daemon.stderr() : '');
  return { client, transport, tools, stderr, notifications, push, waitFor, close };
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
