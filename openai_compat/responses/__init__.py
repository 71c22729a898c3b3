"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), served on the chat path."""
