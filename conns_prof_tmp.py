import subprocess, sys, time, signal, pstats
from bench.crowd import Crowd
from fencemq.server.embedded import EmbeddedRedis
kind = sys.argv[1]; n = int(sys.argv[2])
with EmbeddedRedis() as server:
    p = subprocess.Popen([sys.executable, "-m", "bench.serve_worker", "--redis-url", server.url, "--mqtt-port", "0", "--profile", "/tmp/conns_prof.out", "--max-connections", "19000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = int(p.stdout.readline().split()[1]); mport = int(p.stdout.readline().split()[1])
    time.sleep(1)
    with Crowd(kind, n, [port if kind == "resp" else mport], prefix="p", processes=2) as c:
        r = c.run("connect"); print(r["outcome"], round(r["wall_s"], 2), n / r["wall_s"], r["crowd_cpu_s"])
    time.sleep(1)
    p.send_signal(signal.SIGTERM); p.wait()
st = pstats.Stats("/tmp/conns_prof.out"); st.sort_stats("tottime").print_stats(45)
