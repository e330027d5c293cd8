"""Link emulation over loopback: latency, throughput, shared buckets, gRPC transparency."""

import socket
import threading
import time

import pytest

from shoal.emulate.links import CHUNK, LinkShaper, ScenarioDial, TokenBucket
from shoal.emulate.measure import (
    _Ack,
    _Echo,
    _Sink,
    connect,
    measure_latency,
    measure_message,
    measure_throughput,
)
from shoal.emulate.measure import serve as _serve
from shoal.plan.types import Device, Link, Network, Scenario, Workload

LATENCY = 0.050  # one-way seconds
RATE = 2e6  # bytes/s


def test_token_bucket_books_serial_time():
    b = TokenBucket(1000.0)
    assert b.reserve(500, now=10.0) == pytest.approx(10.5)
    assert b.reserve(500, now=10.1) == pytest.approx(11.0)  # queued behind the first
    assert b.reserve(100, now=20.0) == pytest.approx(20.1)  # idle link: starts now, no credit
    assert TokenBucket(None).reserve(10**9, now=1.0) == 1.0
    with pytest.raises(ValueError):
        TokenBucket(0.0)


def _pings(relay: str, n: int, size: int) -> list[float]:
    """Round-trip times of ``n`` echoed messages of ``size`` bytes through ``relay``."""
    s = connect(relay)
    rtts = []
    for _ in range(n):
        t0 = time.monotonic()
        s.sendall(b"p" * size)
        got = 0
        while got < size:
            chunk = s.recv(65536)
            assert chunk, "the relay closed during a ping"
            got += len(chunk)
        rtts.append(time.monotonic() - t0)
    s.close()
    return rtts


def _assert_scheduled(books: dict, latency: float, nbytes: int, most_serial_s: float) -> None:
    """Each direction relayed ``nbytes`` and delayed every chunk by the latency plus at most
    ``most_serial_s`` of transmission, in the relay's own books (not wall-clock time: load
    cannot move these)."""
    for direction in ("up", "down"):
        b = books[direction]
        assert b.bytes == nbytes and b.chunks >= 1, (direction, b)
        # (1e-9: a delay is a difference of loop times near 1e4 s, exact to about 1e-12 s)
        assert latency - 1e-9 <= b.delay_min_s <= b.delay_max_s <= latency + most_serial_s + 1e-9, (direction, b)


def test_latency_is_scheduled_exactly_and_never_cut_short():
    """11 echoed 64-byte pings through a 50 ms relay: the relay books every chunk for 50 ms
    plus its transmission (64 B at 2 MB/s), and no round trip is shorter than 100 ms. A
    loaded host only adds lateness (reported, not bounded); a wrong or missing delay fails."""
    srv, addr = _serve(_Echo)
    try:
        with LinkShaper(up=RATE, down=RATE) as sh:
            rtts = _pings(sh.proxy_for(addr, latency_s=LATENCY), 11, 64)
            books = sh.books()
    finally:
        srv.shutdown()
    _assert_scheduled(books, LATENCY, 11 * 64, 64 / RATE)
    assert min(rtts) >= 2 * LATENCY, rtts
    print(f"round trips {min(rtts):.4f}-{max(rtts):.4f} s for 2 x {LATENCY} s; host lag up to "
          f"{books['up'].late_max_s:.4f} / {books['down'].late_max_s:.4f} s")


def test_measure_latency_reports_half_the_round_trip():
    """The measurement tool (python -m shoal.emulate.measure): never below the set latency."""
    assert measure_latency(0.01, pings=3, rate=RATE) >= 0.01


def test_message_time_is_latency_plus_serialisation():
    """The cost model's transfer time: a 128 kB activation, then a 1-byte answer back, takes
    ``2 latency + n / rate``. The relay's books hold every chunk for the latency plus at most
    one chunk's transmission (a chunk is read only once the one before is sent), and no
    message is faster than the figure; how much slower a loaded host makes it is not bounded."""
    nbytes, lat, rate = 131072, 0.045, 2.5e6
    want = 2 * lat + nbytes / rate
    srv, addr = _serve(_Ack, size=nbytes)
    try:
        with LinkShaper(up=rate, down=rate) as sh:
            s = connect(sh.proxy_for(addr, latency_s=lat))
            times = []
            for _ in range(3):
                time.sleep(0.05)  # the buckets go idle, as between tasks
                t0 = time.monotonic()
                s.sendall(b"m" * nbytes)
                assert s.recv(1) == b"!"
                times.append(time.monotonic() - t0)
            s.close()
            books = sh.books()
    finally:
        srv.shutdown()
    assert books["up"].bytes == 3 * nbytes and books["down"].bytes == 3
    up, down = books["up"], books["down"]  # (1e-9: differences of loop times, see _assert_scheduled)
    assert lat - 1e-9 <= up.delay_min_s <= up.delay_max_s <= lat + CHUNK / rate + 1e-9, up
    assert lat - 1e-9 <= down.delay_min_s <= down.delay_max_s <= lat + 1 / rate + 1e-9, down
    assert min(times) >= want * (1 - 1e-6), (times, want)
    print(f"message times {min(times):.4f}-{max(times):.4f} s for {want:.4f} s; host lag up to "
          f"{books['up'].late_max_s:.4f} s")


def test_measure_message_is_never_below_the_cost_model():
    """The measurement tool's figure (python -m shoal.emulate.measure)."""
    nbytes, lat, rate = 16384, 0.005, 4e6
    assert measure_message(nbytes, lat, rate, repeats=2) >= 2 * lat + nbytes / rate


def test_echo_counts_bytes_both_ways():
    srv, addr = _serve(_Echo)
    with LinkShaper() as sh:
        s = connect(sh.proxy_for(addr, latency_s=0.002))
        for _ in range(3):
            s.sendall(b"q" * 64)
            got = 0
            while got < 64:
                got += len(s.recv(1024))
        s.close()
        st = sh.stats()
        assert st["up_bytes"] == st["down_bytes"] == 3 * 64
        assert st["proxies"][0]["connections"] == 1
    srv.shutdown()


@pytest.mark.parametrize("direction", ["up", "down"])
def test_throughput_is_the_link_rate_in_the_relays_books(direction):
    """3 MB through a 2 MB/s bucket: every byte arrives, and in the relay's own books the link
    was busy exactly n / rate (it transmitted at its rate whenever it had data; the time it
    stood idle waiting for the sender, which a loaded host lengthens, is counted apart), so
    the booked transfer never took less than n / rate. A missing, wrong-rate or bypassed
    bucket fails; the wall-clock rate is reported, not bounded (load only lowers it)."""
    nbytes = int(3e6)
    books: dict = {}
    rate, received = measure_throughput(RATE, nbytes, direction, books=books)
    assert received == nbytes
    b = books[direction]
    assert b.bytes == nbytes and books["up" if direction == "down" else "down"].busy_s == 0.0, books
    assert b.busy_s == pytest.approx(nbytes / RATE, rel=1e-6), b
    assert b.last_sent_s - b.first_ready_s >= nbytes / RATE * (1 - 1e-9), b
    print(f"{direction}: booked busy {b.busy_s:.4f} s + idle {b.idle_s:.4f} s for {nbytes / RATE:.4f} s; "
          f"wall-clock rate {rate / 1e6:.3f} MB/s of {RATE / 1e6:.1f}; host lag up to {b.late_max_s:.4f} s")


def test_uplink_is_shared_by_all_relays():
    nbytes = int(1.5e6)
    srv, addr = _serve(_Sink, marks=[])
    with LinkShaper(up=RATE) as sh:
        relays = [sh.proxy_for(addr), sh.proxy_for(addr)]
        socks = [connect(r) for r in relays]
        t0 = time.monotonic()
        threads = [threading.Thread(target=s.sendall, args=(b"z" * nbytes,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in socks:
            s.shutdown(socket.SHUT_WR)
            s.recv(1)
            s.close()
        deadline = time.monotonic() + 10
        while len(srv.marks) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        end = max(m[-1][0] for m in srv.marks)
        books = sh.books()
    srv.shutdown()
    assert sum(m[-1][1] for m in srv.marks) == 2 * nbytes
    # Two flows of 1.5 MB over one 2 MB/s uplink: in the books the uplink was busy 1.5 s, one
    # flow after the other's chunks (two buckets would have overlapped them: 0.75 s).
    up = books["up"]
    assert up.bytes == 2 * nbytes and up.busy_s == pytest.approx(2 * nbytes / RATE, rel=1e-6), up
    # No delivery is written before its booked time, so the wall clock can only be slower
    # (at any load): together the flows never beat the link's rate.
    aggregate = 2 * nbytes / (end - t0)
    assert aggregate <= RATE * (1 + 1e-3), aggregate


def test_byte_order_kept_with_jitter():
    srv, addr = _serve(_Echo)
    with LinkShaper() as sh:
        relay = sh.proxy_for(addr, latency_s=0.005, jitter_s=0.005)
        s = connect(relay)
        payload = bytes(range(256)) * 2000
        sender = threading.Thread(target=s.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            got += s.recv(65536)
        sender.join()
        s.close()
        assert bytes(got) == payload
    srv.shutdown()


def test_dead_target_closes_connection():
    with LinkShaper() as sh:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nothing listens here now
        relay = sh.proxy_for(f"127.0.0.1:{port}", latency_s=0.01)
        s = connect(relay)
        assert s.recv(10) == b""
        s.close()


def _scenario():
    mk = lambda i, region: Device(id=f"d{i}", kind="rtx3090", flops=1e12, memory=24e9,  # noqa: E731
                                  region=region, up=1e6, down=4e6)
    net = Network(
        intra={"eu": Link(0.005, 1e9), "us": Link(0.005, 1e9)},
        inter={("eu", "us"): Link(0.040, 3e6)},
    )
    return Scenario(name="t", devices=[mk(0, "eu"), mk(1, "eu"), mk(2, "us")], network=net,
                    workload=Workload(model="tiny", seq_len=32, global_batch=8, micro_batch_size=2))


def test_scenario_dial_uses_region_latency():
    srv, addr = _serve(_Echo)
    other = "127.0.0.1:1"
    dial = ScenarioDial(_scenario(), "d0", {addr: "d2", other: "d1"})
    try:
        assert dial("127.0.0.1:9") == "127.0.0.1:9"  # unknown: unshaped
        assert dial.link_for(addr).latency == 0.040
        assert dial.link_for(other).latency == 0.005
        relay = dial(addr)
        assert relay != addr and dial(addr) == relay  # one relay per address
        assert dial.shaper.up_bucket.rate == 1e6 and dial.shaper.down_bucket.rate == 4e6
        rtts = _pings(relay, 5, 1)
        # 40 ms each way (the eu-us link), plus one byte through the slowest bucket (1 MB/s up)
        _assert_scheduled(dial.shaper.books(), 0.040, 5, 1 / 1e6)
        assert min(rtts) >= 2 * 0.040, rtts
    finally:
        dial.close()
        srv.shutdown()


def test_grpc_runs_through_the_relay():
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    def echo(request, context):
        return request[::-1]

    handler = grpc.method_handlers_generic_handler(
        "shoal.test.Echo", {"Rev": grpc.unary_unary_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with LinkShaper(up=RATE, down=RATE) as sh:
            relay = sh.proxy_for(f"127.0.0.1:{port}", latency_s=0.01)
            with grpc.insecure_channel(relay) as ch:
                rev = ch.unary_unary("/shoal.test.Echo/Rev")
                big = bytes(range(256)) * 1000
                assert rev(b"hello", timeout=10) == b"olleh"
                assert rev(big, timeout=10) == big[::-1]
            st = sh.stats()
            assert st["up_bytes"] > len(big) and st["down_bytes"] > len(big)
    finally:
        server.stop(0)


def test_close_drops_open_connections():
    srv, addr = _serve(_Echo)
    sh = LinkShaper()
    s = connect(sh.proxy_for(addr, latency_s=0.001))
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    sh.close()
    try:
        got = s.recv(1)
    except ConnectionResetError:
        got = b""
    assert got == b""  # the relay closed its side
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        sh.proxy_for(addr)
    srv.shutdown()
