// The contract's remote_with_browser mode, end to end: an MCP client (the official TypeScript
// SDK) behind `valem mcp --url … --browser` calls pair_browser; headless Chromium opens the
// verification link and approves; the agent creates a model; the page shows it; the page edits
// a field; the agent gets notifications/resources/updated and reads the new derived value.
// Then every bundled example is created by the agent and rendered by the page, with no console
// error. Screenshots are saved under $VALEM_ARTIFACTS.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import readline from 'node:readline';
import { test, after } from 'node:test';
import { fileURLToPath } from 'node:url';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { ResourceUpdatedNotificationSchema } from '@modelcontextprotocol/sdk/types.js';
import { chromium } from 'playwright-core';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, '..', '..', '..');
const VALEM_BIN = process.env.VALEM_BIN || path.join(REPO, 'target', 'debug', 'valem');
const ARTIFACTS = process.env.VALEM_ARTIFACTS || path.join(REPO, 'target', 'test-artifacts', 'browser');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const KEY = 'browser-test-key';

fs.mkdirSync(ARTIFACTS, { recursive: true });
const cleanups = [];
after(async () => {
  for (const c of cleanups.reverse()) await c();
});

/** A fresh daemon on a free loopback port; resolves with its base URL. */
function startDaemon() {
  const child = spawn(VALEM_BIN, ['serve', '--listen', '127.0.0.1:0', '--api-key', KEY, '--pairing-interval', '1'], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, VALEM_API_KEY: '' },
  });
  let stderr = '';
  child.stderr.on('data', (d) => { stderr += d; });
  cleanups.push(async () => { child.kill('SIGTERM'); });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`valem serve did not start: ${stderr}`)), 20_000);
    readline.createInterface({ input: child.stdout }).once('line', (line) => {
      clearTimeout(timer);
      const m = line.match(/http:\/\/(127\.0\.0\.1:\d+)/);
      if (!m) reject(new Error(`no address in ${line}`));
      else resolve(`http://${m[1]}`);
    });
  });
}

async function connectAgent(base) {
  const transport = new StdioClientTransport({
    command: VALEM_BIN,
    args: ['mcp', '--url', base, '--api-key', KEY, '--browser'],
    stderr: 'pipe',
  });
  const client = new Client({ name: 'sandbox-browser-test', version: '0.0.0' });
  await client.connect(transport);
  cleanups.push(async () => { await client.close(); });
  return client;
}

function parseText(result) {
  return JSON.parse(result.content[0].text);
}

const DEMO = {
  id: 'demo',
  schema: {
    type: 'object',
    properties: { price: { type: 'number', minimum: 0 }, qty: { type: 'integer', minimum: 0 }, total: { type: 'number', readOnly: true } },
  },
  derivations: [{ path: '$.total', expr: 'price * qty' }],
  viewDefinition: {
    defaultView: 'main',
    views: [{
      id: 'main',
      label: 'Order',
      components: [
        { id: 'price', type: 'numericField', label: 'Price', bind: '$.price' },
        { id: 'qty', type: 'numericField', label: 'Quantity', bind: '$.qty' },
        { id: 'total', type: 'label', label: 'Total', bind: '$.total' },
      ],
    }],
  },
};

test('pair_browser, a shared model, edits both ways, every example renders', { timeout: 240_000 }, async () => {
  const base = await startDaemon();
  const agent = await connectAgent(base);
  const tools = await agent.listTools();
  assert.ok(tools.tools.some((t) => t.name === 'pair_browser'), 'pair_browser is offered with --browser');

  const browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: ['--no-sandbox'] });
  cleanups.push(async () => { await browser.close(); });
  const page = await browser.newPage({ viewport: { width: 1200, height: 900 } });
  const consoleErrors = [];
  page.on('console', (m) => { if (m.type() === 'error') consoleErrors.push(m.text()); });
  page.on('pageerror', (e) => consoleErrors.push(String(e)));

  // 1. The agent asks to pair: it gets the link and code at once.
  const first = (await agent.callTool({ name: 'pair_browser', arguments: {} })).structuredContent;
  assert.equal(first.status, 'pending', JSON.stringify(first));
  assert.ok(first.verificationUriComplete.startsWith(`${base}/sandbox/#pair=`), first.verificationUriComplete);

  // 2. The developer opens the link: the approval screen with the code filled in, and the
  //    code gone from the address bar.
  await page.goto(first.verificationUriComplete);
  await page.getByRole('heading', { name: 'Approve pairing' }).waitFor();
  assert.equal(await page.getByLabel('Confirmation code').inputValue(), first.userCode);
  assert.ok(!page.url().includes(first.userCode), `the code was stripped from ${page.url()}`);
  await page.screenshot({ path: path.join(ARTIFACTS, '01-approve.png'), fullPage: true });
  // The agent waits (resuming the same pairing) while the developer approves.
  const waiting = agent.callTool({ name: 'pair_browser', arguments: {} }, undefined, { timeout: 70_000 });
  await page.getByRole('button', { name: 'Approve' }).click();
  await page.locator('#badge', { hasText: 'paired' }).waitFor();
  const paired = (await waiting).structuredContent;
  assert.equal(paired.status, 'paired', JSON.stringify(paired));

  // 3. The agent creates a model; the page lists it and renders its view.
  const created = await agent.callTool({ name: 'create_model', arguments: { spec: DEMO } });
  assert.equal(created.isError, false, JSON.stringify(created));
  await agent.callTool({ name: 'mutate', arguments: { id: 'demo', mutations: { '$.price': 2.5, '$.qty': 4 } } });
  const updates = [];
  agent.setNotificationHandler(ResourceUpdatedNotificationSchema, (n) => { updates.push(n.params.uri); });
  await agent.subscribeResource({ uri: 'valem://state/demo' });
  await page.getByRole('button', { name: 'demo', exact: true }).click();
  const qty = page.getByLabel('Quantity');
  await qty.waitFor();
  assert.equal(await qty.inputValue(), '4');
  await page.locator('[data-component="total"] .value', { hasText: '10' }).waitFor();
  await page.screenshot({ path: path.join(ARTIFACTS, '02-model.png'), fullPage: true });

  // 4. The developer edits a field: the agent is told and reads the new derived value.
  await qty.fill('6');
  await qty.press('Tab');
  await page.locator('[data-component="total"] .value', { hasText: '15' }).waitFor();
  const deadline = Date.now() + 10_000;
  while (!updates.includes('valem://state/demo')) {
    assert.ok(Date.now() < deadline, 'no resources/updated after the browser edit');
    await new Promise((r) => setTimeout(r, 50));
  }
  const total = await agent.callTool({ name: 'get_field', arguments: { id: 'demo', path: '$.total' } });
  assert.equal(parseText(total), 15);

  // 5. A rejected edit is shown at the field, and the model is unchanged.
  await qty.fill('-3');
  await qty.press('Tab');
  await page.locator('[data-component="qty"] .error', { hasText: 'Schema violation' }).waitFor();
  assert.equal(parseText(await agent.callTool({ name: 'get_field', arguments: { id: 'demo', path: '$.qty' } })), 6);
  await page.screenshot({ path: path.join(ARTIFACTS, '03-rejected.png'), fullPage: true });
  // The refused write is the only failed request so far (Chromium logs it as a console error).
  assert.deepEqual(consoleErrors, ['Failed to load resource: the server responded with a status of 422 (Unprocessable Entity)']);
  consoleErrors.length = 0;

  // 6. "Why is this number?"
  await page.getByRole('button', { name: 'Why is $.total this value?' }).click();
  await page.locator('#explain-body code', { hasText: 'price * qty' }).first().waitFor();

  // 7. The agent's list is the session's: demo (and, below, the examples) only.
  const listed = parseText(await agent.callTool({ name: 'list_models', arguments: {} }));
  assert.deepEqual(listed.map((m) => m.id ?? m), ['demo']);

  // 8. Every bundled example: created by the agent, rendered by the page, no console error.
  const examples = fs.readdirSync(path.join(REPO, 'examples')).filter((f) => f.endsWith('.json')).sort();
  assert.ok(examples.length >= 10, `examples: ${examples}`);
  for (const file of examples) {
    const spec = JSON.parse(fs.readFileSync(path.join(REPO, 'examples', file), 'utf8'));
    const id = spec.id === 'demo' ? 'demo-example' : spec.id;
    spec.id = id;
    const r = await agent.callTool({ name: 'create_model', arguments: { spec } });
    assert.equal(r.isError, false, `${file}: ${JSON.stringify(r)}`);
    const button = page.getByRole('button', { name: id, exact: true });
    await button.waitFor({ timeout: 10_000 });
    await button.click();
    await page.locator('#model-title', { hasText: id }).waitFor();
    await page.waitForFunction(() => document.getElementById('view').children.length > 0, null, { timeout: 10_000 });
    await page.waitForLoadState('networkidle');
    const viewError = await page.locator('#view-error').textContent();
    assert.equal(viewError, '', `${file}: the view failed: ${viewError}`);
    await page.screenshot({ path: path.join(ARTIFACTS, `example-${id}.png`), fullPage: true });
  }
  assert.deepEqual(consoleErrors, [], `console errors: ${consoleErrors.join('\n')}`);

  // 9. A narrow screen: the same page, one column, still usable.
  await page.setViewportSize({ width: 380, height: 800 });
  await page.getByRole('button', { name: 'demo', exact: true }).click();
  await page.getByLabel('Quantity').waitFor();
  await page.screenshot({ path: path.join(ARTIFACTS, '04-narrow.png'), fullPage: true });
});
