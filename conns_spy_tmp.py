import subprocess, sys, time, signal, pstats
from bench.crowd import Crowd
from bench.stats import proc_cpu_s
from fencemq.server.embedded import EmbeddedRedis
kind = sys.argv[1]; n = int(sys.argv[2]); out = sys.argv[3]
with EmbeddedRedis() as server:
    p = subprocess.Popen([sys.executable, "conns_cpuprof_tmp.py", server.url, out], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = int(p.stdout.readline().split()[1]); mport = int(p.stdout.readline().split()[1])
    time.sleep(1)
    with Crowd(kind, n, [port if kind == "resp" else mport], prefix="p", processes=2) as c:
        c0 = proc_cpu_s(p.pid)
        r = c.run("connect")
        c1 = proc_cpu_s(p.pid)
        print(kind, r["outcome"], "wall", round(r["wall_s"], 2), "rate", round(n / r["wall_s"]), "worker cpu/conn us (profiled)", round((c1 - c0) / n * 1e6))
    p.send_signal(signal.SIGTERM); p.wait()
st = pstats.Stats(out); st.sort_stats("tottime").print_stats(40)
