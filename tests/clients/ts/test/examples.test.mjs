// Every bundled example: create_model → test_spec all pass → mutate with its first test's
// `given` → get_state reflects it → get_view returns an object when the spec has a viewDefinition.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { withServer, ok, call, loadExamples, TEST_TIMEOUT } from '../lib.mjs';

for (const ex of loadExamples()) {
  test(`example ${ex.name}: create, test_spec passes, mutate with first given, get_view`, { timeout: TEST_TIMEOUT }, async () => {
    await withServer(async (s) => {
      const info = await ok(s, 'create_model', { spec: ex.spec });
      assert.equal(info.id, ex.spec.id);
      assert.equal(info.derivationCount, (ex.spec.derivations || []).length);
      assert.equal(info.constraintCount, (ex.spec.constraints || []).length);

      const report = await ok(s, 'test_spec', { spec: ex.spec });
      const failing = report.results.filter((r) => !r.passed).map((r) => `${r.description}: ${JSON.stringify(r.failures)}`);
      assert.equal(report.total, (ex.spec.tests || []).length);
      assert.equal(report.failed, 0, `failing embedded tests:\n${failing.join('\n')}`);
      assert.equal(report.passed, report.total);

      const first = (ex.spec.tests || [])[0];
      if (first) {
        const m = await ok(s, 'mutate', { id: ex.spec.id, mutations: first.given });
        assert.equal(m.success, true);
        assert.ok(Array.isArray(m.mutatedPaths) && m.mutatedPaths.length >= 1);
        // the live model now shows the first test's expectations (plain values only)
        for (const [addr, want] of Object.entries(first.expect)) {
          if (want !== null && typeof want === 'object' && '$meta' in want) continue;
          const { result, json } = await call(s, 'get_field', { id: ex.spec.id, path: addr });
          assert.equal(result.isError, false, `get_field ${addr}: ${result.content[0].text}`);
          assert.deepEqual(json, want, `${addr} after the first given`);
        }
      }

      if (ex.spec.viewDefinition) {
        const v = await ok(s, 'get_view', { id: ex.spec.id });
        assert.ok(v && typeof v === 'object' && !Array.isArray(v), 'get_view returns an object');
        assert.equal(v.modelId, ex.spec.id);
        assert.ok(Array.isArray(v.components) && v.components.length > 0, 'the evaluated view has components');
      }
      const verify = await ok(s, 'verify_audit', { id: ex.spec.id });
      assert.equal(verify.valid, true);
    });
  });
}
