// subscriptions/listen (2026-07-28 only): change notifications on a long-lived stream, from this
// connection's writes, from another client's writes and from the REST API of the same daemon.
// (The legacy era's resources/subscribe is covered in resources.test.mjs.)
import { test } from 'node:test';
import assert from 'node:assert/strict';

import {
  connect, ok, listen, rawUpdates, restMutate, startDaemon, WORKED_DEMO, shopSpec, TEST_TIMEOUT, MODERN, TRANSPORT, META,
} from '../lib.mjs';

const MODERN_ONLY = !MODERN && 'modern era only (2026-07-28): subscriptions/listen; run with VALEM_ERA=modern';
const SHARED_DAEMON = MODERN_ONLY
  || (TRANSPORT === 'stdio' && 'http/proxy only: stdio `valem mcp` is one embedded engine per process, no other client or REST API reaches it');
const T = { timeout: TEST_TIMEOUT, skip: MODERN_ONLY };
const T_SHARED = { timeout: TEST_TIMEOUT, skip: SHARED_DAEMON };

const DEMO = 'valem://state/demo';
const isUpdate = (uri) => (n) => n.method === 'notifications/resources/updated' && n.params?.uri === uri;
const isListChanged = (n) => n.method === 'notifications/resources/list_changed';

test('listen: the update of a mutation arrives on the stream, tagged with the listen id', T, async () => {
  const s = await connect();
  try {
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    const sub = await listen(s, { resourceSubscriptions: [DEMO] });
    assert.deepEqual(sub.honoredFilter.resourceSubscriptions, [DEMO]);
    // the acknowledgement comes first and names the stream
    const ack = s.transport.received.find((m) => m.method === 'notifications/subscriptions/acknowledged');
    assert.equal(ack.params._meta[META.subscriptionId], sub.id);
    assert.deepEqual(rawUpdates(s, DEMO), [], 'nothing before a write');

    const m = await ok(s, 'mutate', { id: 'demo', mutations: { '$.price': 10, '$.qty': 3 } });
    assert.equal(m.success, true);
    await s.waitFor(isUpdate(DEMO), 10_000, `resources/updated for ${DEMO}`);
    assert.equal(rawUpdates(s, DEMO, sub.id).length, 1);
    const st = await s.client.readResource({ uri: DEMO });
    assert.deepEqual(JSON.parse(st.contents[0].text), { price: 10, qty: 3, total: 30 });
    // a refused write (rollback/schema violation) commits nothing and notifies nothing: the next
    // committed write is the only other update
    await ok(s, 'create_model', { spec: shopSpec('shop') });
    const shop = await listen(s, { resourceSubscriptions: ['valem://state/shop'] });
    const refused = await s.client.callTool({ name: 'mutate', arguments: { id: 'shop', mutations: { '$.price': -1 } } });
    assert.equal(refused.isError, true);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 1 } });
    await s.waitFor(isUpdate('valem://state/shop'), 10_000, 'resources/updated for the shop');
    assert.equal(rawUpdates(s, 'valem://state/shop', shop.id).length, 1, 'the refused write sent no update');
  } finally {
    await s.close();
  }
});

test('listen: two streams on one connection each get the update under their own subscription id', T, async () => {
  const s = await connect();
  try {
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    const a = await listen(s, { resourceSubscriptions: [DEMO] });
    const b = await listen(s, { resourceSubscriptions: [DEMO] });
    assert.notEqual(a.id, b.id);
    await ok(s, 'mutate', { id: 'demo', mutations: { '$.price': 2 } });
    // (waitFor re-checks on every arriving notification; the wire log is filled before dispatch)
    await s.waitFor(() => rawUpdates(s, DEMO, a.id).length >= 1 && rawUpdates(s, DEMO, b.id).length >= 1, 10_000, 'an update on each stream');
    assert.equal(rawUpdates(s, DEMO, a.id).length, 1, `stream ${a.id}`);
    assert.equal(rawUpdates(s, DEMO, b.id).length, 1, `stream ${b.id}`);
  } finally {
    await s.close();
  }
});

test('listen resourcesListChanged: create_model and delete_model emit notifications/resources/list_changed', T, async () => {
  const s = await connect();
  try {
    assert.equal(s.client.getServerCapabilities().resources?.listChanged, true, 'resources.listChanged is advertised');
    const sub = await listen(s, { resourcesListChanged: true });
    assert.equal(sub.honoredFilter.resourcesListChanged, true);
    const listChanged = () => s.transport.received.filter(
      (m) => isListChanged(m) && m.params?._meta?.[META.subscriptionId] === sub.id,
    );
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    await s.waitFor(isListChanged, 10_000, 'resources/list_changed after create_model');
    assert.ok((await s.client.listResources()).resources.some((r) => r.uri === DEMO), 'the new state is listed');
    const afterCreate = listChanged().length;
    assert.ok(afterCreate >= 1);
    await ok(s, 'delete_model', { id: 'demo' });
    await s.waitFor(() => listChanged().length > afterCreate, 10_000, 'resources/list_changed after delete_model');
    assert.ok(!(await s.client.listResources()).resources.some((r) => r.uri === DEMO), 'the deleted state is gone');
  } finally {
    await s.close();
  }
});

/** Two clients (this transport) on one `valem serve`; `fn(a, b, daemon)`. */
async function withTwoClients(fn) {
  const env = { ...process.env };
  delete env.VALEM_API_KEY;
  const daemon = await startDaemon(env);
  let a;
  let b;
  try {
    a = await connect({ daemon });
    b = await connect({ daemon });
    await fn(a, b, daemon);
  } finally {
    await b?.close();
    await a?.close();
    await daemon.stop();
  }
}

test("listen: another client's mutation on the same daemon reaches the first client's stream", T_SHARED, async () => {
  await withTwoClients(async (a, b) => {
    await ok(a, 'create_model', { spec: WORKED_DEMO });
    const sub = await listen(a, { resourceSubscriptions: [DEMO] });
    // b sees a's model: one daemon, one engine
    assert.deepEqual(await ok(b, 'list_models'), ['demo']);
    await ok(b, 'mutate', { id: 'demo', mutations: { '$.price': 4, '$.qty': 2 } });
    await a.waitFor(isUpdate(DEMO), 10_000, `resources/updated for ${DEMO} after the other client's write`);
    assert.equal(rawUpdates(a, DEMO, sub.id).length, 1);
    const st = await a.client.readResource({ uri: DEMO });
    assert.deepEqual(JSON.parse(st.contents[0].text), { price: 4, qty: 2, total: 8 });
    // the writer did not listen, so it got nothing
    assert.deepEqual(rawUpdates(b, DEMO), []);
  });
});

test("listen: a REST POST /models/{id}/mutations on the same daemon reaches the client's stream", T_SHARED, async () => {
  await withTwoClients(async (a, _b, daemon) => {
    await ok(a, 'create_model', { spec: WORKED_DEMO });
    const sub = await listen(a, { resourceSubscriptions: [DEMO] });
    // The REST body is the flat `{"$.path": value}` object (daemon/http/src/rest/models.rs: mutate).
    const res = await restMutate(daemon, 'demo', { '$.price': 3 });
    assert.equal(res.status, 200, `REST mutate: ${JSON.stringify(res.body)}`);
    assert.equal(res.body.success, true);
    assert.deepEqual(res.body.mutatedPaths, ['$.price']);
    await a.waitFor(isUpdate(DEMO), 10_000, `resources/updated for ${DEMO} after the REST write`);
    assert.equal(rawUpdates(a, DEMO, sub.id).length, 1);
    const st = await a.client.readResource({ uri: DEMO });
    assert.equal(JSON.parse(st.contents[0].text).price, 3);
  });
});
