"""/v1/chat/completions, and the conversation-to-reply path chat-like endpoints share (see serving.py)."""
