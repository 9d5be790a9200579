// Handshake (legacy: initialize; modern: server/discover), capabilities, logging, protocol-level
// errors, tool catalog and schemas.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import {
  LATEST_PROTOCOL_VERSION,
  ListPromptsResultSchema,
  EmptyResultSchema,
} from '@modelcontextprotocol/sdk/types.js';

import {
  connect, withServer, compile, ajvErrors, loadExamples, ok, onNotification, rawRequest, rawExchange, rpcError,
  TEST_TIMEOUT, WORKED_DEMO, MODERN, TRANSPORT, MODERN_VERSION, META, CLIENT_INFO,
} from '../lib.mjs';

const METHOD_NOT_FOUND = -32601;
const INVALID_PARAMS = -32602;
const LEGACY_ONLY = MODERN && 'legacy era only (2025-11-25): the 2026-07-28 era has no such method';
const MODERN_ONLY = !MODERN && 'modern era only (2026-07-28): run with VALEM_ERA=modern';

/** The connection still answers: legacy a ping; modern (no ping any more) a tools/call round trip. */
async function stillUsable(s) {
  if (MODERN) assert.ok(Array.isArray(await ok(s, 'list_models')), 'list_models answers');
  else assert.deepEqual(await s.client.ping(), {});
}

const TOOL_NAMES = [
  'list_models', 'create_model', 'get_model_info', 'get_spec', 'get_state', 'get_field',
  'get_effective_schema', 'mutate', 'patch_model', 'explain', 'get_history', 'get_audit',
  'verify_audit', 'snapshot', 'restore', 'evolve_spec', 'delete_model', 'get_view', 'get_library',
  'upload_blob', 'download_blob', 'get_domain_guidance', 'validate_spec', 'eval_expression',
  'test_spec', 'dry_run',
];

// The contract's (and reference-facts') required arguments; everything else is optional.
const REQUIRED_ARGS = {
  list_models: [],
  create_model: ['spec'],
  get_model_info: ['id'],
  get_spec: ['id'],
  get_state: ['id'],
  get_field: ['id', 'path'],
  get_effective_schema: ['id', 'path'],
  mutate: ['id', 'mutations'],
  patch_model: ['id', 'patch'],
  explain: ['id', 'path'],
  get_history: ['id'],
  get_audit: ['id'],
  verify_audit: ['id'],
  snapshot: ['id'],
  restore: ['id', 'snapshot'],
  evolve_spec: ['id', 'evolution'],
  delete_model: ['id'],
  get_view: ['id'],
  get_library: ['id'],
  upload_blob: ['data'],
  download_blob: ['blobId'],
  get_domain_guidance: ['topics'],
  validate_spec: ['spec'],
  eval_expression: ['expr'],
  test_spec: ['spec'],
  dry_run: ['spec'],
};

// Realistic minimal calls an agent makes (only the required arguments): each must satisfy the
// tool's own inputSchema, or a schema-following client/LLM is forced to invent optional values.
const MINIMAL_CALLS = {
  list_models: {},
  create_model: { spec: WORKED_DEMO },
  get_model_info: { id: 'demo' },
  get_spec: { id: 'demo' },
  get_state: { id: 'demo' },
  get_field: { id: 'demo', path: '$.total' },
  get_effective_schema: { id: 'demo', path: '$.price' },
  mutate: { id: 'demo', mutations: { '$.price': 10, '$.qty': 3 } },
  patch_model: { id: 'demo', patch: [{ op: 'replace', path: '/qty', value: 4 }] },
  explain: { id: 'demo', path: '$.total' },
  get_history: { id: 'demo' },
  get_audit: { id: 'demo' },
  verify_audit: { id: 'demo' },
  snapshot: { id: 'demo' },
  restore: { id: 'demo', snapshot: { modelId: 'demo', modelVersion: '1', baseDoc: {}, derivedCache: {}, metaCache: {} } },
  evolve_spec: { id: 'demo', evolution: { expectedVersion: '1', newVersion: '1.1.0' } },
  delete_model: { id: 'demo' },
  get_view: { id: 'demo' },
  get_library: { id: 'demo' },
  upload_blob: { data: 'aGVsbG8=' },
  download_blob: { blobId: 'abc' },
  get_domain_guidance: { topics: ['percentage'] },
  validate_spec: { spec: WORKED_DEMO },
  eval_expression: { expr: '1 + 1' },
  test_spec: { spec: WORKED_DEMO },
  dry_run: { spec: WORKED_DEMO },
};

const READ_ONLY = [
  'list_models', 'get_model_info', 'get_spec', 'get_state', 'get_field', 'get_effective_schema',
  'explain', 'get_history', 'get_audit', 'get_view', 'get_library', 'get_domain_guidance',
];
const DESTRUCTIVE = ['delete_model', 'evolve_spec'];
const WITH_OUTPUT_SCHEMA = ['mutate', 'patch_model', 'create_model', 'get_model_info', 'validate_spec', 'test_spec', 'eval_expression'];
const WITHOUT_OUTPUT_SCHEMA = ['list_models', 'get_history', 'explain', 'get_field'];

const GUIDANCE_TOPICS = [
  'amortization_schedule', 'group_by', 'date_math', 'classification', 'currency_conversion', 'status_field',
  'rank_percentile', 'regulated_charge', 'percentage', 'unit_conversion', 'compound_growth', 'weighted_average',
  'eligibility', 'proration',
];

/** The facts both handshakes establish: identity, capabilities, instructions. */
function checkServerFacts(s) {
  const info = s.client.getServerVersion();
  assert.ok(info, 'the server identifies itself');
  assert.equal(info.name, 'valem');
  assert.equal(typeof info.version, 'string');
  assert.ok(info.version.length > 0);

  const caps = s.client.getServerCapabilities();
  assert.ok(caps.tools, 'tools capability');
  assert.equal(caps.resources?.subscribe, true, 'resources.subscribe');
  assert.ok(caps.logging, 'logging capability');
  assert.equal(caps.prompts, undefined, 'no prompts capability');

  const instructions = s.client.getInstructions();
  assert.equal(typeof instructions, 'string');
  assert.ok(instructions.length > 100, 'instructions present');
  for (const word of ['create_model', 'mutate', 'get_state', 'explain', 'evolve_spec']) {
    assert.ok(instructions.includes(word), `instructions mention ${word}`);
  }
}

test('initialize: 2025-11-25 negotiated, server valem, tools + resources.subscribe + logging, no prompts, instructions', { timeout: TEST_TIMEOUT, skip: MODERN && 'legacy era only: the 2026-07-28 era has no initialize handshake (see the server/discover test)' }, async () => {
  await withServer(async (s) => {
    assert.equal(LATEST_PROTOCOL_VERSION, '2025-11-25', 'the pinned SDK speaks 2025-11-25');
    const init = s.transport.sent.find((m) => m.method === 'initialize');
    assert.equal(init.params.protocolVersion, '2025-11-25');
    assert.equal(init.params.clientInfo.name, 'valem-ts-e2e');
    const reply = s.transport.received.find((m) => m.id === init.id);
    assert.ok(reply.result, `initialize succeeded: ${JSON.stringify(reply)}`);
    assert.equal(reply.result.protocolVersion, '2025-11-25');
    assert.ok(s.transport.sent.some((m) => m.method === 'notifications/initialized'));

    checkServerFacts(s);
    // ping works after the handshake
    assert.deepEqual(await s.client.ping(), {});
  }, { listTools: false });
});

test('server/discover: 2026-07-28 negotiated (auto), server valem, tools + resources.subscribe + logging, no prompts, instructions; stateless requests with _meta', { timeout: TEST_TIMEOUT, skip: MODERN_ONLY }, async () => {
  await withServer(async (s) => {
    // connect() already asserted getNegotiatedProtocolVersion() === 2026-07-28 (era modern).
    const discovered = s.client.getDiscoverResult();
    assert.ok(discovered, 'the client adopted a server/discover result');
    assert.ok(discovered.supportedVersions.includes(MODERN_VERSION), `supportedVersions ${JSON.stringify(discovered.supportedVersions)}`);
    checkServerFacts(s);

    // No handshake on the session: no initialize, no notifications/initialized, no session id.
    assert.ok(!s.transport.sent.some((m) => m.method === 'initialize'), 'no initialize on a modern session');
    assert.ok(!s.transport.sent.some((m) => m.method === 'notifications/initialized'), 'no notifications/initialized');
    if (TRANSPORT === 'http') {
      // The probe goes in place over HTTP: it is the session's first message.
      assert.equal(s.transport.sent[0]?.method, 'server/discover', 'the HTTP probe is the first request');
      assert.equal(s.inner.sessionId, undefined, 'no Mcp-Session-Id in the modern era');
    } else {
      // stdio: the SDK probes on a disposable sibling process, so this process's very first
      // request is an ordinary one, with no discover before it.
      assert.ok(!s.transport.sent.some((m) => m.method === 'server/discover'), 'the session process saw no probe');
    }

    // server/discover on the live connection, read raw from the wire.
    const before = s.transport.sent.length;
    await s.client.discover();
    const req = s.transport.sent.slice(before).find((m) => m.method === 'server/discover');
    const reply = s.transport.received.find((m) => m.id === req.id);
    assert.ok(reply?.result, `server/discover succeeded: ${JSON.stringify(reply)}`);
    const r = reply.result;
    assert.equal(r.resultType, 'complete');
    assert.ok(r.supportedVersions.includes(MODERN_VERSION));
    assert.equal(typeof r.capabilities, 'object');
    assert.ok(Number.isInteger(r.ttlMs) && r.ttlMs >= 0, `ttlMs ${r.ttlMs}`);
    assert.ok(['public', 'private'].includes(r.cacheScope), `cacheScope ${r.cacheScope}`);
    assert.equal(r._meta?.[META.serverInfo]?.name, 'valem', 'serverInfo in _meta');

    // A few ordinary requests: every one carries the envelope, every result a resultType, and the
    // list/read results their cache hints.
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    await s.client.listTools(undefined, { cacheMode: 'bypass' });
    await s.client.listResources(undefined, { cacheMode: 'bypass' });
    await s.client.listResourceTemplates(undefined, { cacheMode: 'bypass' });
    await s.client.readResource({ uri: 'valem://state/demo' }, { cacheMode: 'bypass' });
    const requests = s.transport.sent.filter((m) => m.method && m.id !== undefined);
    assert.ok(requests.length >= 6);
    for (const m of requests) {
      const meta = m.params?._meta;
      assert.equal(meta?.[META.protocolVersion], MODERN_VERSION, `${m.method} carries protocolVersion`);
      assert.equal(meta?.[META.clientInfo]?.name, CLIENT_INFO.name, `${m.method} carries clientInfo`);
      assert.equal(typeof meta?.[META.clientCapabilities], 'object', `${m.method} carries clientCapabilities`);
    }
    const cacheable = ['tools/list', 'resources/list', 'resources/templates/list', 'resources/read'];
    for (const m of requests) {
      const res = s.transport.received.find((x) => x.id === m.id);
      assert.ok(res?.result, `${m.method} answered with a result: ${JSON.stringify(res)}`);
      assert.equal(typeof res.result.resultType, 'string', `${m.method} result has resultType`);
      if (cacheable.includes(m.method)) {
        assert.ok(Number.isInteger(res.result.ttlMs) && res.result.ttlMs >= 0, `${m.method} ttlMs`);
        assert.ok(['public', 'private'].includes(res.result.cacheScope), `${m.method} cacheScope`);
      }
    }
  }, { listTools: false });
});

test('2026-07-28 removed ping, logging/setLevel, resources/subscribe|unsubscribe: method not found on a modern request', { timeout: TEST_TIMEOUT, skip: MODERN_ONLY }, async () => {
  await withServer(async (s) => {
    // The v2 SDK refuses to send them itself, so they go onto the transport raw, with the envelope.
    const removed = [
      ['ping', {}],
      ['logging/setLevel', { level: 'debug' }],
      ['resources/subscribe', { uri: 'valem://state/demo' }],
      ['resources/unsubscribe', { uri: 'valem://state/demo' }],
    ];
    for (const [method, params] of removed) {
      const reply = await rawExchange(s, method, params);
      assert.ok(reply.error, `${method}: an error, got ${JSON.stringify(reply)}`);
      assert.equal(reply.error.code, METHOD_NOT_FOUND, `${method}: ${reply.error.message}`);
      if (TRANSPORT === 'http') assert.equal(reply.httpStatus, 404, `${method}: HTTP 404 for an unknown method`);
    }
    await stillUsable(s);
  }, { listTools: false });
});

test('prompts/list is a JSON-RPC method-not-found (no prompts offered)', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    // The SDK refuses prompts/list client-side without the capability; go through request() raw
    // with capability enforcement off (the default) to see the server's own answer.
    await assert.rejects(rawRequest(s, 'prompts/list', {}, ListPromptsResultSchema), rpcError(METHOD_NOT_FOUND));
  }, { listTools: false });
});

test('logging: a notifications/message arrives after connect; setLoggingLevel succeeds', { timeout: TEST_TIMEOUT, skip: LEGACY_ONLY }, async () => {
  const logs = [];
  let resolveFirst;
  const first = new Promise((r) => (resolveFirst = r));
  const s = await connect({
    listTools: false,
    before: (client) => {
      onNotification(client, 'notifications/message', (n) => {
        logs.push(n.params);
        resolveFirst(n.params);
      });
    },
  });
  try {
    const msg = await Promise.race([
      first,
      new Promise((_, rej) => setTimeout(() => rej(new Error('no notifications/message within 10 s of connect')), 10_000)),
    ]);
    assert.ok(['debug', 'info', 'notice'].includes(msg.level), `readiness log level: ${msg.level}`);
    assert.ok(msg.data !== undefined, 'log has data');
    assert.match(JSON.stringify(msg.data), /ready|valem/i);

    for (const level of ['debug', 'warning', 'error', 'info']) {
      assert.deepEqual(await s.client.setLoggingLevel(level), {});
    }
    // an unknown level is a JSON-RPC invalid-params error
    await assert.rejects(s.client.setLoggingLevel('loud'), rpcError(INVALID_PARAMS));
  } finally {
    await s.close();
  }
});

test('logging (2026-07-28): no notifications/message unasked; per-request _meta logLevel; an unknown level is -32602', { timeout: TEST_TIMEOUT, skip: MODERN_ONLY }, async () => {
  await withServer(async (s) => {
    // Requests without a logLevel: the server must not log to us (the legacy era's readiness
    // message after connect is gone too).
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    await ok(s, 'mutate', { id: 'demo', mutations: { '$.price': 10, '$.qty': 3 } });
    await ok(s, 'list_models');
    assert.deepEqual(s.transport.received.filter((m) => m.method === 'notifications/message'), [], 'no log without a logLevel');

    for (const level of ['debug', 'info', 'notice', 'warning', 'error', 'critical', 'alert', 'emergency']) {
      const r = await s.client.callTool({ name: 'list_models', arguments: {}, _meta: { [META.logLevel]: level } });
      assert.equal(r.isError, false, `logLevel ${level} accepted`);
    }
    await assert.rejects(
      s.client.callTool({ name: 'list_models', arguments: {}, _meta: { [META.logLevel]: 'loud' } }),
      rpcError(INVALID_PARAMS, /loud/),
    );
    await stillUsable(s);
  });
});

test('unknown tool: the SDK rejects callTool with a JSON-RPC error -32602 (invalid params)', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    await assert.rejects(s.client.callTool({ name: 'no_such_tool', arguments: {} }), rpcError(INVALID_PARAMS, /no_such_tool/));
    // the session is still usable afterwards
    await stillUsable(s);
  });
});

test('unknown JSON-RPC method → -32601 method not found', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    await assert.rejects(rawRequest(s, 'valem/does-not-exist', {}, EmptyResultSchema), rpcError(METHOD_NOT_FOUND));
  }, { listTools: false });
});

test('close: the server exits promptly when stdin reaches EOF', { timeout: TEST_TIMEOUT }, async () => {
  const s = await connect({ listTools: false });
  const t0 = Date.now();
  await s.close();
  // StdioClientTransport waits up to 2 s for exit before SIGTERM.
  assert.ok(Date.now() - t0 < 1900, `close took ${Date.now() - t0} ms`);
});

test('listTools: exactly the 26 tools, each with a title and annotations', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    const names = s.tools.map((t) => t.name);
    assert.deepEqual([...names].sort(), [...TOOL_NAMES].sort());
    assert.equal(names.length, 26);
    assert.ok(!names.includes('pair_browser'), 'pair_browser is not advertised in embedded mode');
    for (const t of s.tools) {
      assert.equal(typeof t.title, 'string', `${t.name} title`);
      assert.ok(t.title.length > 0, `${t.name} title non-empty`);
      assert.ok(t.description && t.description.length > 10, `${t.name} description`);
      assert.ok(t.annotations, `${t.name} annotations`);
      assert.equal(t.annotations.openWorldHint, false, `${t.name} openWorldHint false`);
      assert.equal(typeof t.annotations.readOnlyHint, 'boolean', `${t.name} readOnlyHint`);
      assert.equal(typeof t.annotations.idempotentHint, 'boolean', `${t.name} idempotentHint`);
      if (READ_ONLY.includes(t.name)) assert.equal(t.annotations.readOnlyHint, true, `${t.name} is read-only`);
      if (DESTRUCTIVE.includes(t.name)) {
        assert.equal(t.annotations.readOnlyHint, false, `${t.name} not read-only`);
        assert.equal(t.annotations.destructiveHint, true, `${t.name} destructive`);
      }
      if (['create_model', 'mutate', 'patch_model', 'upload_blob'].includes(t.name)) {
        assert.equal(t.annotations.readOnlyHint, false, `${t.name} writes`);
        assert.notEqual(t.annotations.destructiveHint, true, `${t.name} not destructive`);
      }
      assert.equal(t.inputSchema.type, 'object', `${t.name} inputSchema is an object schema`);
    }
    for (const n of WITH_OUTPUT_SCHEMA) assert.ok(s.tools.find((t) => t.name === n).outputSchema, `${n} declares outputSchema`);
    for (const n of WITHOUT_OUTPUT_SCHEMA) assert.equal(s.tools.find((t) => t.name === n).outputSchema, undefined, `${n} has no outputSchema`);
    // create_model / evolve_spec embed the full ModelSpec / SpecEvolution schema, not a bare object
    const spec = s.tools.find((t) => t.name === 'create_model').inputSchema.properties.spec;
    for (const k of ['id', 'schema', 'derivations', 'metaDerivations', 'constraints', 'effects', 'tests', 'viewDefinition']) {
      assert.ok(spec.properties?.[k], `create_model spec schema has ${k}`);
    }
    const evo = s.tools.find((t) => t.name === 'evolve_spec').inputSchema.properties.evolution;
    for (const k of ['newVersion', 'expectedVersion', 'upsertDerivations', 'backfill']) {
      assert.ok(evo.properties?.[k], `evolve_spec evolution schema has ${k}`);
    }
  });
});

test('every inputSchema and outputSchema compiles with Ajv 2020', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    for (const t of s.tools) {
      assert.doesNotThrow(() => compile(t.inputSchema), `${t.name} inputSchema compiles`);
      if (t.outputSchema) {
        assert.equal(t.outputSchema.type, 'object', `${t.name} outputSchema root is type object`);
        assert.doesNotThrow(() => compile(t.outputSchema), `${t.name} outputSchema compiles`);
      }
    }
  });
});

test('inputSchema `required` lists exactly the contract\'s required arguments (optional ones stay optional)', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    const wrong = [];
    for (const t of s.tools) {
      const got = [...(t.inputSchema.required || [])].sort();
      const want = [...REQUIRED_ARGS[t.name]].sort();
      if (JSON.stringify(got) !== JSON.stringify(want)) wrong.push(`${t.name}: required ${JSON.stringify(got)}, contract ${JSON.stringify(want)}`);
    }
    assert.ok(wrong.length === 0, `tools whose inputSchema marks optional arguments required:\n${wrong.join('\n')}`);
  });
});

test('minimal realistic arguments validate against each tool\'s own inputSchema', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    const bad = [];
    for (const t of s.tools) {
      const v = compile(t.inputSchema);
      if (!v(MINIMAL_CALLS[t.name])) {
        bad.push(`${t.name}: ${v.errors.map((e) => `${e.instancePath || '/'} ${e.message}`).join('; ')}`);
      }
    }
    assert.ok(bad.length === 0, `arguments rejected by the tool's own inputSchema:\n${bad.join('\n')}`);
  });
});

test('every bundled example spec validates against create_model\'s inputSchema', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    const v = compile(s.tools.find((t) => t.name === 'create_model').inputSchema);
    const bad = [];
    for (const ex of loadExamples()) if (!v({ spec: ex.spec })) bad.push(`${ex.name}: ${ajvErrors(v).slice(0, 400)}`);
    assert.deepEqual(bad, []);
  });
});

test('get_domain_guidance enumerates the topic menu in its schema', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    const t = s.tools.find((x) => x.name === 'get_domain_guidance');
    const items = t.inputSchema.properties.topics.items;
    const menu = items.enum || [];
    const missing = GUIDANCE_TOPICS.filter((id) => !menu.includes(id));
    assert.deepEqual(missing, [], `topic ids missing from the schema's enum (enum is ${JSON.stringify(items.enum)})`);
  });
});
