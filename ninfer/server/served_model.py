"""ServedModel: what the API process resolved once at start-up about the loaded artifact.

Identity, tokenizer, chat template and its capabilities, prompt builder, sampling
defaults, stop tokens and the thinking-budget close sequence, plus the engine client.
Endpoints read it; nothing in it changes while serving.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ninfer.artifact import Artifact
from ninfer.config import ServeConfig
from ninfer.contract.request import ThinkingBudget
from ninfer.contract.sampling import SamplingOverrides
from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from ninfer.frontend.prompt_builder import PromptBuilder
from ninfer.frontend.sampling_defaults import SamplingDefaults
from ninfer.frontend.template import ChatTemplate
from ninfer.server.engine_client import EngineClient
from ninfer.server.openai_responses.store import ResponseStore
from ninfer.server.request_context import RequestContext
from ninfer.server.request_events import RequestEvents

if TYPE_CHECKING:
    from ninfer.server.prompt_media import PromptMedia

log = logging.getLogger("ninfer.server")

# Qwen's canonical early-close guidance, committed when a thinking budget runs out.
THINKING_CLOSE_GUIDANCE = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly now."
)

# A minimal ChatML template for artifacts that ship none.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class ServedModel:
    config: ServeConfig
    artifact: Artifact
    engine: EngineClient
    model_id: str
    template: ChatTemplate
    capabilities: TemplateCapabilities
    prompt_builder: PromptBuilder
    sampling_defaults: SamplingDefaults
    process_sampling: SamplingOverrides
    stop_token_ids: list[int]
    think_end_token_id: int | None
    thinking_close_ids: list[int] = field(default_factory=list)
    response_store: ResponseStore = field(default_factory=ResponseStore)  # stored Responses (LRU)
    events: RequestEvents = field(default_factory=RequestEvents)  # measurement events (request log, metrics)
    prompt_media: PromptMedia | None = None  # with --vision: acquires, prepares and expands media
    vocabulary: GrammarVocabulary | None = None  # token bytes for log probabilities (indexed on first use)

    @classmethod
    def create(cls, config: ServeConfig, artifact: Artifact, engine: EngineClient) -> ServedModel:
        source = artifact.chat_template
        if source is None:
            log.warning("the artifact has no chat template; using a plain ChatML template")
            source = FALLBACK_TEMPLATE
        tokenizer = artifact.tokenizer
        template = ChatTemplate.for_tokenizer(source, tokenizer)
        capabilities = TemplateCapabilities.resolve(template)
        builder = PromptBuilder(
            template,
            tokenizer,
            capabilities,
            default_thinking=not config.no_thinking,
            default_preserve_thinking=config.preserve_thinking,
            max_long_anchors=config.engine.num_long_anchors,
        )
        think_end = tokenizer.token_to_id(capabilities.think_close) if capabilities.think_close else None
        close_ids: list[int] = []
        if capabilities.think_close:
            close_ids = tokenizer.encode(THINKING_CLOSE_GUIDANCE + "\n" + capabilities.think_close + "\n\n")
        return cls(
            config=config,
            artifact=artifact,
            engine=engine,
            model_id=config.model_id or artifact.model_id,
            template=template,
            capabilities=capabilities,
            prompt_builder=builder,
            sampling_defaults=SamplingDefaults.for_model(artifact.config, artifact.generation_defaults),
            process_sampling=config.sampling,
            stop_token_ids=_stop_token_ids(artifact),
            think_end_token_id=think_end,
            thinking_close_ids=close_ids,
            response_store=ResponseStore(config.response_store_max_records, config.response_store_max_mib << 20),
            prompt_media=_prompt_media(config, tokenizer) if config.engine.vision else None,
            vocabulary=GrammarVocabulary(tokenizer, artifact.config.vocab_size),
        )

    def record_server_start(self) -> None:
        """The server_start event: identity, capacities, sampler and thinking defaults, memory, device."""
        config = self.config
        info = dict(self.engine.engine_info)
        info.pop("pid", None)
        weight_format = info.pop("weight_format", None)
        vision_encoder = info.pop("vision_encoder", None)
        artifact_config = self.artifact.config
        self.events.emit("server_start", {
            "identity": {
                "model_id": self.model_id,
                "artifact": config.artifact,
                "model_type": artifact_config.model_type,
                "dtype": config.dtype,
                "weight_format": weight_format,
            },
            "sampler_defaults": self.sampling_defaults.describe(),
            "sampler_overrides": {k: v for k, v in dataclasses.asdict(config.sampling).items() if v is not None},
            "thinking": {
                "default_enabled": not config.no_thinking and self.capabilities.thinking_default,
                "supported": self.capabilities.supports_thinking,
                "preserve_thinking": config.preserve_thinking,
                "default_thinking_budget": config.default_thinking_budget,
            },
            "default_max_tokens": config.default_max_tokens,
            "max_pending_requests": config.engine.max_pending_requests,
            "pending_timeout_ms": config.engine.pending_timeout_ms,
            **info,
            "vision_workspace": self._vision_workspace(vision_encoder),
            "argv": redacted_argv(config.argv, config.api_key),
        })

    def _vision_workspace(self, encoder: dict | None) -> dict | None:
        """The media bounds prompts are prepared under (this process) with the encoder's peak and
        the hand-off of its rows to prompt steps (the engine's); None without --vision."""
        if self.prompt_media is None:
            return None
        encoder = encoder or {"encode_peak_bytes": None, "handoff": None}
        return {**self.prompt_media.describe(), **encoder}

    def close(self) -> None:
        """Stop the request log's writer and the media workers (shutdown)."""
        self.events.close()
        if self.prompt_media is not None:
            self.prompt_media.close()

    @property
    def request_context(self) -> RequestContext:
        return RequestContext(
            self.model_id, self.capabilities, self.config.default_max_tokens, vision_enabled=self.config.engine.vision
        )

    @property
    def model_capabilities(self) -> dict[str, bool]:
        """What a client may ask of this server, for GET /v1/models (the chat page reads it)."""
        caps = self.capabilities
        return {
            "vision": self.config.engine.vision,
            "tools": caps.supports_tools,
            # What a request that says nothing gets: the template's default, or --no-thinking's where it can switch.
            "thinking_default": caps.supports_thinking and (not self.config.no_thinking if caps.supports_thinking_switch
                                                            else caps.thinking_default),
            "thinking_switch": caps.supports_thinking_switch,  # enable_thinking true and false both rendered
        }

    @property
    def max_model_len(self) -> int:
        return self.config.engine.max_context

    def thinking_budget(self, thinking: bool, requested: int | None = None) -> ThinkingBudget | None:
        """The cap for a thinking-enabled request: the request's own, else the process default."""
        budget = requested if requested is not None else self.config.default_thinking_budget
        if not thinking or budget is None or self.think_end_token_id is None:
            return None
        return ThinkingBudget(budget, self.thinking_close_ids, self.think_end_token_id)


def redacted_argv(argv: tuple[str, ...], api_key: str | None) -> list[str]:
    """The command line with the API key's value replaced (as its own word or after '=')."""
    out = []
    hide_next = False
    for word in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
        elif word == "--api-key":
            out.append(word)
            hide_next = True
        elif word.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        elif api_key and api_key in word:
            out.append(word.replace(api_key, "<redacted>"))
        else:
            out.append(word)
    return out


def _stop_token_ids(artifact: Artifact) -> list[int]:
    """End-of-turn ids from the config, generation defaults and tokenizer, in that order."""
    ids: list[int] = list(artifact.config.eos_token_id)
    generation_eos = artifact.generation_defaults.get("eos_token_id")
    if isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    for token_id in [*(generation_eos or []), artifact.tokenizer.eos_token_id]:
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


def _prompt_media(config: ServeConfig, tokenizer) -> PromptMedia:
    # Imported only with --vision: the media stack (Pillow, PyAV) is not loaded otherwise.
    from ninfer.server.prompt_media import PromptMedia

    return PromptMedia.create(
        tokenizer,
        config.media_cache_mib,
        config.media_live_mib,
        config.media_preprocess_threads,
        config.media_allow_private_networks,
    )
