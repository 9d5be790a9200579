// Shared helpers for the MCP end-to-end tests: spawn the real binary behind the official
// TypeScript MCP SDK client, record the wire traffic, validate results with our own Ajv 2020.
//
// VALEM_TRANSPORT picks how the client reaches valem (every test runs unchanged in each mode):
//   stdio  (default) `valem mcp`, the embedded engine, over stdio;
//   http   a fresh `valem serve` per test, reached over Streamable HTTP at /mcp;
//   proxy  a fresh `valem serve` per test, reached through `valem mcp --url` (the stdio proxy).
//
// VALEM_ERA picks the MCP protocol era (and the official client that speaks it):
//   legacy (default) the v1 SDK `@modelcontextprotocol/sdk`: the initialize handshake, 2025-11-25;
//   modern the v2 client `@modelcontextprotocol/client` with versionNegotiation {mode: 'auto'}:
//          server/discover, then stateless requests carrying `_meta`; it must settle on 2026-07-28.
// The helpers below (connect, call, ok, fails, rawCall, rawRequest, onNotification, isRpcError, …)
// keep one API for the tests in both eras; era-specific facts are explicit in the tests (ERA).
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import {
  CallToolResultSchema,
  LoggingMessageNotificationSchema,
  McpError,
  ResourceListChangedNotificationSchema,
  ResourceUpdatedNotificationSchema,
  ToolListChangedNotificationSchema,
} from '@modelcontextprotocol/sdk/types.js';
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

export const ERA = process.env.VALEM_ERA || 'legacy';
if (!['legacy', 'modern'].includes(ERA)) {
  throw new Error(`VALEM_ERA must be legacy or modern, not ${JSON.stringify(ERA)}`);
}
export const MODERN = ERA === 'modern';
/** The protocol version each era must negotiate. */
export const LEGACY_VERSION = '2025-11-25';
export const MODERN_VERSION = '2026-07-28';
export const PROTOCOL_VERSION = MODERN ? MODERN_VERSION : LEGACY_VERSION;

// The v2 client is loaded only in the modern era, so the legacy era runs exactly as before.
const v2 = MODERN
  ? { ...(await import('@modelcontextprotocol/client')), ...(await import('@modelcontextprotocol/client/stdio')) }
  : null;

/** The `_meta` keys of the 2026-07-28 per-request envelope. */
export const META = {
  protocolVersion: 'io.modelcontextprotocol/protocolVersion',
  clientInfo: 'io.modelcontextprotocol/clientInfo',
  clientCapabilities: 'io.modelcontextprotocol/clientCapabilities',
  logLevel: 'io.modelcontextprotocol/logLevel',
  serverInfo: 'io.modelcontextprotocol/serverInfo',
  subscriptionId: 'io.modelcontextprotocol/subscriptionId',
};

export const CLIENT_INFO = { name: 'valem-ts-e2e', version: '1.0.0' };

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
 * Modern era: record the traffic of an SDK transport *in place* (its own `send` and `onmessage`
 * slot), because the v2 client treats the transport by its identity: the stdio disposable-sibling
 * probe runs only for the base StdioClientTransport, and the HTTP transport's version slot,
 * stream abort and session id are read on the object itself. A wrapper would change the client's
 * behaviour. Responses to rawExchange() ids are recorded but kept away from the SDK.
 */
class InPlaceRecorder {
  constructor(inner) {
    this.inner = inner;
    this.sent = [];
    this.received = [];
    this.rawWaiters = new Map();
    const rec = this;
    const send = inner.send;
    inner.send = function (m, opts) {
      rec.sent.push(m);
      return send.call(this, m, opts);
    };
    let handler;
    const dispatch = (m, extra) => {
      rec.received.push(m);
      const raw = m && m.id !== undefined && rec.rawWaiters.get(m.id);
      if (raw) {
        rec.rawWaiters.delete(m.id);
        raw(m);
        return undefined;
      }
      return handler?.(m, extra);
    };
    Object.defineProperty(inner, 'onmessage', {
      configurable: true,
      enumerable: true,
      get: () => (handler === undefined ? undefined : dispatch),
      // The SDK saves and restores the slot around its probe: restoring `dispatch` keeps the handler.
      set: (v) => {
        if (v !== dispatch) handler = v;
      },
    });
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
 * Start valem (per VALEM_TRANSPORT) and connect an SDK client (per VALEM_ERA). `before(client, push)`
 * runs before `connect` (to install notification handlers that must see messages sent right after
 * the handshake). `daemon` reuses a running `valem serve` (from startDaemon; http/proxy only) instead
 * of starting one: it is then left running at close. Returns { client, transport, inner, tools,
 * stderr(), notifications, waitFor, close, era, daemon }; `transport.sent`/`transport.received` hold
 * the JSON-RPC messages of the session in both directions.
 */
export async function connect({ before, listTools = true, env, daemon: shared } = {}) {
  await waitForBinary();
  const fullEnv = { ...process.env, ...(env || {}) };
  delete fullEnv.VALEM_API_KEY;
  if (shared && TRANSPORT === 'stdio') throw new Error('a shared daemon needs VALEM_TRANSPORT http or proxy');
  const daemon = TRANSPORT === 'stdio' ? null : shared || (await startDaemon(fullEnv));
  const stopDaemon = async () => {
    if (daemon && !shared) await daemon.stop();
  };
  const sdk = MODERN
    ? { Client: v2.Client, Stdio: v2.StdioClientTransport, Http: v2.StreamableHTTPClientTransport }
    : { Client, Stdio: StdioClientTransport, Http: StreamableHTTPClientTransport };
  let inner;
  let stderrText = '';
  if (TRANSPORT === 'http') {
    inner = new sdk.Http(new URL(`${daemon.url}/mcp`));
  } else {
    inner = new sdk.Stdio({
      command: VALEM_BIN,
      args: daemon ? ['mcp', '--url', daemon.url] : ['mcp'],
      stderr: 'pipe',
      env: fullEnv,
    });
    inner.stderr?.on('data', (d) => {
      stderrText += d.toString();
    });
  }
  const recorder = MODERN ? new InPlaceRecorder(inner) : new RecordingTransport(inner);
  const transport = MODERN ? inner : recorder;
  const client = MODERN
    ? new sdk.Client(CLIENT_INFO, { capabilities: {}, versionNegotiation: { mode: 'auto' } })
    : new sdk.Client(CLIENT_INFO, { capabilities: {} });

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
  try {
    if (before) await before(client, push);
    await client.connect(transport, { timeout: 15_000 });
  } catch (e) {
    await stopDaemon();
    throw e;
  }
  const listens = [];
  let closed = false;
  const close = async () => {
    if (closed) return;
    closed = true;
    try {
      for (const sub of listens) await sub.close().catch(() => {});
      // Over HTTP, end the session explicitly (DELETE /mcp) as a well-behaved client does.
      // (The modern era has no session to end.)
      if (TRANSPORT === 'http' && !MODERN) await inner.terminateSession().catch(() => {});
      await client.close();
    } finally {
      await stopDaemon();
    }
  };
  if (MODERN) {
    // The era is the point of this mode: the v2 client must have settled on 2026-07-28.
    try {
      assert.equal(client.getNegotiatedProtocolVersion(), MODERN_VERSION, 'auto negotiation settles on 2026-07-28');
      assert.equal(client.getProtocolEra(), 'modern');
    } catch (e) {
      await close();
      throw e;
    }
  }
  let tools = null;
  if (listTools) {
    // listTools also makes the SDK cache the output validators that callTool applies.
    tools = (await client.listTools()).tools;
  }
  const stderr = () => stderrText + (daemon ? daemon.stderr() : '');
  return {
    client,
    transport: recorder,
    inner,
    tools,
    stderr,
    notifications,
    push,
    waitFor,
    close,
    era: ERA,
    daemon,
    listens,
  };
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
  const result = MODERN
    ? await s.client.callTool({ name, arguments: args }, { timeout: 30_000 })
    : await s.client.callTool({ name, arguments: args }, undefined, { timeout: 30_000 });
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
  const result = MODERN
    ? await s.client.request({ method: 'tools/call', params: { name, arguments: args } }, { timeout: 30_000 })
    : await s.client.request(
      { method: 'tools/call', params: { name, arguments: args } },
      CallToolResultSchema,
      { timeout: 30_000 },
    );
  const json = checkEnvelope(s.tools, name, result);
  return { result, json };
}

// --- era-neutral protocol helpers -------------------------------------------------------------

/**
 * The JSON-RPC error a rejected SDK call carries, as { code, message, data, httpStatus? }, or
 * undefined when it is no JSON-RPC error. v1: McpError. v2: ProtocolError (and its subclasses such as
 * ResourceNotFoundError); over Streamable HTTP the 2026-07-28 server answers an unknown method with
 * `404 Not Found` + a JSON-RPC error body (transports spec, "Protocol Version Header"), which the v2
 * client 2.4.0 surfaces as an SdkHttpError (it lifts only 400 bodies in-band): its body is decoded here.
 */
export function rpcErrorOf(e) {
  if (MODERN ? e instanceof v2.ProtocolError : e instanceof McpError) {
    return { code: e.code, message: e.message, data: e.data };
  }
  if (MODERN && e instanceof v2.SdkHttpError && typeof e.data?.text === 'string') {
    let body;
    try {
      body = JSON.parse(e.data.text);
    } catch {
      return undefined;
    }
    if (body?.jsonrpc === '2.0' && body.error && typeof body.error.code === 'number') {
      return { code: body.error.code, message: body.error.message, data: body.error.data, httpStatus: e.data.status };
    }
  }
  return undefined;
}

/** A JSON-RPC error surfaced by the SDK (see rpcErrorOf), optionally with `code`. */
export function isRpcError(e, code) {
  const r = rpcErrorOf(e);
  return r !== undefined && (code === undefined || r.code === code);
}

/**
 * An assert.rejects predicate: a JSON-RPC error with `code` (message shown on mismatch); `message`
 * (a RegExp) must match its message. An error that came as an HTTP status must have the status
 * the 2026-07-28 Streamable HTTP binding gives it (404 for -32601).
 */
export function rpcError(code, message) {
  return (e) => {
    const r = rpcErrorOf(e);
    assert.ok(r, `a JSON-RPC error, got ${e?.constructor?.name}: ${e?.message}`);
    assert.equal(r.code, code, `error code (message: ${r.message})`);
    if (message) assert.match(r.message, message);
    if (r.httpStatus !== undefined && code === -32601) assert.equal(r.httpStatus, 404, 'method not found is HTTP 404');
    return true;
  };
}

// v1 notification schemas by method (the v2 client takes the method name itself).
const V1_NOTIFICATION_SCHEMAS = {
  'notifications/message': LoggingMessageNotificationSchema,
  'notifications/resources/updated': ResourceUpdatedNotificationSchema,
  'notifications/resources/list_changed': ResourceListChangedNotificationSchema,
  'notifications/tools/list_changed': ToolListChangedNotificationSchema,
};

/** Install a notification handler for a spec notification `method` on either SDK's client. */
export function onNotification(client, method, handler) {
  if (MODERN) {
    client.setNotificationHandler(method, handler);
  } else {
    const schema = V1_NOTIFICATION_SCHEMAS[method];
    if (!schema) throw new Error(`no v1 schema mapped for ${method}`);
    client.setNotificationHandler(schema, handler);
  }
}

// A result schema that accepts anything (Standard Schema v1), for non-spec methods on the v2 client.
const ANY_RESULT = { '~standard': { version: 1, vendor: 'valem-ts-e2e', validate: (value) => ({ value }) } };

/**
 * A request through the SDK's raw request API. `legacySchema` is the v1 result schema (required
 * there); the v2 client resolves spec methods itself, and non-spec methods get a pass-through schema.
 */
export function rawRequest(s, method, params = {}, legacySchema, options = { timeout: 30_000 }) {
  if (!MODERN) return s.client.request({ method, params }, legacySchema, options);
  const spec = ['prompts/list', 'tools/call', 'tools/list', 'resources/read', 'resources/list', 'server/discover'];
  return spec.includes(method)
    ? s.client.request({ method, params }, options)
    : s.client.request({ method, params }, ANY_RESULT, options);
}

/** The modern per-request `_meta` envelope (as the v2 client sends it). */
export function modernEnvelope(extra = {}) {
  return {
    [META.protocolVersion]: MODERN_VERSION,
    [META.clientInfo]: CLIENT_INFO,
    [META.clientCapabilities]: {},
    ...extra,
  };
}

let rawIds = 0;
/**
 * Modern era only: one JSON-RPC request written straight onto the session's transport (with the
 * modern `_meta` envelope unless `envelope: false`), bypassing the SDK's own era gate, which refuses
 * to send methods the 2026-07-28 era removed. Resolves with the raw response message
 * ({id, result} | {id, error}); over HTTP, an error the transport raised as a non-2xx status
 * resolves as its JSON-RPC body plus `httpStatus`, or as { httpError: { status, text } }.
 */
export async function rawExchange(s, method, params = {}, { envelope = true, ms = 10_000 } = {}) {
  assert.ok(MODERN, 'rawExchange is for the modern era');
  const id = `valem-raw-${++rawIds}`;
  const rec = s.transport;
  const reply = new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      rec.rawWaiters.delete(id);
      reject(new Error(`no response to raw ${method} (${id}) within ${ms} ms`));
    }, ms);
    rec.rawWaiters.set(id, (m) => {
      clearTimeout(timer);
      resolve(m);
    });
  });
  const message = { jsonrpc: '2.0', id, method, params: envelope ? { ...params, _meta: modernEnvelope(params._meta) } : params };
  try {
    await s.inner.send(message);
  } catch (e) {
    rec.rawWaiters.delete(id);
    reply.catch(() => {});
    if (e?.data?.status === undefined) throw e;
    const { status, text } = e.data;
    try {
      const body = JSON.parse(text);
      if (body?.jsonrpc === '2.0' && body.id === id) return { ...body, httpStatus: status };
    } catch {
      // not JSON: reported as it is below
    }
    return { httpError: { status, text } };
  }
  return reply;
}

/**
 * Modern era only: open a `subscriptions/listen` stream (v2 `client.listen`); it is closed with
 * the session. Returns the subscription ({ honoredFilter, close(), closed }) plus `id`, the listen
 * request's JSON-RPC id (every notification of the stream carries it as its subscriptionId).
 */
export async function listen(s, filter) {
  assert.ok(MODERN, 'subscriptions/listen is a 2026-07-28 method');
  const before = s.transport.sent.length;
  const sub = await s.client.listen(filter, { timeout: 10_000 });
  s.listens.push(sub);
  const req = s.transport.sent.slice(before).find((m) => m.method === 'subscriptions/listen');
  assert.ok(req, 'the listen request is on the wire');
  return Object.assign(sub, { id: req.id });
}

/**
 * The raw notifications/resources/updated messages received for `uri`, optionally only those
 * carrying the subscription id `subId` in `_meta` (read from the wire, before the SDK lifts `_meta`).
 */
export function rawUpdates(s, uri, subId) {
  return s.transport.received.filter(
    (m) => m.method === 'notifications/resources/updated' && m.params?.uri === uri
      && (subId === undefined || m.params?._meta?.[META.subscriptionId] === subId),
  );
}

/** A write through the daemon's REST API: POST /models/{id}/mutations with a flat `{"$.path": value}` body. */
export async function restMutate(daemon, id, mutations) {
  const res = await fetch(`${daemon.url}/models/${encodeURIComponent(id)}/mutations`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(mutations),
  });
  const text = await res.text();
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    body = text;
  }
  return { status: res.status, body };
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
