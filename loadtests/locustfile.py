"""The trace-replay locustfile for the plain `locust` CLI (standalone or distributed).

    locust -f loadtests/locustfile.py --headless -u 256 -r 256 --run-time 10m \
        --host http://127.0.0.1:8000 --kvtune-workload traces.jsonl

The users live in kvtune/locustfile.py; see its docstring for every flag.
"""
from kvtune.locustfile import *  # noqa: F401,F403
