"""RunPod's conventional entrypoint, `python handler.py` from a checkout: the worker lives in the `worker` package
(`python -m worker` is the same command: queue jobs, or HTTP for a load-balancing endpoint when PORT is set)."""
import sys

from worker.load_balancing import entrypoint_main

if __name__ == "__main__":
    sys.exit(entrypoint_main()())
