"""Ray's shutdown at the end of a command: ``ray.shutdown()`` against fedsim's ``stop_ray`` (the autoscaler
monitor killed first instead of given its one-second SIGTERM grace), interleaved.

Each repeat starts Ray as a run does (no dashboard, two one-CPU actors that answer once and are killed, as
the runtime kills its pool before stopping Ray), stops it one way or the other in a fresh process, and times
the stop. Also checks that no process Ray started is left alive afterwards.

    python benchmarks/ray_shutdown.py [--repeats 3]

Prints the machine (CPUs, load average before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
import ray
from fedsim.app.ray_runtime import stop_ray
ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=1)
class Actor:
    def ping(self):
        return 1

actors = [Actor.remote() for _ in range(2)]
ray.get([a.ping.remote() for a in actors])
for a in actors:
    ray.kill(a, no_restart=True)
procs = [i.process for infos in ray._private.worker._global_node.all_processes.values() for i in infos]
t0 = time.perf_counter()
(stop_ray if sys.argv[1] == "stop_ray" else ray.shutdown)()
seconds = time.perf_counter() - t0
time.sleep(0.2)
print(json.dumps({"seconds": seconds, "left_alive": sum(p.poll() is None for p in procs)}))
"""


def machine() -> str:
    return f"{os.cpu_count()} CPUs, load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"before: {machine()}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
    times: dict[str, list[float]] = {"ray.shutdown": [], "stop_ray": []}
    for i in range(args.repeats):
        for way in (["ray.shutdown", "stop_ray"] if i % 2 == 0 else ["stop_ray", "ray.shutdown"]):
            out = subprocess.run([sys.executable, "-c", CHILD, way], env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            times[way].append(r["seconds"])
            print(f"{way:13s} {r['seconds']:.3f} s  processes left alive: {r['left_alive']}", flush=True)
    a, b = statistics.median(times["ray.shutdown"]), statistics.median(times["stop_ray"])
    print(f"median: ray.shutdown {a:.3f} s, stop_ray {b:.3f} s, ratio {b / a:.2f}")
    print(f"after: {machine()}")


if __name__ == "__main__":
    main()
