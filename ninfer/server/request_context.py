"""RequestContext: the server facts a protocol's request rules depend on, resolved at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.frontend.capabilities import TemplateCapabilities


@dataclass(frozen=True)
class RequestContext:
    model_id: str  # the public model id (the artifact's, or --model-id)
    capabilities: TemplateCapabilities  # of the loaded chat template
    default_max_tokens: int = 8192  # --default-max-tokens
    vision_enabled: bool = False  # media parts are vision_disabled otherwise
