"""Round trips of `mutate` on the demo model through the official Python MCP SDK (stdio).

Usage: python mcp_python_client.py [VALEM_BIN] [CALLS]
Prints client-observed p50/p99 and calls/s. Compare with `cargo bench -p valem-benches --bench
mcp` (server time and a minimal Rust client over the same pipes) to see where the time goes.
Needs `pip install mcp` (tests/clients/python/run creates a venv with it).
"""
import sys
import time

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

DEMO = {"id": "demo", "version": "1", "schema": {}, "derivations": [{"path": "$.total", "expr": "price * qty"}]}


async def main(binary: str, calls: int) -> None:
    params = StdioServerParameters(command=binary, args=["mcp"])
    async with stdio_client(params) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            await s.call_tool("create_model", {"spec": DEMO})
            for i in range(200):  # warm-up
                await s.call_tool("mutate", {"id": "demo", "mutations": {"$.price": i, "$.qty": 3}})
            lat = []
            t0 = time.perf_counter()
            for i in range(calls):
                t = time.perf_counter()
                res = await s.call_tool("mutate", {"id": "demo", "mutations": {"$.price": i + 0.5, "$.qty": 3}})
                lat.append((time.perf_counter() - t) * 1e6)
                assert not res.is_error
            wall = time.perf_counter() - t0
    lat.sort()
    p = lambda q: lat[int((len(lat) - 1) * q)]
    print(f"python-sdk mutate: {calls} calls, p50 {p(0.5):.0f} µs, p99 {p(0.99):.0f} µs, {calls / wall:.0f} calls/s")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "target/release/valem", int(sys.argv[2]) if len(sys.argv) > 2 else 3000)
