// Handshake, capabilities, logging, protocol-level errors, tool catalog and schemas.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import {
  LoggingMessageNotificationSchema,
  LATEST_PROTOCOL_VERSION,
  McpError,
  ErrorCode,
} from '@modelcontextprotocol/sdk/types.js';

import { connect, withServer, compile, ajvErrors, loadExamples, TEST_TIMEOUT, WORKED_DEMO } from '../lib.mjs';

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

test('initialize: 2025-11-25 negotiated, server valem, tools + resources.subscribe + logging, no prompts, instructions', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    assert.equal(LATEST_PROTOCOL_VERSION, '2025-11-25', 'the pinned SDK speaks 2025-11-25');
    const init = s.transport.sent.find((m) => m.method === 'initialize');
    assert.equal(init.params.protocolVersion, '2025-11-25');
    assert.equal(init.params.clientInfo.name, 'valem-ts-e2e');
    const reply = s.transport.received.find((m) => m.id === init.id);
    assert.ok(reply.result, `initialize succeeded: ${JSON.stringify(reply)}`);
    assert.equal(reply.result.protocolVersion, '2025-11-25');
    assert.ok(s.transport.sent.some((m) => m.method === 'notifications/initialized'));

    const info = s.client.getServerVersion();
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
    // ping works after the handshake
    assert.deepEqual(await s.client.ping(), {});
  }, { listTools: false });
});

test('prompts/list is a JSON-RPC method-not-found (no prompts offered)', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    // The SDK refuses prompts/list client-side without the capability; go through request() raw
    // with capability enforcement off (the default) to see the server's own answer.
    await assert.rejects(
      s.client.request({ method: 'prompts/list', params: {} }, (await import('@modelcontextprotocol/sdk/types.js')).ListPromptsResultSchema),
      (e) => e instanceof McpError && e.code === ErrorCode.MethodNotFound,
    );
  }, { listTools: false });
});

test('logging: a notifications/message arrives after connect; setLoggingLevel succeeds', { timeout: TEST_TIMEOUT }, async () => {
  const logs = [];
  let resolveFirst;
  const first = new Promise((r) => (resolveFirst = r));
  const s = await connect({
    listTools: false,
    before: (client) => {
      client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => {
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
    await assert.rejects(
      s.client.setLoggingLevel('loud'),
      (e) => e instanceof McpError && e.code === ErrorCode.InvalidParams,
    );
  } finally {
    await s.close();
  }
});

test('unknown tool: the SDK rejects callTool with McpError -32602 (JSON-RPC invalid params)', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    await assert.rejects(
      s.client.callTool({ name: 'no_such_tool', arguments: {} }),
      (e) => {
        assert.ok(e instanceof McpError, `McpError, got ${e}`);
        assert.equal(e.code, -32602);
        assert.match(e.message, /no_such_tool/);
        return true;
      },
    );
    // the session is still usable afterwards
    assert.deepEqual(await s.client.ping(), {});
  });
});

test('unknown JSON-RPC method → -32601 method not found', { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (s) => {
    const { EmptyResultSchema } = await import('@modelcontextprotocol/sdk/types.js');
    await assert.rejects(
      s.client.request({ method: 'valem/does-not-exist', params: {} }, EmptyResultSchema),
      (e) => e instanceof McpError && e.code === ErrorCode.MethodNotFound,
    );
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
