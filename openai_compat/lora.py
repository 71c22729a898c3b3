"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, served when
VLLM_ALLOW_RUNTIME_LORA_UPDATING is on (as vLLM gates them). A loaded adapter is then chosen by `model` like those of
LORA_MODULES (engine/lora/)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from engine import AdapterError

from .errors import OpenAIError
from .protocol import RequestModel

if TYPE_CHECKING:
    from .serving import OpenAIServing


class LoadLoraAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)


async def _ready(serving: OpenAIServing, name: str) -> None:
    if not serving.config.runtime_lora_updating:
        raise OpenAIError("loading and unloading LoRA adapters at runtime is off; set "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (with ENABLE_LORA=true) to allow it", status=404)
    await serving.ready()
    if not serving.engine.lora_enabled:
        raise OpenAIError("LoRA adapters are off; set ENABLE_LORA=true", param="lora_name")
    if name == serving.served_model_name:
        raise OpenAIError(f"`{name}` is the base model's name", param="lora_name")


async def load_adapter(serving: OpenAIServing, request: LoadLoraAdapterRequest) -> dict:
    await _ready(serving, request.lora_name)
    try:
        await serving.engine.load_lora(request.lora_name, request.lora_path)
    except AdapterError as exc:
        raise OpenAIError(str(exc), param="lora_path" if "already loaded" not in str(exc) else "lora_name") from None
    return {"object": "lora_adapter", "id": request.lora_name, "parent": serving.served_model_name,
            "message": f"Success: LoRA adapter '{request.lora_name}' added successfully."}


async def unload_adapter(serving: OpenAIServing, request: UnloadLoraAdapterRequest) -> dict:
    await _ready(serving, request.lora_name)
    try:
        serving.engine.unload_lora(request.lora_name)
    except KeyError:
        raise OpenAIError(f"The lora adapter '{request.lora_name}' cannot be found.", status=404,
                          param="lora_name") from None
    return {"object": "lora_adapter", "id": request.lora_name, "deleted": True,
            "message": f"Success: LoRA adapter '{request.lora_name}' removed successfully."}
