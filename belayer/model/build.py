"""Deterministic build of the project's own causal LM (no hub download).

A byte-level BPE tokenizer is trained with `tokenizers` on text kept in this package
(`corpus/`), and a Llama-architecture model gets random weights drawn from a fixed seed,
one generator per tensor (seeded from the tensor's name), so that the same recipe gives
the same bytes. Sizes: `tiny` for tests and demos, `bench` (>= 100M parameters) for
benchmarks that need realistic weight-load and cold-start times, and `tiny-warm`: the tiny
model after a deterministic supervised warm start (`belayer.model.warmstart`), the one
that makes tool calls RL can improve on. Weights are written to a cache directory, never
committed. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from belayer.errors import BelayerError
from belayer.model import multistep_tasks
from belayer.model.warmstart import RECIPE, SftRecipe, Transcript, transcript, warm_state

# Bump when anything that changes the produced bytes changes (corpus, sizes, init, format):
# the cache folder name carries it, so an old build is never mistaken for a new one.
RECIPE_VERSION = 1
SEED = 20240501
CORPUS_DIR = Path(__file__).parent / "corpus"
BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"
MANIFEST = "belayer-model.json"

ModelSize = Literal["tiny", "bench", "tiny-warm", "tiny-agent"]


class ModelBuildError(BelayerError):
    """The model could not be built or the cached build is unusable."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture of one size; vocab comes from the trained tokenizer."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(hidden=256, intermediate=768, layers=4, heads=4, kv_heads=4, max_positions=4096),
    "bench": ModelShape(hidden=768, intermediate=3072, layers=12, heads=12, kv_heads=12, max_positions=4096),
}


@dataclass(frozen=True)
class WarmStart:
    """A fine-tuned model: the size it starts from (same tokenizer and config), and the
    recipe and corpus it is fine-tuned with."""

    base: str
    recipe: SftRecipe
    transcript: Transcript


# tiny-warm on the one-action learn family, tiny-agent on the three-action multistep family.
WARM_STARTS: dict[str, WarmStart] = {
    "tiny-warm": WarmStart("tiny", RECIPE, transcript),
    "tiny-agent": WarmStart("tiny", multistep_tasks.WARM_RECIPE, multistep_tasks.transcript),
}
MODEL_NAMES = (*SHAPES, *WARM_STARTS)
TOKENIZER_VOCAB = 2048
VOCAB_MULTIPLE = 64

Progress = Callable[[str], None]


def model_dir_name(size: str) -> str:
    """Cache folder name: a recipe change (base or fine-tuning) never reuses an old build."""
    if size in WARM_STARTS:
        return f"{size}-r{RECIPE_VERSION}.{WARM_STARTS[size].recipe.version}"
    return f"{size}-r{RECIPE_VERSION}"


def default_cache_dir() -> Path:
    return Path("~/.cache/belayer").expanduser()


def model_path(
    size: ModelSize = "tiny", cache_dir: Path | None = None, progress: Progress | None = None
) -> Path:
    """Path of the built model folder, building it first when it is missing."""
    target = _models_root(cache_dir) / model_dir_name(size)
    if (target / MANIFEST).is_file():
        return target
    return build_model(size, cache_dir, progress=progress)


def build_model(
    size: ModelSize = "tiny",
    cache_dir: Path | None = None,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Build the model of `size` into the cache (atomically) and return its folder; a
    fine-tuned size builds (or reuses) its base first."""
    if size not in MODEL_NAMES:
        raise ModelBuildError(f"unknown model size {size!r}; choose one of {sorted(MODEL_NAMES)}")
    say = progress or (lambda _msg: None)
    root = _models_root(cache_dir)
    target = root / model_dir_name(size)
    if (target / MANIFEST).is_file() and not force:
        say(f"already built: {target}")
        return target
    base = model_path(WARM_STARTS[size].base, cache_dir, progress) if size in WARM_STARTS else None
    with staged_folder(target) as staging:
        if base is None:
            write_model(size, staging, say)
        else:
            write_warm_model(size, base, staging, say)
    say(f"built: {target}")
    return target


def write_model(size: ModelSize, out: Path, say: Progress) -> None:
    """Write tokenizer, config and weights of `size` into the existing folder `out`."""
    say("training tokenizer on the in-repo corpus")
    tokenizer = train_tokenizer()
    vocab = tokenizer.get_vocab_size()
    save_tokenizer(tokenizer, out)
    shape = SHAPES[size]
    say(f"writing config ({shape.layers} layers, hidden {shape.hidden}, vocab {vocab})")
    save_config(shape, vocab, tokenizer, out)
    say("drawing random weights from the fixed seed")
    state = random_weights(shape, vocab)
    params = sum(t.numel() for t in state.values())
    say(f"saving {params / 1e6:.1f}M parameters as safetensors")
    from safetensors.torch import save_file  # import cost: torch, ~2.5 s

    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(out, size=size, recipe=RECIPE_VERSION, seed=SEED, params=params, vocab=vocab)


def write_warm_model(size: str, base: Path, out: Path, say: Progress) -> None:
    """Write `size` into `out`: the base's tokenizer and config, fine-tuned weights, and a
    manifest naming the fine-tuning recipe and the base build (its manifest's sha256)."""

    from safetensors.torch import save_file  # import cost: torch, ~2.5 s

    for item in sorted(base.iterdir()):
        if item.is_file() and item.name not in ("model.safetensors", MANIFEST):
            shutil.copyfile(item, out / item.name)
    warm = WARM_STARTS[size]
    say(f"fine-tuning {base.name} on generated transcripts ({warm.recipe.steps} steps)")
    state = warm_state(base, warm.recipe, say, warm.transcript)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    base_manifest = json.loads((base / MANIFEST).read_text())
    origin = {"size": base_manifest["size"], "manifest_sha256": file_sha256(base / MANIFEST)}
    write_manifest(
        out,
        size=size,
        recipe=RECIPE_VERSION,
        sft=asdict(warm.recipe),
        base=origin,
        params=base_manifest["params"],
        vocab=base_manifest["vocab"],
    )


def write_manifest(out: Path, **fields) -> None:
    """The manifest: `fields` and the sha256 of every file in `out`. Written last: its
    presence marks a complete build."""
    files = {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {**fields, "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def train_tokenizer():
    """Byte-level BPE trained on the corpus files, in sorted order, single-threaded."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel merges may tie-break differently

    texts = [p.read_text(encoding="utf-8") for p in sorted(CORPUS_DIR.glob("*.txt"))]
    if not texts:
        raise ModelBuildError(f"no corpus text under {CORPUS_DIR}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=1,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # vLLM pads embedding tables to a multiple of 64 rows; reserved tokens fill the vocabulary
    # up to that size so every id the model can emit is a real token.
    missing = -tokenizer.get_vocab_size() % VOCAB_MULTIPLE
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tokenizer


def save_tokenizer(tokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast  # import cost: transformers, ~2 s

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.save_pretrained(str(out))


def save_config(shape: ModelShape, vocab: int, tokenizer, out: Path) -> None:
    from transformers import LlamaConfig  # import cost: transformers, ~2 s

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(out))


def random_weights(shape: ModelShape, vocab: int) -> dict:
    """Hugging Face Llama state dict; each tensor from its own generator (name-seeded)."""
    import torch  # import cost: torch, ~2.5 s

    h, inter, head_dim = shape.hidden, shape.intermediate, shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    shapes: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((vocab, h), 1.0),
        "model.norm.weight": ((h,), 0.0),
        # A wide lm_head spreads the logits, so greedy argmax is far from ties: a replay whose
        # float rounding differs in the last bits still picks the same token.
        "lm_head.weight": ((vocab, h), 3.0 / h**0.5),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for name, dims in (("q_proj", (h, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, h))):
            shapes[p + f"self_attn.{name}.weight"] = (dims, 1.0 / h**0.5)
        shapes[p + "mlp.gate_proj.weight"] = ((inter, h), 1.0 / h**0.5)
        shapes[p + "mlp.up_proj.weight"] = ((inter, h), 1.0 / h**0.5)
        shapes[p + "mlp.down_proj.weight"] = ((h, inter), 1.0 / inter**0.5)
        shapes[p + "input_layernorm.weight"] = ((h,), 0.0)
        shapes[p + "post_attention_layernorm.weight"] = ((h,), 0.0)
    state = {}
    for name, (dims, std) in sorted(shapes.items()):
        if std == 0.0:  # RMSNorm scales start at one, as in a freshly initialised model
            state[name] = torch.ones(dims, dtype=torch.float32)
            continue
        gen = torch.Generator().manual_seed(_tensor_seed(name))
        state[name] = torch.randn(dims, generator=gen, dtype=torch.float32) * std
    return state


def _tensor_seed(name: str) -> int:
    digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def staged_folder(target: Path):
    """A fresh folder beside `target` to write into; when the block succeeds it replaces
    `target` whole (whatever was there goes), when it fails it is removed. A loader never
    finds a half-written folder where it looks."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _models_root(cache_dir: Path | None) -> Path:
    return (cache_dir or default_cache_dir()).expanduser() / "models"


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
