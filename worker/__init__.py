"""The worker process: settings from the environment, logging, the platform entrypoint and its shutdown, and the
local HTTP gateway that runs each OpenAI call as a job (gateway.py, `python -m worker.gateway`)."""
