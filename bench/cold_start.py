"""Cold start: the time from process start to the first streamed token of a chat request, as a serverless worker
sees it on scale-up. Each case starts a fresh process (`python bench/cold_start.py --child`, which imports the
worker, loads the model and streams one request through the real handler) and reports when the engine was ready
and when the first token arrived, counted from just before the process was spawned.

    .venv/bin/python bench/cold_start.py [--repeats 3] [--model /tmp/usermodel]

Cases, for the embedded model (and --model, a local folder, when given):
- cold: an empty start-up verdict cache (engine/startup_cache.py) in a fresh BASE_PATH, so every probe and
  check runs; the converted GGUF model and the native kernels' build are warm (the converted folder is linked
  in from the default BASE_PATH, converted there first if needed): what a new volume or a new CPU costs.
- warm: a second start on that BASE_PATH, the verdicts reused: what every later scale-up costs.
Each line gives the median over --repeats starts (cold ones each on a fresh BASE_PATH) and every value.
"""
from __future__ import annotations

import argparse
import asyncio
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = {"openai_route": "/v1/chat/completions",
       "openai_input": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                        "max_tokens": 8, "temperature": 0, "stream": True}}


def _child() -> None:
    """One start: import the worker, load, stream the job; print when ready and when the first part came."""
    sys.path.insert(0, str(ROOT))
    from worker import handler

    async def run() -> None:
        await handler.get_worker().engine.start()
        print(f"READY {time.time()}", flush=True)
        parts = handler.handler({"id": "cold-start", "input": JOB})
        await parts.__anext__()
        print(f"FIRST {time.time()}", flush=True)
        await parts.aclose()
        handler.close()

    asyncio.run(run())


def _start(env: dict[str, str]) -> tuple[float, float]:
    """(ready, first token) seconds after the spawn of one child process."""
    started = time.time()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    marks = dict(line.split() for line in done.stdout.splitlines() if line.startswith(("READY ", "FIRST ")))
    if done.returncode != 0 or "FIRST" not in marks:
        raise RuntimeError(f"the worker did not stream a token:\n{done.stderr[-3000:]}")
    return float(marks["READY"]) - started, float(marks["FIRST"]) - started


def _fresh_base(model_env: dict[str, str]) -> Path:
    """A new BASE_PATH holding the converted GGUF models of the default one (the conversion is not what this
    benchmark times), and nothing else."""
    base = Path(tempfile.mkdtemp(prefix="cold-start-"))
    from worker.settings import load_settings

    default = load_settings().base_path
    if "MODEL_NAME" not in model_env:
        from engine.config import EngineConfig
        from engine.loader import model_folder

        model_folder(EngineConfig(cache_dir=default))  # converts the embedded model once if it never was
    # The converted models and the CPU kernels' builds are not what this benchmark times (an image carries both).
    for folder in ("converted", "native-kernels"):
        if (default / folder).is_dir():
            (base / folder).symlink_to(default / folder)
    return base


def _case(label: str, model_env: dict[str, str], repeats: int) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("BASE_PATH", "MODEL_NAME")}
    env.update(model_env)
    cold, warm, bases = [], [], []
    try:
        for _ in range(repeats):
            bases.append(_fresh_base(model_env))
            cold.append(_start({**env, "BASE_PATH": str(bases[-1])}))
            warm.append(_start({**env, "BASE_PATH": str(bases[-1])}))
    finally:
        for base in bases:
            shutil.rmtree(base, ignore_errors=True)
    for kind, runs in (("cold (empty verdict cache; converted model and kernel builds warm)", cold), ("warm (second start)", warm)):
        ready = statistics.median(r for r, _ in runs)
        first = statistics.median(f for _, f in runs)
        print(f"cold start, {label}, {kind}: first token {first:.2f} s after process start (ready {ready:.2f} s); "
              f"median of {len(runs)}: {', '.join(f'{f:.2f}' for _, f in runs)}", flush=True)


def main() -> None:
    if "--child" in sys.argv:
        _child()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="also a local model folder (MODEL_NAME)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    # The image compiles the project's bytecode when it is built (Dockerfile); so does this, once, where the
    # environment turns off writing it at import (PYTHONDONTWRITEBYTECODE).
    for package in ("engine", "openai_compat", "worker"):
        compileall.compile_dir(ROOT / package, quiet=1)
    _case("embedded model", {}, args.repeats)
    if args.model:
        _case(args.model, {"MODEL_NAME": args.model}, args.repeats)


if __name__ == "__main__":
    main()
