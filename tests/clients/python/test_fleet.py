"""The official SDK against a fleet: `scripts/fleet` (a throwaway PostgreSQL, three `valem serve`
nodes on it, HAProxy round-robin in front), reached through the proxy in the modern era. The
model's owner and one more node are killed with -9 mid-way: the client keeps working — a write
refused while the dead owner's lease runs is sent again with its idempotency key until a
surviving node takes the model over, within the lease plus 3 s — and nothing acknowledged is
lost or applied twice. Runs once: with VALEM_TRANSPORT=http and the modern era."""

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request

import anyio
import mcp
import pytest

from conftest import MODERN, REPO, TRANSPORT, VALEM_BIN

pytestmark = pytest.mark.skipif(
    not (TRANSPORT == "http" and MODERN), reason="the fleet runs once: over HTTP, in the modern era"
)

LEASE_MS = 1500
SPEC = {
    "id": "m",
    "version": "1",
    "schema": {},
    "derivations": [{"path": "$.twice", "expr": "n * 2"}],
}


def free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def base_port():
    """A port for the proxy whose next three (the nodes) and +100 (PostgreSQL) are free too."""
    for _ in range(200):
        p = random.randint(20000, 40000)
        if all(free(q) for q in (p, p + 1, p + 2, p + 3, p + 100)):
            return p
    raise RuntimeError("no free ports")


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture
def fleet():
    port = base_port()
    proc = subprocess.Popen(
        [str(REPO / "scripts" / "fleet"), "--port", str(port), "--lease-ms", str(LEASE_MS), "--bin", VALEM_BIN],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("scripts/fleet ended before the fleet was up")
            words = line.split()
            # "fleet: node-1 pid 1234 on http://127.0.0.1:PORT (log …)"
            if len(words) >= 4 and words[0] == "fleet:" and words[2] == "pid":
                pids[words[1]] = int(words[3])
            if line.startswith("fleet: 3 nodes on"):
                break
        else:
            raise RuntimeError("the fleet was not up in 120 s")
        assert len(pids) == 3, pids
        yield f"http://127.0.0.1:{port}", pids
    finally:
        # SIGTERM: the script stops the nodes, HAProxy and PostgreSQL, and removes its directory.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def write(client, n):
    """`$.n = n` under idempotency key w<n>: (is_error, value)."""
    r = await client.call_tool(
        "mutate",
        {"id": "m", "mutations": {"$.n": n}},
        meta={"io.valem/idempotencyKey": f"w{n}"},
    )
    return r.is_error, r.structured_content or r.content[0].text


@pytest.mark.anyio
async def test_the_sdk_keeps_working_through_haproxy_across_node_kills(fleet):
    url, pids = fleet
    with anyio.fail_after(90):
        async with mcp.Client(url + "/mcp", mode="auto") as client:
            assert client.protocol_version == "2026-07-28", client.protocol_version
            created = await client.call_tool("create_model", {"spec": SPEC})
            assert not created.is_error, created
            for n in range(1, 6):
                err, v = await write(client, n)
                assert not err, v
            owner = get(url + "/cluster/owner/m")["owner"]
            other = next(node for node in pids if node != owner)
            for node in (owner, other):
                os.kill(pids[node], signal.SIGKILL)
            killed = time.monotonic()

            # The same write, sent again (same key) until a survivor takes the model over.
            refused = 0
            while True:
                try:
                    err, v = await write(client, 6)
                except Exception as e:  # an HTTP 503 from the proxy surfaces as an MCPError
                    err, v = True, repr(e)
                if not err:
                    break
                refused += 1
                assert time.monotonic() - killed < LEASE_MS / 1000 + 3, f"still refused: {v}"
                await anyio.sleep(0.1)
            took = time.monotonic() - killed
            print(f"fleet: first write acknowledged {took:.2f} s after the kills ({refused} refused)")

            # Sent once more: answered from its key, not applied again.
            err, again = await write(client, 6)
            assert not err and again == v, again
            state = await client.call_tool("get_state", {"id": "m"})
            assert state.structured_content["n"] == 6 and state.structured_content["twice"] == 12, state
            verified = await client.call_tool("verify_audit", {"id": "m"})
            report = verified.structured_content
            assert report["valid"] is True and report["recordsChecked"] == 6, report
            assert get(url + "/cluster/owner/m")["owner"] not in (owner, other)
