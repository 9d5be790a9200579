"""Handshake, the tool catalog and its schemas, resources, subscriptions and logging, as the
official Python SDK sees them."""

import json

import anyio

import jsonschema
import mcp
import pytest

from conftest import DEMO, EXAMPLES, MODERN, TRANSPORT, VERSION, connect

pytestmark = pytest.mark.anyio

TOOLS = {
    "list_models", "create_model", "get_model_info", "get_spec", "get_state", "get_field",
    "get_effective_schema", "mutate", "patch_model", "explain", "get_history", "get_audit",
    "verify_audit", "snapshot", "restore", "evolve_spec", "delete_model", "get_view",
    "get_library", "upload_blob", "download_blob", "get_domain_guidance", "validate_spec",
    "eval_expression", "test_spec", "dry_run",
}


async def test_initialize_negotiates_and_advertises():
    async with connect() as s:
        c = s.client
        assert c.protocol_version == VERSION
        caps = c.server_capabilities
        assert caps.tools is not None
        assert caps.resources is not None and caps.resources.subscribe is True
        assert caps.logging is not None
        assert caps.prompts is None
        assert "create_model" in c.instructions and "mutate" in c.instructions
        if MODERN:
            # Discovered, not initialized: the identity comes in the result's _meta, the
            # tasks extension is advertised, and no log arrives without a per-request level.
            d = c.session.discover_result
            assert d is not None and c.session.initialize_result is None
            assert d.supported_versions == ["2026-07-28"]
            assert "io.modelcontextprotocol/tasks" in (caps.extensions or {})
            await s.ok("list_models")
            await anyio.sleep(0.2)
            assert s.logs == []
            return
        assert c.server_info.name == "valem"
        # The readiness log line arrives after notifications/initialized.
        with anyio.fail_after(10):
            while not any("ready" in str(l.data) for l in s.logs):
                await anyio.sleep(0.01)
        assert s.logs[0].level == "info" and s.logs[0].logger == "valem"


async def test_tool_catalog_titles_annotations_and_schemas():
    async with connect() as s:
        tools = (await s.client.list_tools()).tools
        assert {t.name for t in tools} == TOOLS
        for t in tools:
            assert t.title and t.description, t.name
            a = t.annotations
            assert a.open_world_hint is False, t.name
            if t.name.startswith(("list_", "get_")) or t.name == "explain":
                assert a.read_only_hint is True, t.name
            if t.name in ("delete_model", "evolve_spec"):
                assert a.read_only_hint is False and a.destructive_hint is True, t.name
            elif not a.read_only_hint:
                assert a.destructive_hint is False, t.name
            jsonschema.Draft202012Validator.check_schema(t.input_schema)
            assert t.input_schema["type"] == "object"
            if t.output_schema is not None:
                jsonschema.Draft202012Validator.check_schema(t.output_schema)
                assert t.output_schema["type"] == "object"
        by = {t.name: t for t in tools}
        spec_schema = by["create_model"].input_schema["properties"]["spec"]
        for section in ("derivations", "constraints", "metaDerivations", "effects", "tests", "viewDefinition"):
            assert section in spec_schema["properties"], section
        evo = by["evolve_spec"].input_schema["properties"]["evolution"]
        for field in ("upsertDerivations", "expectedVersion", "backfill", "upsertSchemaNodes"):
            assert field in evo["properties"], field
        # Every bundled example satisfies the advertised ModelSpec schema.
        v = jsonschema.Draft202012Validator(spec_schema)
        for p in EXAMPLES:
            v.validate(json.loads(p.read_text()))
        # Arrays/scalars carry no outputSchema; always-object results do.
        for name in ("list_models", "get_history", "explain", "get_field"):
            assert by[name].output_schema is None, name
        for name in ("create_model", "get_model_info", "mutate", "patch_model", "validate_spec", "test_spec", "eval_expression"):
            assert by[name].output_schema is not None, name
        topics = by["get_domain_guidance"].input_schema["properties"]["topics"]["items"]["enum"]
        assert len(topics) == 14 and "amortization_schedule" in topics and "proration" in topics


async def test_unknown_tool_is_a_protocol_error():
    async with connect() as s:
        with pytest.raises(mcp.MCPError) as e:
            await s.client.call_tool("no_such_tool", {})
        assert e.value.code == -32602, e.value
        assert await s.ok("list_models") == []


async def test_resources_list_read_and_templates():
    async with connect() as s:
        await s.ok("create_model", {"spec": DEMO})
        res = {str(r.uri): r for r in (await s.client.list_resources()).resources}
        for g in ("model-spec-format", "jsonata-gotchas", "spec-evolution", "view-system"):
            r = res[f"valem://guide/{g}"]
            assert r.mime_type == "text/markdown"
            body = (await s.client.read_resource(f"valem://guide/{g}")).contents[0]
            assert body.mime_type == "text/markdown" and body.text.startswith("#") and len(body.text) > 2000
        for sch in ("model-spec", "spec-evolution"):
            body = (await s.client.read_resource(f"valem://schema/{sch}")).contents[0]
            assert body.mime_type == "application/json"
            jsonschema.Draft202012Validator.check_schema(json.loads(body.text))
        for p in EXAMPLES:
            uri = f"valem://examples/{p.stem}"
            assert uri in res
            body = (await s.client.read_resource(uri)).contents[0]
            assert json.loads(body.text) == json.loads(p.read_text())
        assert "valem://state/demo" in res
        templates = {t.uri_template for t in (await s.client.list_resource_templates()).resource_templates}
        assert templates == {"valem://examples/{name}", "valem://state/{modelId}"}
        await s.ok("mutate", {"id": "demo", "mutations": {"$.price": 2, "$.qty": 5}})
        body = (await s.client.read_resource("valem://state/demo")).contents[0]
        assert json.loads(body.text) == {"price": 2, "qty": 5, "total": 10}
        for bad in ("valem://nope", "valem://examples/nope", "valem://state/nope"):
            with pytest.raises(mcp.MCPError) as e:
                await s.client.read_resource(bad)
            # A missing resource: -32002 in the handshake era, -32602 since 2026-07-28.
            assert e.value.code == (-32602 if MODERN else -32002), (bad, e.value)


async def test_subscribe_notifies_on_commit_until_unsubscribed():
    if MODERN:
        pytest.skip("resources/subscribe is not part of 2026-07-28: see test_listen_*")
    async with connect() as s:
        await s.ok("create_model", {"spec": DEMO})
        await s.client.subscribe_resource("valem://state/demo")

        def updated(m):
            root = getattr(m, "root", m)
            return getattr(root, "method", None) == "notifications/resources/updated" and str(root.params.uri) == "valem://state/demo"

        await s.ok("mutate", {"id": "demo", "mutations": {"$.price": 1, "$.qty": 1}})
        await s.wait_for(updated, "resources/updated")
        await s.client.unsubscribe_resource("valem://state/demo")
        seen = sum(1 for m in s.messages if updated(m))
        await s.ok("mutate", {"id": "demo", "mutations": {"$.qty": 2}})
        await s.ok("list_models")  # a full round trip after the mutation
        assert sum(1 for m in s.messages if updated(m)) == seen


async def test_logging_set_level():
    if MODERN:
        pytest.skip("logging/setLevel is not part of 2026-07-28 (the level is per request)")
    async with connect() as s:
        await s.client.set_logging_level("warning")
        assert await s.ok("list_models") == []


async def test_listen_notifies_on_commit_until_closed():
    if not MODERN:
        pytest.skip("subscriptions/listen is the 2026-07-28 era's")
    async with connect() as s:
        await s.ok("create_model", {"spec": DEMO})
        async with s.client.listen(resource_subscriptions=["valem://state/demo"]) as sub:
            assert [str(u) for u in sub.honored.resource_subscriptions] == ["valem://state/demo"]
            await s.ok("mutate", {"id": "demo", "mutations": {"$.price": 1, "$.qty": 1}})
            with anyio.fail_after(10):
                async for event in sub:
                    assert str(event.uri) == "valem://state/demo", event
                    break
        # Closed: a later commit reaches nobody, and the session works on.
        await s.ok("mutate", {"id": "demo", "mutations": {"$.qty": 2}})
        assert await s.ok("get_field", {"id": "demo", "path": "$.total"}) == 2


async def test_listen_sees_another_agents_commit():
    if not MODERN or TRANSPORT == "stdio":
        pytest.skip("two agents share models only on a daemon in the 2026-07-28 era")
    async with connect() as a:
        await a.ok("create_model", {"spec": DEMO})
        async with a.client.listen(resource_subscriptions=["valem://state/demo"]) as sub:
            # A second agent on the same daemon: its own client, its own process for proxy.
            server = a.server
            async with mcp.Client(server, mode="auto") as b:
                assert b.protocol_version == "2026-07-28"
                r = await b.call_tool("mutate", {"id": "demo", "mutations": {"$.price": 3, "$.qty": 3}})
                assert not r.is_error, r
            with anyio.fail_after(10):
                async for event in sub:
                    assert str(event.uri) == "valem://state/demo"
                    break
