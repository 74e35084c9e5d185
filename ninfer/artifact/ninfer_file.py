"""Open a `.ninfer` container: one file with everything a server needs, weights in runtime layout.

The container is a safetensors file (inspectable with any safetensors tool, memory-mapped
when read). Its `__metadata__` holds the resources, each under its own key:

    format                        "ninfer"
    manifest.json                 format version, identity.model_id, weight format and the
                                  quantized modules, optional parts, generation defaults
    config.json                   the model's Hugging Face config
    frontend/chat_template.jinja  the chat template, byte for byte (absent: none)
    tokenizer/tokenizer.json      the tokenizers-format tokenizer
    tokenizer/tokenizer_config.json
    sha256.json                   each tensor's SHA-256 (checked by `ninfer verify`)
    <kind>/config.json            a DFlash / DFlash2 drafter companion's config, if packed

Model tensors carry the names the built model holds them under (packed projections, FP8
weights and scales), so loading is one copy per tensor. Tensors of optional parts carry a
prefix: `vision/` (the vision tower, checkpoint names) and `dflash/` / `dflash2/`.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from ninfer.artifact.artifact import NINFER, Artifact, ArtifactError, read_json_text, without_weights
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    # Only reading tensors needs torch: a container opened for its metadata only never imports it.
    import torch

    from ninfer.models.causal_lm import CausalLM

FORMAT_NAME = "ninfer"
FORMAT_VERSION = 1
MANIFEST_KEY = "manifest.json"
CONFIG_KEY = "config.json"
TEMPLATE_KEY = "frontend/chat_template.jinja"
TOKENIZER_KEY = "tokenizer/tokenizer.json"
TOKENIZER_CONFIG_KEY = "tokenizer/tokenizer_config.json"
VISION_PREFIX = "vision/"
COMPANION_KINDS = ("dflash", "dflash2")
PART_PREFIXES = (VISION_PREFIX, *(f"{kind}/" for kind in COMPANION_KINDS))
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def is_container(path: Path) -> bool:
    """Whether `path` is a file whose safetensors header declares format "ninfer"."""
    try:
        header = read_header(path)
    except ArtifactError:
        return False
    return header.get("__metadata__", {}).get("format") == FORMAT_NAME


def read_header(path: Path) -> dict[str, Any]:
    """The safetensors header of `path`, checked against the file's size."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ArtifactError(f"{path}: too short to be a .ninfer container")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > _MAX_HEADER_BYTES:
                raise ArtifactError(f"{path}: not a .ninfer container (header length {header_bytes})")
            text = handle.read(header_bytes)
            size = handle.seek(0, 2)
    except OSError as error:
        raise ArtifactError(f"{path}: cannot read ({error.strerror or error})") from error
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArtifactError(f"{path}: not a .ninfer container (header is not JSON: {error})") from error
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise ArtifactError(f"{path}: not a .ninfer container (malformed header)")
    try:
        data_bytes = max(
            (int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"), default=0
        )
    except (KeyError, IndexError, TypeError, ValueError):
        raise ArtifactError(f"{path}: not a .ninfer container (a tensor entry has no data_offsets)") from None
    if size != 8 + header_bytes + data_bytes:
        raise ArtifactError(
            f"{path}: truncated or padded: {size} bytes, the header describes {8 + header_bytes + data_bytes}"
        )
    return header


def _resource(path: Path, metadata: dict[str, str], key: str, *, required: bool = True) -> str | None:
    value = metadata.get(key)
    if value is None and required:
        raise ArtifactError(f"{path}: the container has no {key}")
    return value


def _json_resource(path: Path, metadata: dict[str, str], key: str) -> Any:
    return read_json_text(_resource(path, metadata, key), f"{path}:{key}")  # type: ignore[arg-type]


def read_manifest(path: Path, metadata: dict[str, str]) -> dict[str, Any]:
    if metadata.get("format") != FORMAT_NAME:
        raise ArtifactError(f'{path}: not a .ninfer container (metadata "format" is {metadata.get("format")!r})')
    manifest = _json_resource(path, metadata, MANIFEST_KEY)
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: {MANIFEST_KEY} must be a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: container format version {version!r}; this server reads version {FORMAT_VERSION}"
        )
    identity = manifest.get("identity")
    model_id = identity.get("model_id") if isinstance(identity, dict) else None
    if not isinstance(model_id, str) or not model_id.strip():
        raise ArtifactError(f'{path}: {MANIFEST_KEY} needs a non-empty string "identity.model_id"')
    if not isinstance(manifest.get("weights", {}).get("modules", {}), dict):
        raise ArtifactError(f'{path}: {MANIFEST_KEY} "weights.modules" must be an object')
    return manifest


class ContainerTensors:
    """The container's tensors, read through safetensors' memory map."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = path
        entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        # File order, so reads stream through the file.
        self.names = sorted(entries, key=lambda name: entries[name]["data_offsets"][0])
        self.shapes = {name: tuple(entries[name]["shape"]) for name in self.names}
        self.byte_sizes = {name: entries[name]["data_offsets"][1] - entries[name]["data_offsets"][0] for name in self.names}

    def model_names(self) -> list[str]:
        return [name for name in self.names if not name.startswith(PART_PREFIXES)]

    def read(self, names: list[str], device: str = "cpu", progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        total = sum(self.byte_sizes[name] for name in names)
        bar = tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=not progress, leave=False)
        try:
            with safe_open(self.path, framework="pt", device=device) as handle:
                for name in names:
                    yield name, handle.get_tensor(name)
                    bar.update(self.byte_sizes[name])
        except SafetensorError as error:
            raise ArtifactError(f"{self.path}: unreadable tensor data ({error})") from error
        finally:
            bar.close()

    def part(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of one optional part, names without the prefix."""
        names = [name for name in self.names if name.startswith(prefix)]
        for name, tensor in self.read(names):
            yield name.removeprefix(prefix), tensor


class ContainerPart:
    """One optional part's tensors (names without the prefix), shaped like SafetensorsWeights."""

    def __init__(self, tensors: ContainerTensors, prefix: str):
        self.tensors = tensors
        self.prefix = prefix
        self.names = [name.removeprefix(prefix) for name in tensors.names if name.startswith(prefix)]
        self.shapes = {name: tensors.shapes[prefix + name] for name in self.names}

    def read(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.tensors.part(self.prefix)


def container_part(artifact: Artifact, prefix: str) -> ContainerPart:
    return ContainerPart(ContainerTensors(artifact.path, read_header(artifact.path)), prefix)


def verify_container(path: Path, progress: bool = True) -> list[str]:
    """Recompute every tensor's SHA-256; returns the names whose bytes differ from sha256.json."""
    from ninfer.artifact.safetensors_writer import DIGESTS_KEY  # the writer imports torch

    header = read_header(path)
    metadata = header.get("__metadata__", {})
    read_manifest(path, metadata)
    digests = _json_resource(path, metadata, DIGESTS_KEY)
    tensors = ContainerTensors(path, header)
    start = 8 + struct.unpack("<Q", path.open("rb").read(8))[0]
    mismatched = [name for name in tensors.names if name not in digests]
    total = sum(tensors.byte_sizes.values())
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        with tqdm(total=total, desc="verifying", unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
            for name in tensors.names:
                begin, end = header[name]["data_offsets"]
                digest = hashlib.sha256(view[start + begin : start + end]).hexdigest()
                if digest != digests.get(name):
                    mismatched.append(name)
                bar.update(end - begin)
        view.release()
    return sorted(set(mismatched))


def open_ninfer_file(path: Path, weights: bool = True) -> Artifact:
    """weights=False: config, tokenizer and template only; no tensor is read or checked."""
    header = read_header(path)
    metadata = header.get("__metadata__", {})
    manifest = read_manifest(path, metadata)
    hf_config = _json_resource(path, metadata, CONFIG_KEY)
    if not isinstance(hf_config, dict):
        raise ArtifactError(f"{path}: {CONFIG_KEY} must be a JSON object")
    try:
        config = ModelConfig.from_hf(hf_config, source=f"{path}:{CONFIG_KEY}")
    except ConfigError as error:
        raise ArtifactError(str(error)) from error
    tensors = None
    if weights:
        tensors = ContainerTensors(path, header)
        if config.mtp_num_hidden_layers and not any(name.startswith("mtp.") for name in tensors.names):
            config = config.replace(mtp_num_hidden_layers=0)
        _check_tensors(config, header, tensors, _modules(manifest), str(path))

    tokenizer_config = _json_resource(path, metadata, TOKENIZER_CONFIG_KEY)
    if not isinstance(tokenizer_config, dict):
        raise ArtifactError(f"{path}: {TOKENIZER_CONFIG_KEY} must be a JSON object")
    try:
        tokenizer = Tokenizer.from_json_string(_resource(path, metadata, TOKENIZER_KEY), tokenizer_config)
    except Exception as error:  # tokenizers signals every parse problem with a bare Exception
        raise ArtifactError(f"{path}: cannot load {TOKENIZER_KEY} ({error})") from error
    return Artifact(
        path=path,
        kind=NINFER,
        model_id=manifest["identity"]["model_id"],
        hf_config=hf_config,
        config=config,
        tokenizer=tokenizer,
        chat_template=_resource(path, metadata, TEMPLATE_KEY, required=False),
        generation_defaults=dict(manifest.get("generation_defaults") or {}),
        num_tensors=0 if tensors is None else len(tensors.model_names()),
        read_weights=without_weights(path) if tensors is None else _runtime_layout_only(path),
        runtime_loader=None if tensors is None else _runtime_loader(tensors, _modules(manifest), str(path)),
        read_part=None if tensors is None else _part_reader(tensors),
        manifest=manifest,
        resources=metadata,
    )


def _modules(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's quantized modules: name -> how its weight is stored."""
    return manifest.get("weights", {}).get("modules", {})


def _runtime_loader(
    tensors: ContainerTensors, modules: dict[str, dict[str, Any]], source: str
) -> Callable[..., CausalLM]:
    def load(
        config: ModelConfig, dtype: torch.dtype | None, device: torch.device | str, progress: bool,
        quantize: str | None = None, shard=None,
    ) -> CausalLM:
        """config: the artifact's, possibly narrowed since opening (no MTP head without --spec mtp).
        quantize: the layers the container holds unquantized, quantized as their tensors arrive.
        shard: load one tensor-parallel rank's part (parallel/shard_plan.py)."""
        import torch

        from ninfer.models.runtime_layout import build_runtime_model, load_runtime_tensors, quantized_modules

        dtype = dtype or getattr(torch, config.torch_dtype, torch.bfloat16)
        model = build_runtime_model(config, dtype, device, modules, source, quantize, shard)
        device_name = str(torch.device(device))
        reader = tensors.read(tensors.model_names(), device=device_name, progress=progress)
        quantized_at_load = quantized_modules(model).keys() - modules.keys()
        load_runtime_tensors(model, reader, source, quantized_at_load, dtype, shard)
        return model.eval()

    return load


def _check_tensors(
    config: ModelConfig, header: dict[str, Any], tensors: ContainerTensors, modules: dict[str, dict[str, Any]],
    source: str,
) -> None:
    """Dry run on the meta device: every tensor the model holds is present with its shape."""
    import torch

    from ninfer.models.loader import WeightLoadError
    from ninfer.models.runtime_layout import build_runtime_model, load_runtime_tensors

    try:
        meta_model = build_runtime_model(config, torch.float32, "meta", modules, source)
        meta_tensors = (
            (name, torch.empty(tensors.shapes[name], device="meta", dtype=_stored_dtype(header[name]["dtype"])))
            for name in tensors.model_names()
        )
        load_runtime_tensors(meta_model, meta_tensors, source)
    except WeightLoadError as error:
        raise ArtifactError(str(error)) from error


def _stored_dtype(name: str) -> torch.dtype:
    from ninfer.artifact.safetensors_writer import DTYPE_NAMES

    for dtype, dtype_name in DTYPE_NAMES.items():
        if dtype_name == name:
            return dtype
    raise ArtifactError(f"unsupported tensor dtype {name!r}")


def _runtime_layout_only(path: Path) -> Callable[..., Iterator[tuple[str, torch.Tensor]]]:
    def read(*_: object) -> Iterator[tuple[str, torch.Tensor]]:
        raise ArtifactError(f"{path}: a .ninfer container holds runtime-layout tensors; load it with load_model")

    return read


def _part_reader(tensors: ContainerTensors) -> Callable[[str], Iterator[tuple[str, torch.Tensor]]]:
    def read(prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        return tensors.part(prefix)

    return read
