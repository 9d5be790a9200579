"""Shared helpers: a real valem server per test, driven by the official SDK's high-level
`mcp.Client` (which probes `server/discover` first and falls back to `initialize`), and checks
applied to every tool result: structuredContent validates against the tool's outputSchema and
equals the parsed text block; arrays and scalars come as text only.

`VALEM_TRANSPORT` picks how the client reaches valem (every test runs unchanged in each mode):
  stdio  (default) `valem mcp`, the embedded engine, over stdio;
  http   a fresh `valem serve` per test, reached over Streamable HTTP at /mcp;
  proxy  a fresh `valem serve` per test, reached through `valem mcp --url` (the stdio proxy).

`VALEM_ERA` picks the protocol era:
  modern (default) the client's own choice (mode "auto"), which must settle on 2026-07-28;
  legacy           the `initialize` handshake (mode "legacy"), which settles on 2025-11-25."""

import json
import os
import pathlib
import subprocess
from contextlib import asynccontextmanager, contextmanager

import anyio
import jsonschema
import mcp
import pytest
from mcp import StdioServerParameters

REPO = pathlib.Path(__file__).resolve().parents[3]
VALEM_BIN = os.environ.get("VALEM_BIN", str(REPO / "target" / "debug" / "valem"))
EXAMPLES = sorted((REPO / "examples").glob("*.json"))
TIMEOUT = 30
TRANSPORT = os.environ.get("VALEM_TRANSPORT", "stdio")
if TRANSPORT not in ("stdio", "http", "proxy"):
    raise SystemExit(f"VALEM_TRANSPORT must be stdio, http or proxy, not {TRANSPORT!r}")
ERA = os.environ.get("VALEM_ERA", "modern")
if ERA not in ("modern", "legacy"):
    raise SystemExit(f"VALEM_ERA must be modern or legacy, not {ERA!r}")
MODERN = ERA == "modern"
# The revision each era must settle on.
VERSION = "2026-07-28" if MODERN else "2025-11-25"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Session:
    """One connected client plus the notifications it has seen."""

    def __init__(self, client, logs, messages, server=None):
        self.client = client
        # How to reach the same models again (a second agent's client).
        self.server = server
        self.logs = logs
        self.messages = messages
        self._schemas = None

    async def output_schemas(self):
        if self._schemas is None:
            tools = (await self.client.list_tools()).tools
            self._schemas = {t.name: t.output_schema for t in tools}
        return self._schemas

    async def call(self, name, args=None):
        """Call a tool; return (is_error, value) where value is structuredContent or the parsed text."""
        r = await self.client.call_tool(name, args or {})
        text = r.content[0].text
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        sc = r.structured_content
        if sc is not None:
            assert sc == parsed, f"{name}: structuredContent differs from the text block"
        else:
            assert r.is_error or not isinstance(parsed, dict), f"{name}: object result without structuredContent"
        if not r.is_error:
            schema = (await self.output_schemas()).get(name)
            if schema is not None:
                assert sc is not None, f"{name} declares an outputSchema but returned no structuredContent"
                jsonschema.Draft202012Validator(schema).validate(sc)
        return r.is_error, (sc if sc is not None else parsed)

    async def ok(self, name, args=None):
        err, v = await self.call(name, args)
        assert not err, f"{name}({args}) failed: {v}"
        return v

    async def fails(self, name, args=None):
        err, v = await self.call(name, args)
        assert err, f"{name}({args}) should fail, got {v}"
        return v

    async def wait_for(self, predicate, what):
        with anyio.fail_after(10):
            while True:
                for m in list(self.messages):
                    if predicate(m):
                        return m
                await anyio.sleep(0.01)


@asynccontextmanager
async def connect(env=None, args=(), local_args=()):
    """`args` go to the process that runs the models (`valem mcp`, or `valem serve` for http and
    proxy); `local_args` also to the proxy (which serves the authoring tools itself)."""
    logs, messages = [], []

    async def on_log(params):
        logs.append(params)

    async def on_message(msg):
        messages.append(msg)

    env = {**os.environ, **(env or {})}
    env.pop("VALEM_API_KEY", None)
    with daemon(env, args) as base:
        if TRANSPORT == "stdio":
            server = StdioServerParameters(command=VALEM_BIN, args=["mcp", *args], env=env)
        elif TRANSPORT == "proxy":
            server = StdioServerParameters(
                command=VALEM_BIN, args=["mcp", "--url", base, *local_args], env=env
            )
        else:
            server = base + "/mcp"
        mode = "auto" if MODERN else "legacy"
        with anyio.fail_after(TIMEOUT):
            async with mcp.Client(
                server, mode=mode, logging_callback=on_log, message_handler=on_message
            ) as client:
                assert client.protocol_version == VERSION, client.protocol_version
                yield Session(client, logs, messages, server)


@contextmanager
def daemon(env, args=()):
    """For http and proxy: a fresh `valem serve` on a free loopback port, stopped (SIGTERM, which
    drains it) afterwards; yields its base URL. For stdio there is no daemon (yields None)."""
    if TRANSPORT == "stdio":
        yield None
        return
    proc = subprocess.Popen(
        [VALEM_BIN, "serve", "--listen", "127.0.0.1:0", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # The first stdout line is "valem listening on http://127.0.0.1:PORT".
        line = proc.stdout.readline()
        if "http://" not in line:
            raise RuntimeError(f"valem serve did not report its address: {line!r}")
        yield "http://" + line.strip().rsplit("http://", 1)[1]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def example(path):
    return json.loads(path.read_text())


DEMO = {
    "id": "demo",
    "version": "1",
    "schema": {},
    "derivations": [{"path": "$.total", "expr": "price * qty"}],
    "constraints": [],
    "metaDerivations": [],
    "tests": [],
}

SHOP = {
    "id": "shop",
    "version": "1.0.0",
    "schema": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0},
            "qty": {"type": "integer", "minimum": 0},
            "items": {"type": "array", "items": {"type": "object"}},
            "photo": {"type": "string"},
        },
    },
    "derivations": [
        {"path": "$.total", "expr": "price * qty"},
        {"path": "$.count", "expr": "$count(items)"},
    ],
    "metaDerivations": [{"path": "$.qty", "property": "maximum", "expr": "100"}],
    "constraints": [{"id": "cap", "expr": "total <= 1000", "message": "total above 1000", "policy": "rollback"}],
    "library": "( $double := function($x) { $x * 2 }; [\"double\"] )",
    "viewDefinition": {
        "defaultView": "main",
        "views": [{"id": "main", "title": "Shop", "components": [
            {"id": "price", "type": "numericField", "bind": "$.price", "label": "Price"},
            {"id": "total", "type": "label", "bind": "$.total", "label": "Total"},
        ]}],
    },
    "tests": [{"description": "total", "given": {"$.price": 2, "$.qty": 3}, "expect": {"$.total": 6}}],
}
