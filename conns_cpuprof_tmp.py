import sys, time, cProfile
from fencemq.config import Config
from fencemq.server.runner import run, serve
url, out = sys.argv[1], sys.argv[2]
def ready(w, port):
    print("PORT", port, flush=True); print("MQTT", w.mqtt_port, flush=True)
prof = cProfile.Profile(time.process_time)
try:
    prof.runcall(run, serve, Config(redis_url=url, port=0, mqtt_port=0, max_connections=19000), ready, loop="uvloop")
finally:
    prof.dump_stats(out)
