"""Plugins seen through the official SDK client: the example guidance plugin's topics in
`get_domain_guidance`, the built-in guidance swapped for it, the example tool plugin's tool
listed with its schema and mutating a model through the host table, and faulty plugins (one that
panics, one that answers bytes that are not JSON, one that never returns, one of another ABI
version, a missing file, a file that is not a library) each giving a clear error while the daemon
and the other plugins keep working. The libraries are the workspace's cdylibs in target/debug."""

import os
import pathlib

import anyio
import pytest

from conftest import DEMO, TRANSPORT, VALEM_BIN, connect

pytestmark = pytest.mark.anyio

LIBS = pathlib.Path(VALEM_BIN).parent


def lib(name):
    p = LIBS / f"lib{name}.so"
    assert p.is_file(), f"{p} is missing: build the workspace first (cargo build --workspace)"
    return str(p)


def storage_plugin(tmp_path, durable, library, name):
    """Arguments loading a storage plugin and the directory it keeps its files in: under
    `--data-dir` (`<data-dir>/plugins/<name>`), or without one a `dir` given in its config."""
    if durable:
        return ["--data-dir", str(tmp_path / "data"), "--plugin", lib(library)], tmp_path / "data" / "plugins" / name
    where = tmp_path / name
    return ["--plugin", lib(library), "--plugin-config", f'{name}={{"dir": "{where}"}}'], where


def topics_enum(tools):
    g = next(t for t in tools if t.name == "get_domain_guidance")
    return g.input_schema["properties"]["topics"]["items"]["enum"]


async def test_a_guidance_plugin_adds_its_topics_to_the_enum_and_answers_them():
    args = ["--plugin", lib("example_guidance")]
    async with connect(args=args, local_args=args) as s:
        enum = topics_enum((await s.client.list_tools()).tools)
        assert "loan_amortization" in enum and "credit_limits" in enum
        assert "percentage" in enum, "the built-in topics stay"
        v = await s.ok("get_domain_guidance", {"topics": ["loan_amortization"]})
        assert "monthlyRate" in v["guidance"]
        assert [t["id"] for t in v["topics"]] == ["loan_amortization"]


async def test_swapping_the_builtin_guidance_for_the_example_changes_the_topics():
    args = ["--no-builtin-guidance", "--plugin", lib("example_guidance")]
    async with connect(args=args, local_args=args) as s:
        enum = topics_enum((await s.client.list_tools()).tools)
        assert enum == ["loan_amortization", "credit_limits"]
        v = await s.ok("get_domain_guidance", {"topics": ["percentage", "credit_limits"]})
        assert v["unknownTopics"] == ["percentage"]
        assert "dscr" in v["guidance"]


async def test_the_example_tool_is_listed_with_its_schema_and_mutates_a_model():
    async with connect(args=["--plugin", lib("example_tool")]) as s:
        tools = {t.name: t for t in (await s.client.list_tools()).tools}
        t = tools.get("example_tool__increment")
        assert t is not None, sorted(tools)
        assert t.input_schema["required"] == ["id", "path"]
        assert t.input_schema["properties"]["by"]["type"] == "number"
        assert t.annotations.read_only_hint is False
        await s.ok("create_model", {"spec": DEMO})
        await s.ok("mutate", {"id": "demo", "mutations": {"$.price": 2, "$.qty": 3}})
        r = await s.ok("example_tool__increment", {"id": "demo", "path": "$.qty", "by": 2})
        assert (r["old"], r["new"]) == (3, 5)
        assert "$.total" in r["mutation"]["derivedUpdated"]
        assert (await s.ok("get_field", {"id": "demo", "path": "$.total"})) == 10
        # Its own argument checks come back as tool errors.
        e = await s.fails("example_tool__increment", {"id": "demo", "path": "$.nothing"})
        assert "$.nothing" in str(e)


async def test_faulty_plugins_give_clear_errors_and_everything_else_keeps_working(tmp_path):
    text = tmp_path / "libtext.so"
    text.write_text("not a library")
    # 5 s, not 1: with RUST_BACKTRACE set (as in CI) the panicking plugin's first backtrace is
    # symbolised from a debug build before the call returns, which took over a second there.
    args = [
        "--plugin-timeout", "5",
        "--plugin", lib("valem_test_plugin_faulty"),
        "--plugin", lib("valem_test_plugin_raw"),
        "--plugin", str(tmp_path / "libmissing.so"),
        "--plugin", str(text),
        "--plugin", lib("example_tool"),
    ]
    async with connect(args=args) as s:
        names = {t.name for t in (await s.client.list_tools()).tools}
        assert {"faulty__panic", "faulty__hang", "faulty__echo", "raw__broken", "example_tool__increment"} <= names
        e = await s.fails("faulty__panic")
        assert "panicked" in e and "on purpose" in e, e
        e = await s.fails("raw__broken")
        assert "not JSON" in e, e
        e = await s.fails("faulty__fail")
        assert "on_purpose" in e, e
        with anyio.fail_after(20):
            e = await s.fails("faulty__hang")
        assert "did not answer" in e, e
        # The same plugin, the other plugins and the daemon still answer.
        assert (await s.ok("faulty__echo", {"x": 1})) == {"echo": {"x": 1}}
        await s.ok("create_model", {"spec": DEMO})
        await s.ok("mutate", {"id": "demo", "mutations": {"$.price": 1, "$.qty": 1}})
        r = await s.ok("example_tool__increment", {"id": "demo", "path": "$.price"})
        assert r["new"] == 2


async def test_a_plugin_of_another_abi_version_is_refused_and_the_daemon_runs():
    args = ["--plugin", lib("valem_test_plugin_raw"), "--plugin", lib("example_tool")]
    async with connect(env={"VALEM_TEST_RAW_MODE": "abi99"}, args=args) as s:
        names = {t.name for t in (await s.client.list_tools()).tools}
        assert "raw__broken" not in names
        assert "example_tool__increment" in names
        await s.ok("create_model", {"spec": DEMO})


@pytest.mark.parametrize("durable", [True, False])
async def test_blobs_go_to_a_loaded_blob_store_plugin(tmp_path, durable):
    import base64

    data = bytes(range(256)) * 64  # 16 KiB: a download result is capped at 50,000 characters
    args, where = storage_plugin(tmp_path, durable, "valem_blob_fs", "blob-fs")
    async with connect(args=args) as s:
        ref = await s.ok("upload_blob", {"data": base64.b64encode(data).decode(), "mediaType": "application/x-test"})
        stored = where / ref["blobId"][:2] / ref["blobId"][2:]
        assert stored.is_file(), sorted(str(p) for p in where.rglob("*")) if where.exists() else "no directory"
        assert stored.read_bytes() == data
        got = await s.ok("download_blob", {"blobId": ref["blobId"]})
        assert base64.b64decode(got["data"]) == data and got["mediaType"] == "application/x-test"
        # Bytes changed behind the daemon's back are caught by the content check.
        stored.write_bytes(b"tampered")
        e = await s.fails("download_blob", {"blobId": ref["blobId"]})
        assert "do not match" in e, e


@pytest.mark.parametrize("durable", [True, False])
async def test_an_audit_store_plugin_receives_every_record_and_verify_works_over_it(tmp_path, durable):
    import json

    args, where = storage_plugin(tmp_path, durable, "valem_audit_jsonl", "audit-jsonl")
    async with connect(args=args) as s:
        await s.ok("create_model", {"spec": DEMO})
        for i in range(6):
            await s.ok("mutate", {"id": "demo", "mutations": {"$.price": i, "$.qty": 2}})
        records = await s.ok("get_audit", {"id": "demo", "limit": 100})
        assert len(records) == 6
        assert [r["sequence"] for r in records] == [5, 4, 3, 2, 1, 0], "newest first"
        assert len(await s.ok("get_audit", {"id": "demo", "limit": 2})) == 2
        assert len(await s.ok("get_audit", {"id": "demo", "pathPrefix": "$.total"})) == 6
        file = where / ("demo".encode().hex() + ".jsonl")
        lines = file.read_text().splitlines()
        assert [json.loads(l)["sequence"] for l in lines] == list(range(6)), "every record, in order"
        v = await s.ok("verify_audit", {"id": "demo"})
        assert v["valid"] is True and v["recordsChecked"] == 6, v

        # An altered record in the plugin's storage is caught at its sequence...
        altered = json.loads(lines[3])
        altered["record"]["mutations"]["$.price"] = 999
        file.write_text("\n".join(lines[:3] + [json.dumps(altered)] + lines[4:]) + "\n")
        v = await s.ok("verify_audit", {"id": "demo"})
        assert v["valid"] is False and v["firstBrokenSequence"] == 3, v
        # ...and so is a truncated tail.
        file.write_text("\n".join(lines[:4]) + "\n")
        v = await s.ok("verify_audit", {"id": "demo"})
        assert v["valid"] is False and v["firstBrokenSequence"] == 4, v
        # Deleting the model deletes its audit there too.
        await s.ok("delete_model", {"id": "demo"})
        with anyio.fail_after(5):
            while file.exists():
                await anyio.sleep(0.02)


async def test_with_a_data_dir_the_builtin_blob_store_plugin_keeps_the_bytes(tmp_path):
    import base64

    data = b"built-in blob store " * 100
    async with connect(args=["--data-dir", str(tmp_path / "data")]) as s:
        ref = await s.ok("upload_blob", {"data": base64.b64encode(data).decode()})
        h = ref["blobId"]
        stored = tmp_path / "data" / "blobs" / h[:2] / h[2:]
        assert stored.read_bytes() == data
        got = await s.ok("download_blob", {"blobId": h})
        assert base64.b64decode(got["data"]) == data
