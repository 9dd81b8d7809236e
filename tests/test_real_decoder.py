"""A real decoder's K/V through hmem and back (README.md, "Real models' K/V").

Tiny transformers decoders are built from a config with a fixed seed and
random weights (nothing is downloaded): a Llama-style model with RoPE and
grouped-query attention (8 query heads, 2 K/V heads of 16 dims, 3 layers) in
float32 and in bfloat16, a Gemma3 text model whose layers alternate sliding-
window and full attention, and a Jamba model whose layers alternate mamba and
attention.  Each runs a prompt; its cache goes into a store of embed_dim =
kv_heads x head_dim, either as users save it (a safetensors file of
``past_key_values.{i}.key``/``.value`` in bhtd, F32 or BF16, imported with
``hmem put``) or in memory (``Store.put_cache``).  The entries are read back
with ``Store.get`` in token order (each entry's meta "tokens"), turned into a
cache with ``hmem.cache_tensors`` in the model's dtype, and decoding goes on
from it for STEPS tokens: the logits are compared with those the model's own
cache gives.

F32 storage, and BF16 storage of a bfloat16 model's cache, keep every value,
so the logits are EQUAL (torch.equal).  The lossy cases are bounded a
little above what was measured (seeds 0-19, whole and chunked, max |logit
difference| over the decoded steps; the logits reach |4.7|):

    float32 model,  int8 storage   measured 0.093    bound 0.12
    bfloat16 model, int8 storage   measured 0.121    bound 0.15
    float32 model,  bf16 storage   measured 0.030    bound 0.04

INT8 keeps one scale per row of kv_heads x head_dim values (a relative step
of about 1/254 of the row's largest value); BF16 rounds a float32 value to
8 bits of mantissa.  docs/reliability.md records these figures.

Hybrid models: a sliding-window layer holds only its window's last tokens;
hmem stores what it holds, with token ranges counted from the start of the
sequence, and the rebuilt layer is told how many tokens the sequence has.  A
mamba layer holds no K/V: put_cache leaves it out, and the rebuilt cache
takes that layer's conv and recurrent states from the model's own cache.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch", reason="the real-decoder round trip needs torch (pip install 'hmem[hf]')")
transformers = pytest.importorskip(
    "transformers", reason="the real-decoder round trip needs transformers (pip install 'hmem[hf]')"
)

import hmem  # noqa: E402
from hmem.cli.app import app  # noqa: E402

KV_HEADS, HEAD_DIM = 2, 16
EMBED_DIM = KV_HEADS * HEAD_DIM  # the stores' embed_dim
PROMPT, CHUNK, STEPS = 40, 16, 3  # 40 tokens in chunks of 16: 16 + 16 + 8
ENV = {"COLUMNS": "200", "NO_COLOR": None, "FORCE_COLOR": None, "HMEM_STORE": None, "HMEM_DEBUG": None}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (model dtype, storage dtype, bound on max |logit difference|; 0: torch.equal); see the docstring
CASES = [
    ("float32", "f32", 0.0),
    ("float32", "bf16", 0.04),
    ("float32", "int8", 0.12),
    ("bfloat16", "f32", 0.0),
    ("bfloat16", "bf16", 0.0),
    ("bfloat16", "int8", 0.15),
]
LOSSY = [case for case in CASES if case[2]]

needs_layers = pytest.mark.skipif(
    not hasattr(transformers.DynamicCache(), "layers"),
    reason="hybrid models need the per-layer caches of newer transformers (DynamicCache.layers)",
)


# ---- models, run as users run them ------------------------------------------------------


def _forward(model: Any, ids: Any, cache: Any) -> tuple[Any, Any]:
    """Logits and cache of one forward pass: transformers 5 names the cache
    argument `cache` (`past_key_values` is deprecated), older releases only
    `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if cache is None:  # a new cache of the model's layer kinds; releases before 5 then return no legacy tuples
        cache = dynamic_cache(None, model.config)
    with torch.no_grad():
        out = model(ids, use_cache=True, **{name: cache})
    new = getattr(out, "cache", None)
    return out.logits, (out.past_key_values if new is None else new)


def dynamic_cache(pairs: list[Any] | None, config: Any = None) -> Any:
    """A DynamicCache holding `pairs` (none: empty), (None, None) for a layer
    of other state; with the model's config, its layers of the model's kinds."""
    params = inspect.signature(transformers.DynamicCache).parameters
    if "ddp_cache_data" not in params:  # older releases (4.45 among them)
        return transformers.DynamicCache.from_legacy_cache(None if pairs is None else tuple(pairs))
    return transformers.DynamicCache(ddp_cache_data=pairs, **({"config": config} if "config" in params else {}))


class Run:
    """A model, its prompt's cache (never run again: a forward pass appends
    to the cache it is given) and the logits decoding gives from it."""

    def __init__(self, model: Any, seed: int) -> None:
        self.model = model
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=gen)
        logits, self.cache = _forward(model, prompt, None)
        self.tokens = [int(logits[0, -1].argmax())]  # STEPS greedy tokens, then fed as is to every restored cache
        cache = self.own_cache()
        while len(self.tokens) < STEPS:
            logits, cache = _forward(model, torch.tensor([[self.tokens[-1]]]), cache)
            self.tokens.append(int(logits[0, -1].argmax()))
        self.logits = self.decode(self.own_cache())
        assert len(self.logits) == STEPS

    def own_cache(self) -> Any:
        return copy.deepcopy(self.cache)

    def decode(self, cache: Any) -> list[Any]:
        out = []
        for token in self.tokens:
            logits, cache = _forward(self.model, torch.tensor([[token]]), cache)
            out.append(logits[0, -1].clone())
        return out

    def held(self) -> list[tuple[int, Any, Any]]:
        """(layer, keys, values) of the layers that hold K/V."""
        layers = getattr(self.cache, "layers", None)
        pairs = (
            zip(self.cache.key_cache, self.cache.value_cache)
            if layers is None  # transformers < 4.56
            else ((getattr(x, "keys", None), getattr(x, "values", None)) for x in layers)
        )
        return [(i, k, v) for i, (k, v) in enumerate(pairs) if k is not None]


def _seeded(build: Any, dtype: str, seed: int) -> Run:
    torch.manual_seed(seed)
    return Run(build().to(DTYPES[dtype]).eval(), seed)


@functools.cache
def llama(dtype: str, seed: int = 0) -> Run:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    return _seeded(lambda: transformers.LlamaForCausalLM(config), dtype, seed)


@functools.cache
def gemma3() -> Run:
    # layer 0 slides: transformers counts the sequence from layer 0, the case that needs the length restored
    config = transformers.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=8,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        initializer_range=0.1,
    )
    return _seeded(lambda: transformers.Gemma3ForCausalLM(config), "float32", 0)


@functools.cache
def jamba() -> Run:
    # layers 0 and 2 are mamba, 1 and 3 attention; the mamba layers run torch's reference kernels
    config = transformers.JambaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=1,
        expert_layer_period=4,
        expert_layer_offset=3,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        initializer_range=0.1,
    )
    return _seeded(lambda: transformers.JambaForCausalLM(config), "float32", 0)


# ---- hmem: in, out, and a cache again ---------------------------------------------------


def new_store(path: Path, storage: str) -> None:
    hmem.Store.create(path, embed_dim=EMBED_DIM, hdc_dim=256, storage_dtype=storage).close()


def save_hf_file(run: Run, path: Path) -> None:
    """The cache as users save it: past_key_values.{i}.key/.value, bhtd, in the model's dtype."""
    tensors = {f"past_key_values.{i}.{name}": t for i, k, v in run.held() for name, t in (("key", k), ("value", v))}
    if run.model.dtype == torch.float32:
        hmem.write_kv_file(path, {name: t.numpy() for name, t in tensors.items()})
    else:  # numpy has no bfloat16: safetensors' torch helper writes BF16
        from safetensors.torch import save_file

        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))


def hmem_put(store: Path, file: Path, chunk: int | None) -> None:
    args = ["put", str(store), str(file), "--json"] + ([] if chunk is None else ["--chunk-tokens", str(chunk)])
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.stdout + result.stderr


def read_back(store: Path) -> dict[int, list[hmem.StoredEntry]]:
    """Each layer's entries, in token order."""
    with hmem.Store.open(store, read_only=True) as s:
        layers = sorted({info.layer_idx for info in s.entries()})
        return {
            layer: sorted((s.get(i) for i in s.entry_ids(layer)), key=lambda e: e.meta["tokens"][0]) for layer in layers
        }


def restore(run: Run, entries: dict[int, list[hmem.StoredEntry]], seq_len: int | None = None) -> Any:
    """A cache rebuilt from hmem's entries in the model's dtype.  Layers hmem
    holds nothing for (mamba) take the model's own state; a sliding-window
    layer is told the sequence's length: the last token of its last entry,
    or `seq_len` when its entries were imported from a file (whose token
    ranges start at what the layer held)."""
    tensors = dict(zip(sorted(entries), hmem.cache_tensors(entries, KV_HEADS, dtype=run.model.dtype)))
    layers = len(run.cache)
    if len(tensors) == layers and not any(getattr(x, "is_sliding", False) for x in getattr(run.cache, "layers", ())):
        return dynamic_cache([tensors[i] for i in range(layers)])
    cache = dynamic_cache([tensors.get(i, (None, None)) for i in range(layers)], run.model.config)
    own = run.own_cache()
    for i, layer in enumerate(cache.layers):
        if i not in tensors:
            cache.layers[i] = own.layers[i]  # hmem holds no state of a mamba layer
        elif getattr(layer, "is_sliding", False):
            layer.cumulative_length = seq_len or entries[i][-1].meta["tokens"][1]
    return cache


def check(run: Run, cache: Any, bound: float) -> float:
    """Decode from `cache` (used up) and compare with the model's own logits;
    returns the max |logit difference|."""
    logits = run.decode(cache)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(logits, run.logits))
    if bound == 0.0:
        assert all(torch.equal(a, b) for a, b in zip(logits, run.logits)), f"max |logit difference| {diff:.3g}"
    else:
        assert diff <= bound, f"max |logit difference| {diff:.3g} > {bound:.3g}"
    return diff


def tokens_of(entries: list[hmem.StoredEntry]) -> list[list[int]]:
    return [e.meta["tokens"] for e in entries]


# ---- the round trips --------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, CHUNK], ids=["whole", "chunked"])
@pytest.mark.parametrize(("dtype", "storage", "bound"), CASES, ids=[f"{m}-{s}" for m, s, _ in CASES])
def test_hmem_put_of_a_saved_cache_decodes_as_the_model(tmp_path, dtype, storage, bound, chunk):
    run = llama(dtype)
    save_hf_file(run, tmp_path / "kv.safetensors")
    new_store(tmp_path / "store", storage)
    hmem_put(tmp_path / "store", tmp_path / "kv.safetensors", chunk)
    entries = read_back(tmp_path / "store")
    assert sorted(entries) == [0, 1, 2]
    ranges = [[0, 16], [16, 32], [32, 40]] if chunk else [[0, PROMPT]]
    assert all(tokens_of(layer) == ranges for layer in entries.values())
    check(run, restore(run, entries), bound)


@pytest.mark.parametrize("chunk", [None, CHUNK], ids=["whole", "chunked"])
@pytest.mark.parametrize(("dtype", "storage", "bound"), CASES, ids=[f"{m}-{s}" for m, s, _ in CASES])
def test_put_cache_decodes_as_the_model(tmp_path, dtype, storage, bound, chunk):
    run = llama(dtype)
    new_store(tmp_path / "store", storage)
    with hmem.Store.open(tmp_path / "store") as s:
        ids = s.put_cache(run.cache, chunk_tokens=chunk)
    assert sorted(ids) == [0, 1, 2] and all(len(v) == (3 if chunk else 1) for v in ids.values())
    entries = read_back(tmp_path / "store")
    for layer in entries.values():
        assert [(e.meta["batch"], e.meta["chunk"]) for e in layer] == [(0, n) for n in range(len(layer))]
    check(run, restore(run, entries), bound)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("dtype", "storage", "bound"), LOSSY, ids=[f"{m}-{s}" for m, s, _ in LOSSY])
def test_lossy_storage_stays_within_the_measured_bound_over_seeds(tmp_path, dtype, storage, bound, seed):
    run = llama(dtype, seed)
    new_store(tmp_path / "store", storage)
    with hmem.Store.open(tmp_path / "store") as s:
        s.put_cache(run.cache, chunk_tokens=CHUNK)
    check(run, restore(run, read_back(tmp_path / "store")), bound)


# ---- hybrid models ----------------------------------------------------------------------


@needs_layers
def test_sliding_window_layers_round_trip_what_they_hold(tmp_path):
    run = gemma3()
    held = [tuple(layer.keys.shape) for layer in run.cache.layers]
    assert held == [(1, 2, 7, 16), (1, 2, PROMPT, 16)] * 2  # a window of 8 keeps the last 7 tokens
    new_store(tmp_path / "mem", "f32")
    with hmem.Store.open(tmp_path / "mem") as s:
        s.put_cache(run.cache, chunk_tokens=4)
    entries = read_back(tmp_path / "mem")
    assert tokens_of(entries[0]) == [[33, 37], [37, 40]]  # ranges in the sequence: its last 7 tokens
    assert tokens_of(entries[1])[-1] == [36, 40] and len(entries[1]) == 10
    check(run, restore(run, entries), 0.0)

    save_hf_file(run, tmp_path / "kv.safetensors")  # layers of 7 and of 40 tokens in one file
    new_store(tmp_path / "cli", "f32")
    hmem_put(tmp_path / "cli", tmp_path / "kv.safetensors", 4)
    entries = read_back(tmp_path / "cli")
    assert tokens_of(entries[0]) == [[0, 4], [4, 7]]  # a file does not say where the window began
    check(run, restore(run, entries, seq_len=PROMPT), 0.0)


@needs_layers
def test_mamba_layers_hold_no_kv_and_attention_layers_round_trip(tmp_path):
    run = jamba()
    assert [i for i, _, _ in run.held()] == [1, 3]
    new_store(tmp_path / "mem", "f32")
    with hmem.Store.open(tmp_path / "mem") as s:
        with pytest.raises(hmem.InvalidArgumentError, match="layer 0, which holds no K/V"):
            s.put_cache(run.cache, layers=[0, 1])
        assert s.entry_ids() == []  # the bad call stored nothing
        ids = s.put_cache(run.cache, chunk_tokens=CHUNK)
    assert sorted(ids) == [1, 3]
    entries = read_back(tmp_path / "mem")
    check(run, restore(run, entries), 0.0)

    save_hf_file(run, tmp_path / "kv.safetensors")  # past_key_values.1.* and .3.* only
    new_store(tmp_path / "cli", "f32")
    hmem_put(tmp_path / "cli", tmp_path / "kv.safetensors", CHUNK)
    entries = read_back(tmp_path / "cli")
    assert sorted(entries) == [1, 3]
    check(run, restore(run, entries), 0.0)


def test_a_restored_cache_matches_the_models_own_tensors_bit_for_bit(tmp_path):
    """The tensors themselves, not only the logits: F32 storage of a bfloat16
    cache gives back every bfloat16 value."""
    run = llama("bfloat16")
    new_store(tmp_path / "store", "f32")
    with hmem.Store.open(tmp_path / "store") as s:
        s.put_cache(run.cache, chunk_tokens=CHUNK)
    rebuilt = hmem.cache_tensors(read_back(tmp_path / "store"), KV_HEADS, dtype=torch.bfloat16)
    for (_, keys, values), (k, v) in zip(run.held(), rebuilt):
        assert k.dtype == torch.bfloat16 and torch.equal(k, keys) and torch.equal(v, values)


@pytest.mark.skipif(
    "cache" not in inspect.signature(transformers.LlamaForCausalLM.forward).parameters,
    reason="the README's example is written for transformers 5 (the `cache` argument)",
)
def test_the_readmes_example_runs():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Real models' K/V", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(import .*?)```", section, flags=re.S)
    assert block, "README.md's section \"Real models' K/V\" shows no example"
    exec(compile(block.group(1), "README.md", "exec"), {})


@pytest.mark.parametrize("chunk", [None, 100, 10], ids=["whole", "large-chunks", "small-chunks"])
@pytest.mark.parametrize("storage", ["f32", "bf16", "f16", "int8"])
def test_a_bfloat16_cache_stores_what_its_float32_copy_stores(tmp_path, storage, chunk):
    """put_cache hands bfloat16 tensors to the put as their 16-bit words
    (no float32 copy of the whole cache; a bf16 store keeps the words): the
    store holds, bit for bit, what the same cache widened to float32 gives,
    whether its entries are put one by one (large) or joined (small), from
    contiguous tensors or strided views, and answers a query alike."""
    g = torch.Generator().manual_seed(11)
    heads, dim, tokens = 2, 128, 300
    layers = [
        (
            torch.randn(1, heads, tokens, dim, generator=g).to(torch.bfloat16),
            torch.randn(1, heads, tokens, dim, generator=g).to(torch.bfloat16),
        ),
        # a [1, heads, tokens, dim] view of a [1, tokens, heads, dim] tensor (strided)
        tuple(torch.randn(1, tokens, heads, dim, generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(2)),
    ]
    widened = [(k.float(), v.float()) for k, v in layers]
    stores = {}
    for name, cache in (("words", layers), ("float32", widened)):
        with hmem.Store.create(tmp_path / name, embed_dim=heads * dim, storage_dtype=storage) as s:
            ids = s.put_cache(cache, chunk_tokens=chunk)
            query = widened[1][0][0, :, 5:9].transpose(0, 1).reshape(4, heads * dim).numpy()
            hits = [(r.entry_id, r.score) for r in s.query(query, 1, top_k=5)]
            got = [(e.meta, e.keys.copy(), e.values.copy()) for e in (s.get(i) for i in s.entry_ids())]
        stores[name] = (ids, hits, got)
    (ids, hits, got), (want_ids, want_hits, want) = stores["words"], stores["float32"]
    assert ids == want_ids and hits == want_hits
    assert len(got) == len(want) == 2 * (1 if chunk is None else -(-tokens // chunk))
    for (meta, k, v), (want_meta, want_k, want_v) in zip(got, want):
        assert meta == want_meta
        assert k.tobytes() == want_k.tobytes() and v.tobytes() == want_v.tobytes()
