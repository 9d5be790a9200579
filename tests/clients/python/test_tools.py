"""Every tool on a success path and on a failure path, through the official Python SDK. Each
successful object result is validated against the tool's outputSchema (in `Session.call`)."""

import base64
import copy

import pytest

from conftest import DEMO, SHOP, connect

pytestmark = pytest.mark.anyio


async def test_worked_example():
    async with connect() as s:
        info = await s.ok("create_model", {"spec": DEMO})
        assert info["id"] == "demo" and info["version"] == "1" and info["derivationCount"] == 1
        r = await s.ok("mutate", {"id": "demo", "mutations": {"$.price": 10, "$.qty": 3}})
        assert r["success"] is True and r["derivedUpdated"] == ["$.total"]
        assert await s.ok("get_state", {"id": "demo"}) == {"price": 10, "qty": 3, "total": 30}


async def test_registry_tools():
    async with connect() as s:
        assert await s.ok("list_models") == []
        info = await s.ok("create_model", {"spec": SHOP})
        assert info["constraintCount"] == 1 and info["metaDerivationCount"] == 1
        assert info["views"] == ["main"] and info["hasLibrary"] is True
        dup = await s.fails("create_model", {"spec": SHOP})
        assert "already exists" in dup
        bad = await s.fails("create_model", {"spec": {"id": "x", "schema": {}, "derivations": [{"path": "$.a", "expr": "1 +"}]}})
        assert "derivations[0]" in bad
        await s.fails("create_model", {"spec": "not an object"})
        assert await s.ok("list_models") == ["shop"]
        assert (await s.ok("get_model_info", {"id": "shop"}))["id"] == "shop"
        assert "not found" in await s.fails("get_model_info", {"id": "nope"})
        spec = await s.ok("get_spec", {"id": "shop"})
        assert spec["derivations"] == SHOP["derivations"]
        await s.fails("get_spec", {"id": "nope"})
        lib = await s.ok("get_library", {"id": "shop"})
        assert [e["name"] for e in lib["exports"]] == ["double"]
        await s.ok("create_model", {"spec": DEMO})
        assert "no library" in await s.fails("get_library", {"id": "demo"})
        assert await s.ok("delete_model", {"id": "demo"}) == {"deleted": True, "id": "demo"}
        await s.fails("delete_model", {"id": "demo"})
        assert await s.ok("list_models") == ["shop"]


async def test_reads_and_projections():
    async with connect() as s:
        await s.ok("create_model", {"spec": SHOP})
        await s.ok("mutate", {"id": "shop", "mutations": {"$.price": 2, "$.qty": 3, "$.items": [{"a": {"b": 1}}, {"a": {"b": 2}}]}})
        full = await s.ok("get_state", {"id": "shop"})
        assert full["total"] == 6 and full["count"] == 2
        assert await s.ok("get_state", {"id": "shop", "paths": ["$.total", "$.items[1].a", "$.missing"]}) == {
            "total": 6, "items": [None, {"a": {"b": 2}}]}
        assert await s.ok("get_state", {"id": "shop", "depth": 0}) == {
            "price": 2, "qty": 3, "items": "<array: 2 items>", "total": 6, "count": 2}
        assert (await s.ok("get_state", {"id": "shop", "paths": ["$.items"], "depth": 1})) == {
            "items": ["<object: 1 fields>", "<object: 1 fields>"]}
        await s.fails("get_state", {"id": "shop", "at": "not a time"})
        await s.fails("get_state", {"id": "shop", "depth": "deep"})
        # get_field: scalar as text only, object as structured content.
        r = await s.client.call_tool("get_field", {"id": "shop", "path": "$.total"})
        assert r.content[0].text == "6" and r.structured_content is None
        assert await s.ok("get_field", {"id": "shop", "path": "$.items[0]"}) == {"a": {"b": 1}}
        assert "no value" in await s.fails("get_field", {"id": "shop", "path": "$.nothing"})
        await s.fails("get_field", {"id": "shop", "path": "price"})
        eff = await s.ok("get_effective_schema", {"id": "shop", "path": "$.qty"})
        assert eff["type"] == "integer" and eff["maximum"] == 100 and eff["minimum"] == 0
        await s.fails("get_effective_schema", {"id": "nope", "path": "$.qty"})


async def test_mutations_and_their_structured_failures():
    async with connect() as s:
        await s.ok("create_model", {"spec": SHOP})
        r = await s.ok("mutate", {"id": "shop", "mutations": {"$.price": 5, "$.qty": 2}, "includeTraces": True})
        assert r["mutatedPaths"] == ["$.price", "$.qty"]
        assert any(t["targetPath"] == "$.total" and t["result"] == 10 for t in r["traces"])
        v = await s.fails("mutate", {"id": "shop", "mutations": {"$.price": -1}})
        assert v["error"] == "Schema violation"
        assert v["violations"][0]["path"] == "$.price" and v["violations"][0]["keyword"] == "minimum"
        v = await s.fails("mutate", {"id": "shop", "mutations": {"$.qty": 101}})
        assert v["error"] == "Schema violation" and v["violations"][0]["keyword"] == "maximum", "live meta maximum"
        v = await s.fails("mutate", {"id": "shop", "mutations": {"$.price": 600}})
        assert v["error"] == "Constraint violation"
        assert v["violations"] == [{"constraintId": "cap", "message": "total above 1000", "policy": "rollback"}]
        assert await s.ok("get_field", {"id": "shop", "path": "$.price"}) == 5
        await s.fails("mutate", {"id": "shop", "mutations": {"$.total": 1}})
        msg = await s.fails("mutate", {"id": "shop", "mutations": [1, 2]})
        assert "mutations" in msg
        await s.fails("mutate", {"id": "nope", "mutations": {"$.a": 1}})
        # JSON Patch: append, insert, move, remove, and a failing test op.
        await s.ok("mutate", {"id": "shop", "mutations": {"$.items": [{"n": 1}]}})
        r = await s.ok("patch_model", {"id": "shop", "patch": [
            {"op": "add", "path": "/items/-", "value": {"n": 3}},
            {"op": "add", "path": "/items/1", "value": {"n": 2}},
        ]})
        assert r["success"] and "$.count" in r["derivedUpdated"]
        assert await s.ok("get_field", {"id": "shop", "path": "$.items"}) == [{"n": 1}, {"n": 2}, {"n": 3}]
        await s.ok("patch_model", {"id": "shop", "patch": [{"op": "move", "from": "/items/0", "path": "/items/-"}, {"op": "remove", "path": "/items/0"}]})
        assert await s.ok("get_field", {"id": "shop", "path": "$.items"}) == [{"n": 3}, {"n": 1}]
        assert await s.ok("get_field", {"id": "shop", "path": "$.count"}) == 2
        msg = await s.fails("patch_model", {"id": "shop", "patch": [{"op": "test", "path": "/items/0/n", "value": 99}]})
        assert "patch" in msg
        await s.fails("patch_model", {"id": "shop", "patch": [{"op": "frobnicate", "path": "/x"}]})
        v = await s.fails("patch_model", {"id": "shop", "patch": [{"op": "replace", "path": "/price", "value": -3}]})
        assert v["error"] == "Schema violation"


async def test_explain_history_audit():
    async with connect() as s:
        await s.ok("create_model", {"spec": SHOP})
        for p in (1, 2, 3):
            await s.ok("mutate", {"id": "shop", "mutations": {"$.price": p, "$.qty": 10}})
        traces = await s.ok("explain", {"id": "shop", "path": "$.total"})
        assert [t["result"] for t in traces][-3:] == [10, 20, 30]
        assert len(await s.ok("explain", {"id": "shop", "path": "$.total", "limit": 2})) == 2
        await s.fails("explain", {"id": "nope", "path": "$"})
        history = await s.ok("get_history", {"id": "shop"})
        assert len(history) == 4 and history == sorted(history)
        old = await s.ok("get_state", {"id": "shop", "at": history[1]})
        assert old["price"] == 1 and old["total"] == 10
        assert "no state" in await s.fails("get_state", {"id": "shop", "at": "2000-01-01T00:00:00Z"})
        await s.fails("get_history", {"id": "nope"})
        audit = await s.ok("get_audit", {"id": "shop"})
        assert [r["sequence"] for r in audit] == [2, 1, 0]
        assert audit[0]["mutations"] == {"$.price": 3, "$.qty": 10} and audit[0]["source"] == "client"
        assert len(await s.ok("get_audit", {"id": "shop", "limit": 1})) == 1
        assert len(await s.ok("get_audit", {"id": "shop", "pathPrefix": "$.total"})) == 3
        assert await s.ok("get_audit", {"id": "shop", "pathPrefix": "$.nothing"}) == []
        assert len(await s.ok("get_audit", {"id": "shop", "from": history[2], "to": history[3]})) == 2
        await s.fails("get_audit", {"id": "shop", "from": "soon"})
        v = await s.ok("verify_audit", {"id": "shop"})
        assert v == {"valid": True, "recordsChecked": 3, "firstBrokenSequence": None, "detail": "ok"}
        await s.fails("verify_audit", {"id": "nope"})


async def test_snapshot_restore_evolve_view_blobs():
    async with connect() as s:
        await s.ok("create_model", {"spec": SHOP})
        await s.ok("mutate", {"id": "shop", "mutations": {"$.price": 4, "$.qty": 2}})
        snap = await s.ok("snapshot", {"id": "shop"})
        assert snap["baseDoc"] == {"price": 4, "qty": 2} and snap["derivedCache"]["$.total"] == 8
        await s.fails("snapshot", {"id": "nope"})
        await s.ok("mutate", {"id": "shop", "mutations": {"$.price": 9}})
        await s.ok("restore", {"id": "shop", "snapshot": snap})
        assert (await s.ok("get_state", {"id": "shop"}))["total"] == 8
        bad = copy.deepcopy(snap)
        bad["baseDoc"]["price"] = -5
        v = await s.fails("restore", {"id": "shop", "snapshot": bad})
        assert v["error"] == "Schema violation"
        other = dict(snap, modelId="someone-else")
        assert "someone-else" in await s.fails("restore", {"id": "shop", "snapshot": other})
        # Evolution.
        v = await s.fails("evolve_spec", {"id": "shop", "evolution": {"expectedVersion": "0.0.1", "newVersion": "2.0.0"}})
        assert v["error"] == "Version conflict" and v["expected"] == "0.0.1" and v["actual"] == "1.0.0"
        info = await s.ok("evolve_spec", {"id": "shop", "evolution": {
            "expectedVersion": "1.0.0", "newVersion": "1.1.0",
            "upsertDerivations": [{"path": "$.vat", "expr": "$double(total) / 10"}],
            "upsertSchemaNodes": [{"path": "$.note", "schema": {"type": "string"}}],
            "backfill": {"$.note": "none"}}})
        assert info["version"] == "1.1.0" and info["derivationCount"] == 3
        st = await s.ok("get_state", {"id": "shop"})
        assert st["vat"] == 1.6 and st["note"] == "none"
        msg = await s.fails("evolve_spec", {"id": "shop", "evolution": {"upsertDerivations": [{"path": "$.loop", "expr": "loop + 1"}]}})
        assert "cyclic" in msg or "loop" in msg
        msg = await s.fails("evolve_spec", {"id": "shop", "evolution": {"newSchema": {"type": "object", "properties": {"price": {"type": "string"}}}}})
        assert "$.price" in msg, "strand check names the stranded value"
        await s.fails("evolve_spec", {"id": "shop", "evolution": {"newSchema": {}, "upsertSchemaDefs": {"A": {}}}})
        # View.
        view = await s.ok("get_view", {"id": "shop"})
        comps = {c["id"]: c for c in view["components"]}
        assert comps["price"]["value"] == 4 and comps["total"]["value"] == 8
        assert (await s.ok("get_view", {"id": "shop", "viewId": "main"}))["viewId"] == "main"
        await s.fails("get_view", {"id": "shop", "viewId": "nope"})
        # Blobs.
        data = bytes(range(256)) * 4
        ref = await s.ok("upload_blob", {"data": base64.b64encode(data).decode(), "mediaType": "application/x-test"})
        assert ref["bytes"] == 1024 and ref["mediaType"] == "application/x-test"
        got = await s.ok("download_blob", {"blobId": ref["blobId"]})
        assert base64.b64decode(got["data"]) == data
        assert "not found" in await s.fails("download_blob", {"blobId": ref["blobId"], "modelId": "shop"})
        await s.ok("mutate", {"id": "shop", "mutations": {"$.photo": ref["blobId"]}})
        assert (await s.ok("download_blob", {"blobId": ref["blobId"], "modelId": "shop"}))["bytes"] == 1024
        await s.fails("upload_blob", {"data": "%%% not base64"})
        await s.fails("download_blob", {"blobId": "0" * 64})


async def test_authoring_tools_never_touch_the_registry():
    async with connect() as s:
        g = await s.ok("get_domain_guidance", {"topics": ["percentage", "proration"]})
        assert [t["id"] for t in g["topics"]] == ["percentage", "proration"] and len(g["guidance"]) > 200
        g = await s.ok("get_domain_guidance", {"topics": ["no_such_topic"]})
        assert g["unknownTopics"] == ["no_such_topic"] and g["topics"] == []
        await s.fails("get_domain_guidance", {"topics": "percentage"})
        r = await s.ok("validate_spec", {"spec": {"id": "x", "schema": {}, "derivations": [{"path": "total", "expr": "a +"}]}})
        assert r["valid"] is False and all(e["location"] and e["message"] for e in r["errors"])
        assert any(e["location"].startswith("derivations[0]") for e in r["errors"])
        assert (await s.ok("validate_spec", {"spec": SHOP}))["valid"] is True
        await s.fails("validate_spec", {})
        assert await s.ok("eval_expression", {"expr": "a * 2", "input": {"a": 21}}) == {"ok": True, "undefined": False, "result": 42}
        assert (await s.ok("eval_expression", {"expr": "nothing"}))["undefined"] is True
        e = await s.ok("eval_expression", {"expr": "1 +"})
        assert e["ok"] is False and e["error"] == "compile"
        e = await s.ok("eval_expression", {"expr": "$number('x') + 1"})
        assert e["ok"] is False and e["error"] == "evaluation", e
        r = await s.ok("eval_expression", {"expr": "$double($const.rate)", "library": SHOP["library"], "constants": {"rate": 4}})
        assert r["result"] == 8 and r["libraryExports"] == ["double"]
        assert (await s.ok("eval_expression", {"expr": "1", "library": "( 1 )"}))["error"] == "library"
        await s.fails("eval_expression", {"expr": 5})
        rep = await s.ok("test_spec", {"spec": SHOP})
        assert rep["total"] == 1 and rep["passed"] == 1
        rep = await s.ok("test_spec", {"spec": SHOP, "tests": [
            {"description": "good", "given": {"$.price": 1, "$.qty": 1}, "expect": {"$.total": 1}},
            {"description": "bad", "given": {"$.price": 1, "$.qty": 2}, "expect": {"$.total": 3}}]})
        assert rep["failed"] == 1
        bad = [c for c in rep["results"] if not c["passed"]][0]
        assert bad["failures"][0]["path"] == "$.total" and bad["failures"][0]["expected"] == 3 and bad["failures"][0]["actual"] == 2
        await s.fails("test_spec", {"spec": {"id": "x", "schema": {}, "derivations": [{"path": "$.a", "expr": "("}]}})
        st = await s.ok("dry_run", {"spec": SHOP, "mutations": [{"$.price": 3}, {"$.qty": 3}]})
        assert st["total"] == 9
        v = await s.fails("dry_run", {"spec": SHOP, "mutations": {"$.price": 2000, "$.qty": 1}})
        assert v["error"] == "Constraint violation"
        assert await s.ok("list_models") == []


async def test_result_size_guard():
    async with connect() as s:
        await s.ok("create_model", {"spec": DEMO})
        await s.ok("mutate", {"id": "demo", "mutations": {"$.rows": [{"i": i, "label": f"row {i}"} for i in range(3000)]}})
        note = await s.fails("get_state", {"id": "demo"})
        assert note["error"] == "Result too large" and note["limitChars"] == 50000 and "paths" in note["hint"]
        small = await s.ok("get_state", {"id": "demo", "depth": 0})
        assert small["rows"] == "<array: 3000 items>"
        # A write over the guard committed: not an error, and its note passes the output schema.
        note = await s.ok("mutate", {"id": "demo", "mutations": {f"$.more[{i}]": {"i": i} for i in range(3000)}})
        assert note["committed"] is True and note["counts"]["mutatedPaths"] == 3000
        assert "do not send the write again" in note["hint"]
        patch = [{"op": "add", "path": f"/tags/t{i}", "value": i} for i in range(3000)]
        await s.ok("mutate", {"id": "demo", "mutations": {"$.tags": {}}})
        note = await s.ok("patch_model", {"id": "demo", "patch": patch})
        assert note["committed"] is True and note["counts"]["mutatedPaths"] == 3000


async def test_evolve_spec_key_checks():
    async with connect() as s:
        await s.ok("create_model", {"spec": DEMO})
        msg = await s.fails("evolve_spec", {"id": "demo", "evolution": {"addDerivations": [{"path": "$.x", "expr": "1"}]}})
        assert "did you mean `upsertDerivations`" in msg
        info = await s.ok("evolve_spec", {"id": "demo", "evolution": {
            "upsertDerivations": [{"path": "$.x", "expr": "1"}], "addConstraints": []}})
        assert info["derivationCount"] == 2 and info["warnings"][0]["location"] == "addConstraints"
