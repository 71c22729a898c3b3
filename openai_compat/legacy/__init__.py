"""worker-vllm's native job form."""
