#!/usr/bin/env python3
"""REST write load against `valem serve`: C clients, each an HTTP/1.1 connection (raw socket,
pre-encoded request) kept alive unless a reply says `Connection: close` (then reopened for the next
request; latency includes that connect), each writing POST /models/{id}/mutations {"$.n": 5} round-robin over
its own K models. Warm-up W s, then measure S s. Prints mutations/s, p50/p99/max µs, non-200s,
writes per commit from /metrics (valem_store_ops_total / valem_store_batches_total over the
measured window), and the client's own CPU use.
usage: load.py HOST:PORT LABEL CLIENTS [--models-per-client K] [--warmup W] [--secs S] [--metrics HOST:PORT,...]"""
import argparse, json, os, socket, threading, time

class Conn:
    """A client connection that follows the server: kept alive while the server keeps it, and
    reopened before the next request after a reply with `Connection: close` (HAProxy's
    `option httpclose`). A request is never re-sent: a connection that closes without a reply is
    an error of that request (counted by the caller), and the next request opens a new one."""
    def __init__(self, addr): self.addr, self.sock, self.buf, self.opened = addr, None, [b""], 0
    def send(self, raw):
        if self.sock is None:
            self.sock, self.buf = conn(self.addr), [b""]; self.opened += 1
        try:
            self.sock.sendall(raw)
            st, body, close = read_reply(self.sock, self.buf)
        except Exception:
            self.close(); raise
        if close: self.close()
        return st, body
    def close(self):
        if self.sock is not None: self.sock.close(); self.sock = None

def request(sock, buf, method, path, body=b"", extra=b""):
    sock.sendall(b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
                 % (method.encode(), path.encode(), extra, len(body), body))
    return read_reply(sock, buf)[:2]

def raw_request(method, path, body=b"", extra=b""):
    return (b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (method.encode(), path.encode(), extra, len(body), body))

def read_reply(sock, buf):
    while b"\r\n\r\n" not in buf[0]:
        d = sock.recv(65536)
        if not d: raise ConnectionError("closed")
        buf[0] += d
    head, rest = buf[0].split(b"\r\n\r\n", 1)
    status = int(head[9:12]); n = 0
    close = head[:8] == b"HTTP/1.0"   # 1.0 closes unless told otherwise (we never ask for keep-alive)
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        k = k.strip().lower()
        if k == b"content-length": n = int(v)
        elif k == b"transfer-encoding": raise ValueError("chunked reply not handled")
        elif k == b"connection" and b"close" in v.lower(): close = True
    while len(rest) < n:
        d = sock.recv(65536)
        if not d: raise ConnectionError("closed")
        rest += d
    buf[0] = rest[n:]
    return status, rest[:n], close

def conn(addr):
    h, p = addr.rsplit(":", 1)
    s = socket.create_connection((h, int(p))); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s

def cpu_stat():   # (busy, total) jiffies of the whole machine
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)

def metrics(addrs):
    tot = {}
    for a in addrs:
        s = conn(a); st, body = request(s, [b""], "GET", "/metrics"); s.close()
        for line in body.decode().splitlines():
            for k in ("valem_store_ops_total", "valem_store_batches_total", "valem_store_fsyncs_total", 'valem_forwards_total{outcome="answered"}', 'valem_forwards_total{outcome="unreachable"}'):
                if line.startswith(k + " "): tot[k] = tot.get(k, 0) + float(line.split()[1])
    return tot

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("addr"); ap.add_argument("label"); ap.add_argument("clients", type=int)
    ap.add_argument("--models-per-client", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=1.0); ap.add_argument("--secs", type=float, default=10.0)
    ap.add_argument("--metrics", default=None, help="comma-separated daemons to read /metrics from (default: addr)")
    a = ap.parse_args()
    maddrs = (a.metrics or a.addr).split(",")
    tag = "%s%d" % (a.label, int(time.time() * 1000) % 10**8)
    ids = [["%sc%dm%d" % (tag, c, k) for k in range(a.models_per_client)] for c in range(a.clients)]
    s = Conn(a.addr)
    for row in ids:
        for mid in row:
            spec = {"id": mid, "version": "1", "schema": {}, "derivations": [{"path": "$.twice", "expr": "n * 2"}]}
            st, body = s.send(raw_request("POST", "/models", json.dumps(spec).encode()))
            assert st in (200, 201), (st, body)
    s.close()
    t0 = time.monotonic() + 0.5
    m_start, m_end = t0 + a.warmup, t0 + a.warmup + a.secs
    lat = [[] for _ in range(a.clients)]; bad = [0] * a.clients; err = [None] * a.clients
    codes = [{} for _ in range(a.clients)]; dropped = [0] * a.clients; opened = [0] * a.clients
    def client(c):
        cn = Conn(a.addr)
        reqs = [raw_request("POST", "/models/%s/mutations" % mid, b'{"$.n": 5}') for mid in ids[c]]
        while time.monotonic() < t0: time.sleep(0.001)
        i, mine = 0, lat[c]
        while True:
            t = time.monotonic()   # before the connect when one is needed: latency includes it
            if t >= m_end: break
            req = reqs[i % len(reqs)]; i += 1
            try:
                st, _ = cn.send(req)
            except (ConnectionError, OSError) as x:   # closed without a reply: an error, not re-sent
                e = time.monotonic()
                if e >= m_start and e < m_end: dropped[c] += 1
                if err[c] is None: err[c] = repr(x)
                continue
            e = time.monotonic()
            if e >= m_start and e < m_end:   # completions inside the window
                mine.append((e - t) * 1e6)
                if st != 200:
                    bad[c] += 1; codes[c][st] = codes[c].get(st, 0) + 1
        opened[c] = cn.opened
        cn.close()
    th = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in th: t.start()
    cpu0 = None
    while time.monotonic() < m_start: time.sleep(0.001)
    m0 = metrics(maddrs); cpu0 = os.times(); k0 = cpu_stat()
    while time.monotonic() < m_end: time.sleep(0.005)
    m1 = metrics(maddrs); cpu1 = os.times(); k1 = cpu_stat()
    for t in th: t.join()
    allv = sorted(v for l in lat for v in l)
    n = len(allv); q = lambda p: allv[min(n - 1, int(round((n - 1) * p)))] if n else float("nan")
    ops = m1.get("valem_store_ops_total", 0) - m0.get("valem_store_ops_total", 0)
    bat = m1.get("valem_store_batches_total", 0) - m0.get("valem_store_batches_total", 0)
    fs = m1.get("valem_store_fsyncs_total", 0) - m0.get("valem_store_fsyncs_total", 0)
    fw = {o: int(m1.get('valem_forwards_total{outcome="%s"}' % o, 0) - m0.get('valem_forwards_total{outcome="%s"}' % o, 0)) for o in ("answered", "unreachable")}
    ccpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    r = dict(label=a.label, clients=a.clients, models=a.clients * a.models_per_client, mutations=n,
             per_s=round(n / a.secs), p50_us=round(q(0.5)), p99_us=round(q(0.99)), max_us=round(q(1.0)),
             non200=sum(bad), non200_codes={str(k): sum(d.get(k, 0) for d in codes) for k in set().union(*codes)},
             dropped=sum(dropped), connections=sum(opened), forwards=fw, errors=[e for e in err if e], batches=int(bat), ops=int(ops), fsyncs=int(fs),
             writes_per_commit=round(ops / bat, 2) if bat else None,
             mutations_per_commit=round(n / bat, 2) if bat else None,
             client_cpu_pct=round(100 * ccpu / a.secs),
             machine_busy_pct=round(100 * (k1[0] - k0[0]) / max(1, k1[1] - k0[1])), load1=os.getloadavg()[0])
    print(json.dumps(r), flush=True)

main()
