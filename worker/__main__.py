"""`python -m worker`: the image's command. With PORT set (or SERVING_MODE=http) it serves a load-balancing
endpoint over HTTP (worker/load_balancing.py); else it takes queue jobs (see worker.handler for the modes)."""
import sys

from worker.load_balancing import entrypoint_main

sys.exit(entrypoint_main()())
