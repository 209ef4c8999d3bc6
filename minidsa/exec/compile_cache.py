"""The persistent compile cache: what start-up compiles, kept on disk for the next start of the same engine.

One directory (`ResolvedConfig.compile_cache_dir`: the `compile_cache_dir` engine argument, else
`$MINIDSA_CACHE_DIR`, else `$XDG_CACHE_HOME/minidsa` or `~/.cache/minidsa`; "none" turns it off) holds:
- `inductor/`, `triton/`, `deep_gemm/`: the caches of inductor, of Triton (minidsa's own kernels and
  inductor's) and of DeepGEMM's JIT, pointed there through TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and
  DG_JIT_CACHE_DIR unless the environment already names one (an explicit choice wins);
- `artifacts/<key>.bin`: torch's portable cache artifacts (`torch.compiler.save_cache_artifacts`: inductor's
  FX graphs with their Triton kernels, AOTAutograd entries, dynamic-shape profiles) of one engine
  configuration, saved after the warm-up and loaded before compiling, so a copied or rebuilt inductor
  directory still hits. `<key>.json` beside it says what the key covers.

The key (`key_inputs`) covers what changes the compiled code: the model's config, the engine arguments that
shape the graphs (dtype, page size, batch and token budgets, cache dtypes, quantization, kernel choices,
speculative decoding, tensor parallelism), the torch / triton / deep_gemm / minidsa versions, the GPU. Inductor
keys its own entries on the exact graphs, so a stale artifact file costs nothing but its load.

`CompileStats` reads torch's compile counters, so each start-up phase can say what it compiled and what the
caches gave.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

import torch

from minidsa.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

# Engine arguments that change the compiled graphs (static shapes, kernels, which layers run).
GRAPH_ARGS = ("dtype", "page_size", "max_running_requests", "max_total_tokens", "max_model_len",
              "chunked_prefill_size", "max_prefill_tokens", "max_mixed_prefill_tokens", "indexer_cache_dtype",
              "kv_cache_dtype", "quantization", "kernel_backend", "use_deep_gemm", "use_flash_mla",
              "speculative_num_steps", "speculative_topk", "speculative_num_draft_tokens",
              "index_share_for_mtp_iteration", "enable_cuda_graph", "enable_compile", "cuda_graph_max_bs",
              "enable_mixed_chunk", "tensor_parallel_size", "enable_expert_parallel",
              "enable_custom_all_reduce", "enable_dp_attention")
TOOL_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "DG_JIT_CACHE_DIR": "deep_gemm"}
MAGIC = b"minidsa compile cache 1\n"


def _version(module: str) -> str | None:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            from importlib.metadata import version

            return version(module)
        except Exception:  # noqa: BLE001 - not installed: part of the key as None
            return None
    return getattr(mod, "__version__", None)


def key_inputs(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> dict[str, Any]:
    """What the cache key covers (`config` resolved: the dtype and page size this machine gets)."""
    from minidsa.common.version import __version__

    gpu = None
    if device.type == "cuda":
        gpu = [torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))]
    return {
        "model": model_config.to_dict(),
        "engine": {name: getattr(config, name) for name in GRAPH_ARGS},
        "versions": {"minidsa": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "triton": _version("triton"), "deep_gemm": _version("deep_gemm") if config.use_deep_gemm else None,
                     "python": list(sys.version_info[:2])},
        "device": [device.type, gpu],
    }


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclasses.dataclass
class CompileStats:
    """torch's compile counters at one moment (process-wide); `since` describes what happened after."""

    frames: int = 0
    seconds: float = 0.0
    fx_hits: int = 0
    fx_misses: int = 0
    aot_hits: int = 0
    aot_misses: int = 0

    @classmethod
    def now(cls) -> "CompileStats":
        from torch._dynamo import utils

        counters = utils.counters
        times = getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner", [])
        # torch >= 2.11 no longer counts frames["ok"]; unique_graphs is what Dynamo compiled
        return cls(frames=counters["stats"]["unique_graphs"], seconds=float(sum(times)),
                   fx_hits=counters["inductor"]["fxgraph_cache_hit"],
                   fx_misses=counters["inductor"]["fxgraph_cache_miss"],
                   aot_hits=counters["aot_autograd"]["autograd_cache_hit"],
                   aot_misses=counters["aot_autograd"]["autograd_cache_miss"])

    def since(self, before: "CompileStats") -> "CompileStats":
        return CompileStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(before))))

    def describe(self) -> str:
        if not self.frames:
            return "nothing compiled"
        text = f"torch.compile {self.seconds:.1f} s for {self.frames} graphs"
        if self.fx_hits or self.fx_misses:
            text += f", inductor cache {self.fx_hits} hits / {self.fx_misses} misses"
        return text


def count_entries(path: str | None) -> int:
    """Entries of a cache directory (Triton keeps one directory per compiled kernel)."""
    try:
        return len(os.listdir(path)) if path else 0
    except OSError:
        return 0


class CompileCache:
    """The cache directory of one engine configuration: `activate_dirs` points the tools at it, `load` and
    `save` move the portable artifacts. Nothing here raises for a bad or foreign file: it is ignored with a warning."""

    def __init__(self, root: str, inputs: dict[str, Any]):
        self.root = root
        self.inputs = inputs
        self.key = cache_key(inputs)
        self.artifacts = os.path.join(root, "artifacts", f"{self.key}.bin")
        self._loaded: set[str] = set()

    @classmethod
    def for_engine(cls, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                   root: str | None) -> "CompileCache | None":
        """The cache of this engine configuration (`config` resolved) under `root`, or None when the cache is off."""
        return None if root is None else cls(root, key_inputs(config, model_config, device))

    @staticmethod
    def activate_dirs(root: str) -> dict[str, str]:
        """Point inductor, Triton and DeepGEMM at their directories under `root` (before anything compiles),
        unless the environment names theirs already. Returns each tool's directory."""
        used = {}
        for env, sub in TOOL_DIRS.items():
            if not os.environ.get(env) or os.environ[env] == _inductor_default(env):
                os.environ[env] = os.path.join(root, sub)
            used[env] = os.environ[env]
            try:
                os.makedirs(used[env], exist_ok=True)
            except OSError as e:
                logger.warning("compile cache: cannot create %s (%s)", used[env], e)
        return used

    def load(self) -> str:
        """Load the artifacts saved for this key, if any; says what happened (for the start-up log)."""
        start = time.perf_counter()
        try:
            with open(self.artifacts, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return "no artifacts for this configuration yet"
        except OSError as e:
            logger.warning("compile cache: cannot read %s (%s); compiling without it", self.artifacts, e)
            return "unreadable"
        payload = self._payload(data)
        if payload is None:
            return "ignored (not this configuration's)"
        try:
            info = torch.compiler.load_cache_artifacts(payload)
        except Exception as e:  # noqa: BLE001 - a corrupt file must not stop the engine
            info = None
            logger.warning("compile cache: %s is corrupt (%s: %s); ignored", self.artifacts, type(e).__name__, e)
        if info is None:
            logger.warning("compile cache: %s could not be loaded; ignored (it is rewritten after the warm-up)",
                           self.artifacts)
            return "ignored (corrupt)"
        self._loaded = _names(info)
        return (f"loaded {len(self._loaded)} artifacts ({len(payload) / 2**20:.1f} MiB) in "
                f"{time.perf_counter() - start:.1f} s")

    def _payload(self, data: bytes) -> bytes | None:
        header_end = data.find(b"\n", len(MAGIC))
        if not data.startswith(MAGIC) or header_end < 0:
            logger.warning("compile cache: %s is not a minidsa compile cache file; ignored", self.artifacts)
            return None
        try:
            header = json.loads(data[len(MAGIC):header_end])
        except ValueError:
            header = {}
        if header.get("key") != self.key:
            logger.warning("compile cache: %s was written for another configuration (key %s, want %s); ignored",
                           self.artifacts, header.get("key"), self.key)
            return None
        return data[header_end + 1:]

    def save(self) -> str:
        """Save this process's artifacts for this key when they hold anything the file lacks (atomically)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return "nothing to save"
        payload, info = saved
        names = _names(info)
        if not names or names <= self._loaded:
            return "up to date"
        header = json.dumps({"key": self.key, "torch": torch.__version__, "saved": time.time()}).encode()
        tmp = f"{self.artifacts}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.artifacts), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + header + b"\n" + payload)
            os.replace(tmp, self.artifacts)
            with open(self.artifacts[:-len(".bin")] + ".json", "w") as f:
                json.dump(self.inputs, f, indent=1, sort_keys=True, default=str)
        except OSError as e:
            logger.warning("compile cache: cannot write %s (%s)", self.artifacts, e)
            return "not saved"
        self._loaded = names
        return f"saved {len(names)} artifacts ({len(payload) / 2**20:.1f} MiB)"


def _inductor_default(env: str) -> str | None:
    """Inductor's default directory: importing torch._dynamo writes it into TORCHINDUCTOR_CACHE_DIR by itself,
    so that value there is no one's choice."""
    if env != "TORCHINDUCTOR_CACHE_DIR":
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except Exception:  # noqa: BLE001 - another torch: then only an unset variable is ours to set
        return None


def _names(info: Any) -> set[str]:
    """The artifact ids a torch CacheInfo lists."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {f"{kind}:{name}" for kind, names in artifacts.items() for name in names}
