"""Every bundled example: create_model → test_spec passes → mutate with a realistic input (its
first test's `given`) → the values its test expects → get_view."""

import pytest

from conftest import EXAMPLES, connect, example

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
async def test_example_lifecycle(path):
    spec = example(path)
    async with connect() as s:
        info = await s.ok("create_model", {"spec": spec})
        assert info["id"] == spec["id"]
        rep = await s.ok("test_spec", {"spec": spec})
        assert rep["total"] == len(spec.get("tests", [])) and rep["failed"] == 0, rep
        case = spec["tests"][0]
        r = await s.ok("mutate", {"id": spec["id"], "mutations": case["given"]})
        assert r["success"] is True
        for addr, want in case["expect"].items():
            if isinstance(want, dict) and "$meta" in want:
                continue  # a meta assertion: test_spec checked it
            err, got = await s.call("get_field", {"id": spec["id"], "path": addr})
            if want is None:
                assert got is None or (err and "no value" in got), (addr, got)
                continue
            assert not err, (addr, got)
            if isinstance(want, float) or isinstance(got, float):
                assert abs(got - want) <= 1e-9 * max(1, abs(want)), (addr, got, want)
            else:
                assert got == want, (addr, got, want)
        if spec.get("viewDefinition"):
            view = await s.ok("get_view", {"id": spec["id"]})
            assert view["components"], view
