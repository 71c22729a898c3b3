"""RunPod's conventional entrypoint, `python handler.py` from a checkout: the worker lives in the `worker` package
(`python -m worker` is the same command)."""
import sys

from worker.handler import main

if __name__ == "__main__":
    sys.exit(main())
