// Resources: list, templates, read of every kind, unknown uri, state subscriptions.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { McpError, ResourceUpdatedNotificationSchema } from '@modelcontextprotocol/sdk/types.js';

import { connect, withServer, ok, compile, loadExamples, WORKED_DEMO, shopSpec, TEST_TIMEOUT } from '../lib.mjs';

const T = { timeout: TEST_TIMEOUT };
const GUIDES = ['model-spec-format', 'jsonata-gotchas', 'spec-evolution', 'view-system'];

test('listResources: guides (markdown), schemas and every bundled example (json)', T, async () => {
  await withServer(async (s) => {
    const { resources } = await s.client.listResources();
    const byUri = new Map(resources.map((r) => [r.uri, r]));
    for (const g of GUIDES) {
      const r = byUri.get(`valem://guide/${g}`);
      assert.ok(r, `guide ${g} listed`);
      assert.equal(r.mimeType, 'text/markdown');
      assert.ok(r.name);
    }
    for (const sc of ['model-spec', 'spec-evolution']) {
      assert.equal(byUri.get(`valem://schema/${sc}`)?.mimeType, 'application/json', `schema ${sc}`);
    }
    for (const ex of loadExamples()) {
      assert.equal(byUri.get(`valem://examples/${ex.name}`)?.mimeType, 'application/json', `example ${ex.name} listed`);
    }
  }, { listTools: false });
});

test('listResourceTemplates: valem://examples/{name} and valem://state/{modelId}', T, async () => {
  await withServer(async (s) => {
    const { resourceTemplates } = await s.client.listResourceTemplates();
    const uris = resourceTemplates.map((t) => t.uriTemplate).sort();
    assert.deepEqual(uris, ['valem://examples/{name}', 'valem://state/{modelId}']);
    for (const t of resourceTemplates) {
      assert.ok(t.name);
      assert.equal(t.mimeType, 'application/json');
    }
  }, { listTools: false });
});

test('readResource: a guide, both schemas (compile with Ajv 2020), an example, a model state', T, async () => {
  await withServer(async (s) => {
    for (const g of GUIDES) {
      const uri = `valem://guide/${g}`;
      const r = await s.client.readResource({ uri });
      assert.equal(r.contents.length, 1);
      assert.equal(r.contents[0].uri, uri);
      assert.equal(r.contents[0].mimeType, 'text/markdown');
      assert.ok(r.contents[0].text.length > 200, `${g} has content`);
    }
    for (const sc of ['model-spec', 'spec-evolution']) {
      const r = await s.client.readResource({ uri: `valem://schema/${sc}` });
      assert.equal(r.contents[0].mimeType, 'application/json');
      const schema = JSON.parse(r.contents[0].text);
      const v = compile(schema);
      if (sc === 'model-spec') {
        for (const ex of loadExamples()) assert.ok(v(ex.spec), `${ex.name} validates against valem://schema/model-spec`);
        assert.ok(v(WORKED_DEMO), 'the worked example spec validates');
      } else {
        assert.ok(v({ expectedVersion: '1.0.0', newVersion: '1.1.0', upsertDerivations: [{ path: '$.vat', expr: 'total * 0.2' }] }));
      }
    }
    const demo = loadExamples().find((e) => e.name === 'demo');
    const ex = await s.client.readResource({ uri: 'valem://examples/demo' });
    assert.equal(ex.contents[0].mimeType, 'application/json');
    assert.deepEqual(JSON.parse(ex.contents[0].text), demo.spec, 'the example resource is the bundled file');

    await ok(s, 'create_model', { spec: WORKED_DEMO });
    await ok(s, 'mutate', { id: 'demo', mutations: { '$.price': 10, '$.qty': 3 } });
    const st = await s.client.readResource({ uri: 'valem://state/demo' });
    assert.equal(st.contents[0].uri, 'valem://state/demo');
    assert.equal(st.contents[0].mimeType, 'application/json');
    assert.deepEqual(JSON.parse(st.contents[0].text), { price: 10, qty: 3, total: 30 });
    const listed = (await s.client.listResources()).resources.map((r) => r.uri);
    assert.ok(listed.includes('valem://state/demo'), 'a live model state is listed');
  });
});

test('readResource of an unknown uri rejects with JSON-RPC -32002', T, async () => {
  await withServer(async (s) => {
    for (const uri of ['valem://guide/nope', 'valem://examples/nope', 'valem://state/nope', 'https://example.invalid/x']) {
      await assert.rejects(s.client.readResource({ uri }), (e) => {
        assert.ok(e instanceof McpError, `McpError for ${uri}`);
        assert.equal(e.code, -32002, `code for ${uri}`);
        return true;
      });
    }
  }, { listTools: false });
});

test('subscribeResource(valem://state/<id>): a mutate emits resources/updated; unsubscribe stops it', T, async () => {
  const updates = [];
  let s;
  s = await connect({
    before: (client, push) => {
      client.setNotificationHandler(ResourceUpdatedNotificationSchema, (n) => {
        updates.push(n.params.uri);
        push(n);
      });
    },
  });
  try {
    const isUpdate = (uri) => (n) => n.method === 'notifications/resources/updated' && n.params.uri === uri;
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    await ok(s, 'create_model', { spec: shopSpec('sentinel') });
    assert.deepEqual(await s.client.subscribeResource({ uri: 'valem://state/demo' }), {});
    await ok(s, 'mutate', { id: 'demo', mutations: { '$.price': 10, '$.qty': 3 } });
    const n = await s.waitFor(isUpdate('valem://state/demo'), 10_000, 'resources/updated for valem://state/demo');
    assert.equal(n.params.uri, 'valem://state/demo');
    // the agent can re-read on the push
    const st = await s.client.readResource({ uri: 'valem://state/demo' });
    assert.equal(JSON.parse(st.contents[0].text).total, 30);

    // patch_model commits a cycle too
    const before = updates.length;
    await ok(s, 'patch_model', { id: 'demo', patch: [{ op: 'replace', path: '/qty', value: 4 }] });
    await s.waitFor((x) => isUpdate('valem://state/demo')(x) && updates.length > before, 10_000, 'a second update after patch_model');

    // unsubscribe: demo's writes no longer notify. Ordering proof without sleeping: subscribe
    // a sentinel model, write demo, then the sentinel; the sentinel's update arrives after
    // anything demo's write could have produced.
    assert.deepEqual(await s.client.unsubscribeResource({ uri: 'valem://state/demo' }), {});
    await s.client.subscribeResource({ uri: 'valem://state/sentinel' });
    const demoCount = updates.filter((u) => u === 'valem://state/demo').length;
    await ok(s, 'mutate', { id: 'demo', mutations: { '$.qty': 5 } });
    await ok(s, 'mutate', { id: 'sentinel', mutations: { '$.price': 1, '$.qty': 1 } });
    await s.waitFor(isUpdate('valem://state/sentinel'), 10_000, 'resources/updated for the sentinel');
    assert.equal(updates.filter((u) => u === 'valem://state/demo').length, demoCount, 'no update for demo after unsubscribe');

    // only subscribable uris
    await assert.rejects(s.client.subscribeResource({ uri: 'valem://guide/jsonata-gotchas' }), (e) => e instanceof McpError && e.code === -32002);
  } finally {
    await s.close();
  }
});
