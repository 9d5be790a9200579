"""An agent's session: validate → fix → dry_run → create → mutate → explain → snapshot →
evolve_spec (a stale expectedVersion first) → restore → verify_audit."""

import pytest

from conftest import connect

pytestmark = pytest.mark.anyio


async def test_agent_session():
    async with connect() as s:
        spec = {
            "id": "loan", "version": "1.0.0",
            "schema": {"type": "object", "properties": {
                "principal": {"type": "number", "minimum": 0},
                "ratePercent": {"type": "number", "minimum": 0},
                "years": {"type": "integer", "minimum": 1}}},
            "derivations": [{"path": "interest", "expr": "principal * ratePercent / 100 * years"}],
            "constraints": [{"id": "sane", "expr": "ratePercent < 50", "message": "rate too high", "policy": "rollback"}],
            "tests": [{"given": {"$.principal": 1000, "$.ratePercent": 5, "$.years": 2}, "expect": {"$.interest": 100}}],
        }
        r = await s.ok("validate_spec", {"spec": spec})
        assert not r["valid"] and any("$.interest" in e["message"] for e in r["errors"]), r
        spec["derivations"][0]["path"] = "$.interest"
        assert (await s.ok("validate_spec", {"spec": spec}))["valid"]
        assert (await s.ok("dry_run", {"spec": spec, "mutations": spec["tests"][0]["given"]}))["interest"] == 100
        await s.ok("create_model", {"spec": spec})
        await s.ok("mutate", {"id": "loan", "mutations": {"$.principal": 2000, "$.ratePercent": 4, "$.years": 3}})
        t = (await s.ok("explain", {"id": "loan", "path": "$.interest", "limit": 1}))[0]
        assert t["result"] == 240 and set(t["inputPaths"]) == {"$.principal", "$.ratePercent", "$.years"}
        snap = await s.ok("snapshot", {"id": "loan"})
        evo = {"expectedVersion": "0.1.0", "newVersion": "1.1.0",
               "upsertDerivations": [{"path": "$.total", "expr": "principal + interest"}]}
        v = await s.fails("evolve_spec", {"id": "loan", "evolution": evo})
        assert v["error"] == "Version conflict" and v["actual"] == "1.0.0"
        evo["expectedVersion"] = v["actual"]
        assert (await s.ok("evolve_spec", {"id": "loan", "evolution": evo}))["version"] == "1.1.0"
        assert (await s.ok("get_state", {"id": "loan"}))["total"] == 2240
        await s.ok("mutate", {"id": "loan", "mutations": {"$.principal": 10}})
        await s.ok("restore", {"id": "loan", "snapshot": snap})
        st = await s.ok("get_state", {"id": "loan"})
        assert st["principal"] == 2000 and st["total"] == 2240
        v = await s.ok("verify_audit", {"id": "loan"})
        assert v["valid"] and v["recordsChecked"] == 2
