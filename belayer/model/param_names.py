"""A full state dict in the parameter names the rollout nodes load (Hugging Face's, as the
model is built and the trainer saves it), from HF names or from vLLM's.

vLLM fuses some projections of a Llama-style model into one parameter: q, k and v into
`qkv_proj` (stacked along the output dimension, q first) and gate and up into
`gate_up_proj`. A trainer that already speaks vLLM's weight-transfer API sends those;
here they are cut back into the HF parameters. Anything else must match the built
model's names and shapes exactly: a missing or unknown name, or a wrong shape, is
refused with the names, never loaded half-way.
"""

from __future__ import annotations

import json
from pathlib import Path

from belayer.errors import BelayerError

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class WeightNamesError(BelayerError):
    """A state dict that does not name exactly the model's parameters."""


def hf_state_dict(tensors: dict, model_dir: Path) -> dict:
    """`tensors` under the HF names of the model built in `model_dir`, checked against its
    parameters (names and shapes)."""
    from safetensors import safe_open  # import cost: torch, ~2.5 s

    config = json.loads((model_dir / "config.json").read_text())
    unfused = _unfuse(tensors, config)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as built:
        expected = {name: tuple(built.get_slice(name).get_shape()) for name in built.keys()}  # noqa: SIM118
    _check_names(unfused, expected, model_dir)
    return unfused


def _unfuse(tensors: dict, config: dict) -> dict:
    out = {}
    for name, tensor in tensors.items():
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        parts = _FUSED[fused]
        sizes = _split_sizes(fused, config, tensor.shape[0])
        for part, piece in zip(parts, tensor.split(sizes, dim=0), strict=True):
            out[name.replace(f".{fused}.", f".{part}.")] = piece
    return out


def _split_sizes(fused: str, config: dict, rows: int) -> list[int]:
    if fused == "mlp.gate_up_proj":
        return [rows // 2, rows // 2]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return [config["num_attention_heads"] * head_dim, kv, kv]


def _check_names(tensors: dict, expected: dict[str, tuple], model_dir: Path) -> None:
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    wrong = [f"{n} is {tuple(tensors[n].shape)}, the model's is {expected[n]}"
             for n in sorted(set(tensors) & set(expected)) if tuple(tensors[n].shape) != expected[n]]  # fmt: skip
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {', '.join(missing[:5])}")
    if unknown:
        problems.append(f"not parameters of the model {len(unknown)}: {', '.join(unknown[:5])}")
    if wrong:
        problems.append(f"wrong shape {len(wrong)}: {'; '.join(wrong[:5])}")
    if problems:
        raise WeightNamesError(
            f"the weights do not fit the model built in {model_dir} ({'; '.join(problems)}); send the "
            "full state dict of that model, under its HF names or vLLM's fused ones (qkv_proj, gate_up_proj)"
        )
