"""The OpenAI-compatible layer: request models, validation, serving, SSE, errors and the local gateway."""
