"""The worker process: settings from the environment, logging, the platform entrypoint and its shutdown."""
