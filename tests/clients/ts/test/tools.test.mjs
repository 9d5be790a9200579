// Every tool, at least once on success and once on failure, through the SDK's callTool (which
// itself validates structuredContent against the tool's outputSchema) plus our own Ajv 2020 check
// and the text-block == structuredContent rule (lib.checkEnvelope).
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { withServer, ok, fails, call, rawCall, shopSpec, WORKED_DEMO, TEST_TIMEOUT } from '../lib.mjs';

const T = { timeout: TEST_TIMEOUT };

async function createShop(s, id = 'shop') {
  const info = await ok(s, 'create_model', { spec: shopSpec(id) });
  assert.equal(info.id, id);
  return info;
}

test('contract worked example: demo price * qty → total 30, derivedUpdated ["$.total"]', T, async () => {
  await withServer(async (s) => {
    const info = await ok(s, 'create_model', { spec: WORKED_DEMO });
    assert.equal(info.id, 'demo');
    assert.equal(info.version, '1');
    assert.equal(info.derivationCount, 1);

    const m = await ok(s, 'mutate', { id: 'demo', mutations: { '$.price': 10, '$.qty': 3 } });
    assert.equal(m.success, true);
    assert.deepEqual(m.derivedUpdated, ['$.total']);
    assert.deepEqual([...m.mutatedPaths].sort(), ['$.price', '$.qty']);
    assert.equal(m.traces, undefined, 'traces are opt-in');

    const st = await ok(s, 'get_state', { id: 'demo' });
    assert.deepEqual(st, { price: 10, qty: 3, total: 30 });
  });
});

test('list_models: success (array in text, no structuredContent) and failure (unknown argument)', T, async () => {
  await withServer(async (s) => {
    assert.deepEqual(await ok(s, 'list_models'), []);
    await createShop(s, 'b-model');
    await createShop(s, 'a-model');
    const { result, json } = await call(s, 'list_models', {});
    assert.equal(result.isError, false);
    assert.deepEqual(json, ['a-model', 'b-model'], 'alphabetical');
    assert.equal(result.structuredContent, undefined);
    const f = await fails(s, 'list_models', { bogus: 1 });
    assert.match(f.text, /bogus/);
  });
});

test('create_model: ModelInfo on success; duplicate id and invalid spec fail', T, async () => {
  await withServer(async (s) => {
    const info = await createShop(s);
    assert.deepEqual(
      { v: info.version, d: info.derivationCount, m: info.metaDerivationCount, c: info.constraintCount, e: info.effectCount },
      { v: '1.0.0', d: 1, m: 0, c: 2, e: 0 },
    );
    const dup = await fails(s, 'create_model', { spec: shopSpec() });
    assert.match(dup.text, /shop/);
    const bad = await fails(s, 'create_model', { spec: { id: 'broken', schema: {}, derivations: [{ path: '$.x', expr: 'price *' }] } });
    assert.ok(bad.text.length > 0);
    const noSpec = await fails(s, 'create_model', {});
    assert.match(noSpec.text, /spec/);
    assert.deepEqual(await ok(s, 'list_models'), ['shop'], 'failed creates register nothing');
  });
});

test('get_model_info / get_spec: success and unknown model', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const info = await ok(s, 'get_model_info', { id: 'shop' });
    assert.equal(info.id, 'shop');
    assert.equal(info.constraintCount, 2);
    const spec = await ok(s, 'get_spec', { id: 'shop' });
    assert.equal(spec.id, 'shop');
    assert.equal(spec.derivations[0].path, '$.total');
    assert.equal(spec.constraints.length, 2);
    assert.match((await fails(s, 'get_model_info', { id: 'nope' })).text, /nope/);
    assert.match((await fails(s, 'get_spec', { id: 'nope' })).text, /nope/);
  });
});

test('get_state: full, paths projection, depth trim, at=; failures for unknown model and bad at', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 2, '$.qty': 3, '$.items': ['a', 'b'] } });
    const full = await ok(s, 'get_state', { id: 'shop' });
    assert.deepEqual(full, { price: 2, qty: 3, items: ['a', 'b'], total: 6 });
    assert.deepEqual(await ok(s, 'get_state', { id: 'shop', paths: ['$.total', '$.absent'] }), { total: 6 });
    assert.deepEqual(await ok(s, 'get_state', { id: 'shop', depth: 0 }), { price: 2, qty: 3, items: '<array: 2 items>', total: 6 });
    const hist = await ok(s, 'get_history', { id: 'shop' });
    const first = hist[hist.length - 1];
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.qty': 4 } });
    assert.equal((await ok(s, 'get_state', { id: 'shop', at: first })).total, 6, 'at= reads the earlier state');
    assert.equal((await ok(s, 'get_state', { id: 'shop' })).total, 8);
    assert.match((await fails(s, 'get_state', { id: 'nope' })).text, /nope/);
    await fails(s, 'get_state', { id: 'shop', at: 'yesterday-ish' });
  });
});

test('get_field: scalar in text only; missing field fails', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 10, '$.qty': 3 } });
    const { result, json } = await call(s, 'get_field', { id: 'shop', path: '$.total' });
    assert.equal(result.isError, false);
    assert.equal(json, 30);
    assert.equal(result.structuredContent, undefined, 'a scalar carries no structuredContent');
    assert.match((await fails(s, 'get_field', { id: 'shop', path: '$.nothing' })).text, /nothing/);
    await fails(s, 'get_field', { id: 'nope', path: '$.total' });
  });
});

test('get_effective_schema: field schema; unknown model fails', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const sch = await ok(s, 'get_effective_schema', { id: 'shop', path: '$.price' });
    assert.equal(sch.type, 'number');
    assert.equal(sch.minimum, 0);
    await fails(s, 'get_effective_schema', { id: 'nope', path: '$.price' });
  });
});

test('mutate: success with flag constraint and includeTraces; unknown model fails', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const m = await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 1, '$.qty': 60 }, includeTraces: true });
    assert.equal(m.success, true);
    assert.deepEqual(m.flaggedConstraints, [{ constraintId: 'bulk', message: 'Bulk order: check stock', policy: 'flag' }]);
    assert.ok(Array.isArray(m.traces) && m.traces.some((t) => t.targetPath === '$.total'), 'traces include $.total');
    assert.match((await fails(s, 'mutate', { id: 'nope', mutations: { '$.price': 1 } })).text, /nope/);
  });
});

test('mutate schema violation: SDK callTool returns isError with {error:"Schema violation", violations:[{path,keyword,message}]}', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    // Through the SDK's own callTool: a structured tool error must reach the agent as a result.
    const { result, json } = await call(s, 'mutate', { id: 'shop', mutations: { '$.price': -1 } });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Schema violation');
    assert.ok(json.violations.length >= 1);
    assert.deepEqual(Object.keys(json.violations[0]).filter((k) => ['path', 'keyword', 'message'].includes(k)).sort(), ['keyword', 'message', 'path']);
  });
});

test('mutate schema violation: structured body on the wire (raw tools/call)', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const { result, json } = await rawCall(s, 'mutate', { id: 'shop', mutations: { '$.price': -1 } });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Schema violation');
    assert.deepEqual(result.structuredContent, json);
    const v = json.violations[0];
    assert.equal(v.path, '$.price');
    assert.equal(v.keyword, 'minimum');
    assert.equal(typeof v.message, 'string');
    assert.equal((await ok(s, 'get_state', { id: 'shop' })).price, undefined, 'the write was refused');
  });
});

test('mutate rollback constraint: SDK callTool returns isError with {error:"Constraint violation", violations:[{constraintId,message,policy}]}', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const { result, json } = await call(s, 'mutate', { id: 'shop', mutations: { '$.price': 100, '$.qty': 20 } });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Constraint violation');
    assert.deepEqual(json.violations, [{ constraintId: 'cap', message: 'The total may not exceed 1000', policy: 'rollback' }]);
  });
});

test('mutate rollback constraint: structured body on the wire (raw tools/call), state untouched', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 1, '$.qty': 1 } });
    const { result, json } = await rawCall(s, 'mutate', { id: 'shop', mutations: { '$.price': 100, '$.qty': 20 } });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Constraint violation');
    assert.equal(json.violations.length, 1);
    const v = json.violations[0];
    assert.deepEqual({ c: v.constraintId, m: v.message, p: v.policy }, { c: 'cap', m: 'The total may not exceed 1000', p: 'rollback' });
    assert.deepEqual(result.structuredContent, json);
    assert.deepEqual(await ok(s, 'get_state', { id: 'shop' }), { price: 1, qty: 1, total: 1 }, 'rolled back');
  });
});

test('patch_model: append / insert with JSON Pointer; failing test op and schema violation', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const r = await ok(s, 'patch_model', {
      id: 'shop',
      patch: [
        { op: 'add', path: '/items', value: ['a'] },
        { op: 'add', path: '/items/-', value: 'c' },
        { op: 'add', path: '/items/1', value: 'b' },
        { op: 'add', path: '/price', value: 2 },
        { op: 'add', path: '/qty', value: 5 },
      ],
    });
    assert.equal(r.success, true);
    assert.ok(r.derivedUpdated.includes('$.total'));
    const st = await ok(s, 'get_state', { id: 'shop' });
    assert.deepEqual(st.items, ['a', 'b', 'c']);
    assert.equal(st.total, 10);
    await fails(s, 'patch_model', { id: 'shop', patch: [{ op: 'test', path: '/qty', value: 99 }] });
    const { result, json } = await rawCall(s, 'patch_model', { id: 'shop', patch: [{ op: 'replace', path: '/qty', value: -3 }] });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Schema violation');
    assert.equal(json.violations[0].path, '$.qty');
    assert.equal((await ok(s, 'get_state', { id: 'shop' })).qty, 5);
  });
});

test('explain: traces for a path with limit; unknown model fails', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 2, '$.qty': 2 } });
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.qty': 3 } });
    const { result, json } = await call(s, 'explain', { id: 'shop', path: '$.total' });
    assert.equal(result.isError, false);
    assert.ok(Array.isArray(json) && json.length >= 2, `two $.total traces: ${JSON.stringify(json)}`);
    assert.equal(result.structuredContent, undefined);
    const last = json[json.length - 1];
    assert.equal(last.targetPath, '$.total');
    assert.equal(last.result, 6);
    const one = await ok(s, 'explain', { id: 'shop', path: '$.total', limit: 1 });
    assert.equal(one.length, 1);
    assert.deepEqual(one[0], last, 'limit keeps the most recent');
    await fails(s, 'explain', { id: 'nope', path: '$' });
  });
});

test('get_history / get_audit / verify_audit: success and failures', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 2, '$.qty': 2 } });
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.note': 'hello' } });
    const hist = await ok(s, 'get_history', { id: 'shop' });
    assert.ok(Array.isArray(hist) && hist.length >= 2);
    for (const h of hist) assert.ok(!Number.isNaN(Date.parse(h)), `ISO instant: ${h}`);

    const audit = await ok(s, 'get_audit', { id: 'shop' });
    assert.ok(Array.isArray(audit) && audit.length >= 2);
    const seq = audit.map((r) => r.sequence);
    assert.deepEqual(seq, [...seq].sort((a, b) => b - a), 'newest first');
    for (const k of ['mutations', 'derivedUpdated', 'sequence', 'source', 'timestamp']) assert.ok(k in audit[0], `record has ${k}`);
    const onlyNote = await ok(s, 'get_audit', { id: 'shop', pathPrefix: '$.note' });
    assert.equal(onlyNote.length, 1);
    assert.deepEqual(onlyNote[0].mutations, { '$.note': 'hello' });
    assert.equal((await ok(s, 'get_audit', { id: 'shop', limit: 1 })).length, 1);
    const future = await ok(s, 'get_audit', { id: 'shop', from: '2999-01-01T00:00:00Z' });
    assert.deepEqual(future, []);

    const v = await ok(s, 'verify_audit', { id: 'shop' });
    assert.equal(v.valid, true);
    assert.ok(v.recordsChecked >= 2);

    await fails(s, 'get_history', { id: 'nope' });
    await fails(s, 'get_audit', { id: 'shop', from: 'not a date' });
    await fails(s, 'verify_audit', { id: 'nope' });
  });
});

test('snapshot / restore: roll back to the snapshot; failures', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 2, '$.qty': 2 } });
    const snap = await ok(s, 'snapshot', { id: 'shop' });
    assert.equal(snap.modelId, 'shop');
    assert.deepEqual(snap.baseDoc, { price: 2, qty: 2 });
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.qty': 9 } });
    assert.equal((await ok(s, 'get_state', { id: 'shop' })).total, 18);
    await ok(s, 'restore', { id: 'shop', snapshot: snap });
    assert.deepEqual(await ok(s, 'get_state', { id: 'shop' }), { price: 2, qty: 2, total: 4 });

    await fails(s, 'snapshot', { id: 'nope' });
    await fails(s, 'restore', { id: 'nope', snapshot: snap });
    await fails(s, 'restore', { id: 'shop', snapshot: { ...snap, baseDoc: { price: -5 } } });
  });
});

test('evolve_spec: upsert a derivation and bump the version (returns the new version)', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 10, '$.qty': 3 } });
    const info = await ok(s, 'evolve_spec', {
      id: 'shop',
      evolution: {
        expectedVersion: '1.0.0',
        newVersion: '1.1.0',
        upsertDerivations: [{ path: '$.vat', expr: 'total * 0.2' }],
      },
    });
    assert.equal(info.derivationCount, 2);
    assert.equal(info.version, '1.1.0', 'evolve_spec returns the new version');
    assert.equal((await ok(s, 'get_model_info', { id: 'shop' })).version, '1.1.0');
    assert.equal((await ok(s, 'get_state', { id: 'shop' })).vat, 6);
  });
});

test('evolve_spec: derivation upsert recomputes the kept state; invalid evolution fails', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 10, '$.qty': 3 } });
    const info = await ok(s, 'evolve_spec', { id: 'shop', evolution: { upsertDerivations: [{ path: '$.vat', expr: 'total * 0.2' }] } });
    assert.equal(info.derivationCount, 2);
    assert.equal((await ok(s, 'get_state', { id: 'shop' })).vat, 6);
    await fails(s, 'evolve_spec', { id: 'shop', evolution: { upsertDerivations: [{ path: '$.bad', expr: '1 +' }] } });
    await fails(s, 'evolve_spec', { id: 'nope', evolution: {} });
  });
});

test('evolve_spec version conflict: SDK callTool returns isError with {error:"Version conflict", expected, actual}', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const { result, json } = await call(s, 'evolve_spec', { id: 'shop', evolution: { expectedVersion: '9.9.9', newVersion: '10.0.0' } });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Version conflict');
    assert.equal(json.expected, '9.9.9');
    assert.equal(json.actual, '1.0.0');
  });
});

test('evolve_spec version conflict: structured body on the wire (raw tools/call)', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const { result, json } = await rawCall(s, 'evolve_spec', { id: 'shop', evolution: { expectedVersion: '9.9.9', newVersion: '10.0.0' } });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Version conflict');
    assert.equal(json.expected, '9.9.9');
    assert.equal(json.actual, '1.0.0');
    assert.deepEqual(result.structuredContent, json);
    assert.equal((await ok(s, 'get_model_info', { id: 'shop' })).version, '1.0.0', 'nothing changed');
  });
});

test('delete_model: success then gone; deleting again fails', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    assert.deepEqual(await ok(s, 'delete_model', { id: 'shop' }), { deleted: true, id: 'shop' });
    assert.deepEqual(await ok(s, 'list_models'), []);
    await fails(s, 'get_model_info', { id: 'shop' });
    await fails(s, 'delete_model', { id: 'shop' });
  });
});

test('get_view: evaluated view with bound values; unknown view / model fail', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.price': 2, '$.qty': 3 } });
    const v = await ok(s, 'get_view', { id: 'shop' });
    assert.equal(v.viewId, 'main');
    const flat = JSON.stringify(v);
    assert.ok(flat.includes('totalField'), `the view lists its components: ${flat.slice(0, 400)}`);
    const byView = await ok(s, 'get_view', { id: 'shop', viewId: 'main' });
    assert.deepEqual(byView, v);
    await fails(s, 'get_view', { id: 'shop', viewId: 'nope' });
    await fails(s, 'get_view', { id: 'nope' });
  });
});

test('get_library: layers and exports; a model without a library fails', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    const lib = await ok(s, 'get_library', { id: 'shop' });
    assert.match(JSON.stringify(lib), /money/);
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    assert.match((await fails(s, 'get_library', { id: 'demo' })).text, /library/);
  });
});

test('upload_blob / download_blob: round trip; bad base64 and unknown blob fail', T, async () => {
  await withServer(async (s) => {
    const data = Buffer.from('valem blob \u0000\u0001\u00ff').toString('base64');
    const up = await ok(s, 'upload_blob', { data, mediaType: 'application/x-test' });
    assert.equal(typeof up.blobId, 'string');
    assert.equal(up.bytes, Buffer.from(data, 'base64').length);
    assert.equal(up.mediaType, 'application/x-test');
    const down = await ok(s, 'download_blob', { blobId: up.blobId });
    assert.equal(down.data, data);
    assert.equal(down.blobId, up.blobId);
    assert.equal(down.mediaType, 'application/x-test');
    const again = await ok(s, 'upload_blob', { data });
    assert.equal(again.blobId, up.blobId, 'content-addressed');
    await fails(s, 'upload_blob', { data: '%%% not base64 %%%' });
    await fails(s, 'download_blob', { blobId: 'f'.repeat(64) });
    // with modelId: only when that model's state references the blob
    await createShop(s);
    await fails(s, 'download_blob', { blobId: up.blobId, modelId: 'shop' });
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.attachment': up.blobId } });
    assert.equal((await ok(s, 'download_blob', { blobId: up.blobId, modelId: 'shop' })).data, data);
  });
});

test('get_domain_guidance: known topic returns guidance; bad arguments fail', T, async () => {
  await withServer(async (s) => {
    const g = await ok(s, 'get_domain_guidance', { topics: ['percentage', 'proration'] });
    assert.equal(typeof g.guidance, 'string');
    assert.deepEqual(g.topics.map((t) => t.id), ['percentage', 'proration']);
    assert.ok(g.guidance.length > 50);
    await fails(s, 'get_domain_guidance', { topics: 'percentage' });
  });
});

test('get_domain_guidance: unknown topic is reported, not fatal', T, async () => {
  await withServer(async (s) => {
    const g = await ok(s, 'get_domain_guidance', { topics: ['no-such-topic'] });
    assert.deepEqual(g.unknownTopics, ['no-such-topic']);
    assert.equal(typeof g.guidance, 'string');
    await fails(s, 'get_domain_guidance', {});
  });
});

test('validate_spec: valid, invalid with findings, and bad arguments', T, async () => {
  await withServer(async (s) => {
    const good = await ok(s, 'validate_spec', { spec: shopSpec() });
    assert.equal(good.valid, true);
    assert.deepEqual(good.errors, []);
    const bad = await ok(s, 'validate_spec', { spec: { id: 'x', schema: {}, derivations: [{ path: '$.a', expr: '1 +' }] } });
    assert.equal(bad.valid, false);
    assert.ok(bad.errors.length >= 1);
    assert.equal(typeof bad.errors[0].location, 'string');
    assert.equal(typeof bad.errors[0].message, 'string');
    assert.match(bad.errors[0].location, /derivations/);
    await fails(s, 'validate_spec', { spec: 'not an object' });
  });
});

test('eval_expression: result, undefined, library + constants, compile/eval errors, bad arguments', T, async () => {
  await withServer(async (s) => {
    assert.deepEqual(await ok(s, 'eval_expression', { expr: 'price * qty', input: { price: 10, qty: 3 } }), { ok: true, undefined: false, result: 30 });
    const u = await ok(s, 'eval_expression', { expr: 'missing', input: {} });
    assert.equal(u.ok, true);
    assert.equal(u.undefined, true);
    const lib = await ok(s, 'eval_expression', {
      expr: '$double($const.base)',
      library: '( $double := function($x) { $x * 2 }; ["double"] )',
      constants: { base: 21 },
    });
    assert.equal(lib.result, 42);
    assert.deepEqual(lib.libraryExports, ['double']);
    const c = await ok(s, 'eval_expression', { expr: 'price *' });
    assert.equal(c.ok, false);
    assert.equal(c.error, 'compile');
    assert.ok(c.message.length > 0);
    const e = await ok(s, 'eval_expression', { expr: '$number("abc") + $undefinedFn(1)', input: {} });
    assert.equal(e.ok, false);
    assert.ok(['evaluation', 'compile'].includes(e.error));
    await fails(s, 'eval_expression', { input: {} });
  });
});

test('test_spec: embedded tests pass; ad-hoc failing case reports failures; invalid spec fails', T, async () => {
  await withServer(async (s) => {
    const r = await ok(s, 'test_spec', { spec: shopSpec() });
    assert.deepEqual({ t: r.total, p: r.passed, f: r.failed }, { t: 1, p: 1, f: 0 });
    const adhoc = await ok(s, 'test_spec', {
      spec: shopSpec(),
      tests: [
        { description: 'right', given: { '$.price': 3, '$.qty': 3 }, expect: { '$.total': 9 } },
        { description: 'wrong', given: { '$.price': 3, '$.qty': 3 }, expect: { '$.total': 10 } },
      ],
    });
    assert.deepEqual({ t: adhoc.total, p: adhoc.passed, f: adhoc.failed }, { t: 2, p: 1, f: 1 });
    const wrong = adhoc.results.find((x) => x.description === 'wrong');
    assert.equal(wrong.passed, false);
    assert.deepEqual({ path: wrong.failures[0].path, expected: wrong.failures[0].expected, actual: wrong.failures[0].actual }, { path: '$.total', expected: 10, actual: 9 });
    await fails(s, 'test_spec', { spec: { id: 'x', schema: {}, derivations: [{ path: '$.a', expr: '1 +' }] } });
    assert.deepEqual(await ok(s, 'list_models'), [], 'test_spec registers nothing');
  });
});

test('dry_run: merged state after sample mutations; schema violation is structured; nothing registered', T, async () => {
  await withServer(async (s) => {
    const st = await ok(s, 'dry_run', { spec: WORKED_DEMO, mutations: { '$.price': 10, '$.qty': 3 } });
    assert.equal(st.total, 30);
    const two = await ok(s, 'dry_run', { spec: WORKED_DEMO, mutations: [{ '$.price': 10, '$.qty': 3 }, { '$.qty': 4 }] });
    assert.equal(two.total, 40);
    const { result, json } = await rawCall(s, 'dry_run', { spec: shopSpec(), mutations: { '$.price': -1 } });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Schema violation');
    await fails(s, 'dry_run', { spec: { id: 'x', schema: {}, derivations: [{ path: '$.a', expr: '1 +' }] } });
    assert.deepEqual(await ok(s, 'list_models'), []);
  });
});

test('result-size guard: a committed write over it is not an error, its note passes the output schema', T, async () => {
  await withServer(async (s) => {
    await ok(s, 'create_model', { spec: { id: 'rows', schema: {}, derivations: [{ path: '$.n', expr: '$count(rows)' }] } });
    const mutations = Object.fromEntries(Array.from({ length: 3000 }, (_, i) => [`$.rows[${i}]`, { i }]));
    // ok() goes through the SDK's callTool, which validates structuredContent itself.
    const note = await ok(s, 'mutate', { id: 'rows', mutations });
    assert.equal(note.committed, true);
    assert.equal(note.counts.mutatedPaths, 3000);
    assert.match(note.hint, /do not send the write again/);
    assert.equal(await ok(s, 'get_field', { id: 'rows', path: '$.n' }), 3000);
  });
});

test('evolve_spec: an evolution naming only unknown keys is refused; beside a change they are warnings', T, async () => {
  await withServer(async (s) => {
    await ok(s, 'create_model', { spec: WORKED_DEMO });
    const { text } = await fails(s, 'evolve_spec', { id: 'demo', evolution: { addDerivations: [{ path: '$.x', expr: '1' }] } });
    assert.match(text, /did you mean `upsertDerivations`/);
    const info = await ok(s, 'evolve_spec', { id: 'demo', evolution: { upsertDerivations: [{ path: '$.x', expr: '1' }], addConstraints: [] } });
    assert.equal(info.derivationCount, 2);
    assert.equal(info.warnings[0].location, 'addConstraints');
  });
});

test('result-size guard: an oversized read is withheld with a compact "Result too large" note', T, async () => {
  await withServer(async (s) => {
    await createShop(s);
    await ok(s, 'mutate', { id: 'shop', mutations: { '$.note': 'x'.repeat(60_000) } });
    const { result, json } = await call(s, 'get_state', { id: 'shop' });
    assert.equal(result.isError, true);
    assert.equal(json.error, 'Result too large');
    assert.equal(typeof json.hint, 'string');
    assert.ok(result.content[0].text.length < 2000);
    assert.deepEqual(await ok(s, 'get_state', { id: 'shop', paths: ['$.price'] }), {});
  });
});
