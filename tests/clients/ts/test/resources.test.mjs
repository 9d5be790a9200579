// Resources: list, templates, read of every kind, unknown uri, state subscriptions
// (legacy: resources/subscribe; modern: subscriptions/listen with resourceSubscriptions).
import { test } from 'node:test';
import assert from 'node:assert/strict';

import {
  connect, withServer, ok, compile, loadExamples, onNotification, rpcError, rpcErrorOf, listen, rawUpdates,
  WORKED_DEMO, shopSpec, TEST_TIMEOUT, MODERN,
} from '../lib.mjs';

const T = { timeout: TEST_TIMEOUT };
// Resource not found: -32002 up to 2025-11-25; -32602 (invalid params) from 2026-07-28.
const RESOURCE_NOT_FOUND = MODERN ? -32602 : -32002;
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

test(`readResource of an unknown uri rejects with JSON-RPC ${RESOURCE_NOT_FOUND} (${MODERN ? '2026-07-28' : '2025-11-25'})`, T, async () => {
  await withServer(async (s) => {
    for (const uri of ['valem://guide/nope', 'valem://examples/nope', 'valem://state/nope', 'https://example.invalid/x']) {
      await assert.rejects(s.client.readResource({ uri }), (e) => {
        rpcError(RESOURCE_NOT_FOUND)(e);
        // 2026-07-28 (resources spec, Error Handling): the error names the uri in data.
        if (MODERN) assert.equal(rpcErrorOf(e).data?.uri, uri, `data.uri for ${uri}`);
        return true;
      });
    }
  }, { listTools: false });
});

/** A connection whose `notifications/resources/updated` URIs are appended to `updates`. */
function connectRecordingUpdates(updates) {
  return connect({
    before: (client, push) => {
      onNotification(client, 'notifications/resources/updated', (n) => {
        updates.push(n.params.uri);
        push(n);
      });
    },
  });
}

test('subscribeResource(valem://state/<id>): a mutate emits resources/updated; unsubscribe stops it', { ...T, skip: MODERN && 'legacy era only: 2026-07-28 replaced resources/subscribe with subscriptions/listen (next test)' }, async () => {
  const updates = [];
  const s = await connectRecordingUpdates(updates);
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
    await assert.rejects(s.client.subscribeResource({ uri: 'valem://guide/jsonata-gotchas' }), rpcError(-32002));
  } finally {
    await s.close();
  }
});

test('subscriptions/listen(resourceSubscriptions valem://state/<id>): a mutate emits resources/updated on the stream; closing it stops them', { ...T, skip: !MODERN && 'modern era only (2026-07-28): run with VALEM_ERA=modern' }, async () => {
  const updates = [];
  const s = await connectRecordingUpdates(updates);
  try {
    const isUpdate = (uri) => (n) => n.method === 'notifications/resources/updated' && n.params.uri === uri;
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    await ok(s, 'create_model', { spec: shopSpec('sentinel') });
    const sub = await listen(s, { resourceSubscriptions: ['valem://state/demo'] });
    assert.deepEqual(sub.honoredFilter, { resourceSubscriptions: ['valem://state/demo'] }, 'the acknowledgement honours the state uri');
    await ok(s, 'mutate', { id: 'demo', mutations: { '$.price': 10, '$.qty': 3 } });
    const n = await s.waitFor(isUpdate('valem://state/demo'), 10_000, 'resources/updated for valem://state/demo');
    assert.equal(n.params.uri, 'valem://state/demo');
    // on the wire, the update names its stream: subscriptionId = the listen request's id
    assert.equal(rawUpdates(s, 'valem://state/demo', sub.id).length, 1, 'one update, tagged with the subscription id');
    // the agent can re-read on the push
    const st = await s.client.readResource({ uri: 'valem://state/demo' });
    assert.equal(JSON.parse(st.contents[0].text).total, 30);

    // patch_model commits a cycle too
    const before = updates.length;
    await ok(s, 'patch_model', { id: 'demo', patch: [{ op: 'replace', path: '/qty', value: 4 }] });
    await s.waitFor((x) => isUpdate('valem://state/demo')(x) && updates.length > before, 10_000, 'a second update after patch_model');
    assert.equal(rawUpdates(s, 'valem://state/demo', sub.id).length, 2);

    // A create on another model is no resources/list_changed here: only requested types are sent.
    await ok(s, 'create_model', { spec: shopSpec('other') });

    // Closing the stream ends demo's notifications. Ordering proof without sleeping: listen to a
    // sentinel model, write demo, then the sentinel; the sentinel's update arrives after anything
    // demo's write could have produced.
    await sub.close();
    assert.equal(await sub.closed, 'local');
    const sentinel = await listen(s, { resourceSubscriptions: ['valem://state/sentinel'] });
    const demoCount = rawUpdates(s, 'valem://state/demo').length;
    await ok(s, 'mutate', { id: 'demo', mutations: { '$.qty': 5 } });
    await ok(s, 'mutate', { id: 'sentinel', mutations: { '$.price': 1, '$.qty': 1 } });
    await s.waitFor(isUpdate('valem://state/sentinel'), 10_000, 'resources/updated for the sentinel');
    assert.equal(rawUpdates(s, 'valem://state/sentinel', sentinel.id).length, 1);
    assert.equal(rawUpdates(s, 'valem://state/demo').length, demoCount, 'no update for demo after its stream closed');
    assert.deepEqual(
      s.transport.received.filter((m) => m.method && m.method !== 'notifications/resources/updated' && m.method !== 'notifications/subscriptions/acknowledged'),
      [],
      'no notification type that was not requested',
    );

    // only subscribable uris: a guide is left out of the acknowledgement
    const guide = await listen(s, { resourceSubscriptions: ['valem://guide/jsonata-gotchas'] });
    assert.ok(!(guide.honoredFilter.resourceSubscriptions ?? []).includes('valem://guide/jsonata-gotchas'),
      `a guide is not subscribable: ${JSON.stringify(guide.honoredFilter)}`);
  } finally {
    await s.close();
  }
});
