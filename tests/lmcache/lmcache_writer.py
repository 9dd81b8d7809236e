"""Write LMCache caches with LMCache 0.5.6 itself, on the CPU: run by the
interpreter of an environment where LMCache is installed (the tests give
its path in HMEM_LMCACHE_PYTHON; hmem is not installed there), never
imported by the tests.

    python lmcache_writer.py OUT_DIR

Its real engine (LMCacheEngine, its storage manager and backends) stores
the K/V of a tiny random Llama (transformers, bf16) for a few requests
with a shared prefix, one tagged and one shorter than a chunk, into a
local_disk directory (OUT_DIR/local_disk), an fs connector directory
(OUT_DIR/fs) and a layerwise local_disk directory (OUT_DIR/layerwise: a
file per layer of each chunk).  The only stand-in is the GPU connector vLLM would give,
here a copy between a dense CPU tensor [2, layers, tokens, hidden] and
LMCache's memory objects.  It waits until every file LMCache's lookups
report is on disk, and writes OUT_DIR/oracle.json: per request its
tokens, LMCache's chunk hashes and keys and its lookup, and per file the
SHA-256 of the K/V bytes the chunk holds.
"""

import hashlib
import json
import os
import sys
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.metadata import LMCacheMetadata
from transformers import LlamaConfig, LlamaForCausalLM

MODEL_NAME = "hmem-tests/tiny-llama"  # a "/" as in a Hugging Face id
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16
HIDDEN = KV_HEADS * HEAD_DIM
CHUNK = 256
VOCAB = 1000
WAIT_SECONDS = 300  # a ceiling for the writes landing, not a pace: the loop ends as soon as they have


class CPUConnector(GPUConnectorInterface):
    """What vLLM's GPU connector does, on a dense CPU tensor kv=[2, L, T, H]."""

    def get_shape(self, num_tokens):
        return torch.Size([2, LAYERS, num_tokens, HIDDEN])

    def from_gpu(self, memory_obj, start, end, **kwargs):
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end, :])

    def to_gpu(self, memory_obj, start, end, **kwargs):
        kwargs["kv_out"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)


class CPULayerwiseConnector(VLLMPagedMemLayerwiseGPUConnector):
    """The same, one layer at a time, as LMCache's layerwise mode asks of
    it: each layer's memory objects are [T, 2, H].  A subclass of vLLM's
    layerwise connector only because LMCache checks for one; none of its
    GPU set-up runs."""

    def __init__(self):
        self.kvcaches = None
        self.use_mla = False
        self.num_layers = LAYERS

    def get_shape(self, num_tokens):
        return torch.Size([num_tokens, 2, HIDDEN])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        kv = kwargs["kv"]
        for layer in range(LAYERS):
            for obj, start, end in zip(memory_objs[layer], starts, ends):
                obj.tensor.copy_(kv[:, layer, start:end, :].permute(1, 0, 2))
            yield
        yield


def requests():
    draw = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, VOCAB, (512,), generator=draw).tolist()
    out = [
        {"name": name, "tokens": prefix + torch.randint(0, VOCAB, (n - 512,), generator=draw).tolist(), "tags": {}}
        for name, n in (("a", 600), ("b", 800), ("c", 1100))
    ]
    out.append({"name": "a-tagged", "tokens": list(out[0]["tokens"]), "tags": {"lmcache.tag.user": "alice"}})
    out.append({"name": "short", "tokens": torch.randint(0, VOCAB, (100,), generator=draw).tolist(), "tags": {}})
    return out


@torch.inference_mode()
def model_kv(model, tokens):
    """[2, layers, tokens, kv_heads * head_dim], as LMCache's chunks hold it."""
    cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    layers = [(cache.layers[i].keys, cache.layers[i].values) for i in range(LAYERS)]
    rows = [[t[0].transpose(0, 1).reshape(len(tokens), HIDDEN) for t in pair] for pair in layers]
    return torch.stack([torch.stack([k for k, _ in rows]), torch.stack([v for _, v in rows])]).contiguous()


def engine(kind, directory):
    settings = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.25, "lmcache_instance_id": kind}
    if kind in ("local_disk", "layerwise"):
        settings.update(local_disk=f"file://{directory}/", max_local_disk_size=0.5, use_layerwise=kind == "layerwise")
    else:
        settings.update(remote_storage_plugins=["fs"], extra_config={"remote_storage_plugin.fs.base_path": directory})
    metadata = LMCacheMetadata(
        model_name=MODEL_NAME,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )
    config = LMCacheEngineConfig.from_defaults(**settings)
    connector = CPULayerwiseConnector() if kind == "layerwise" else CPUConnector()
    made = LMCacheEngineBuilder.get_or_create(kind, config, metadata, connector, lambda t, r: None, lambda o, r: o)
    made.post_init()
    return made


def write(kind, directory, model, reqs):
    os.makedirs(directory, exist_ok=True)
    cache = engine(kind, directory)
    suffix = ".data" if kind == "fs" else ".pt"
    separator = "-SEP-" if kind == "fs" else "-"
    layerwise = kind == "layerwise"
    out = {"requests": [], "files": {}}
    for req in reqs:
        kv = model_kv(model, req["tokens"])
        configs = req["tags"] or None
        hashes = [h for _, _, h in cache.token_database.process_tokens(req["tokens"], make_key=False)]
        chunk_keys = [k for _, _, k in cache.token_database.process_tokens(req["tokens"], request_configs=configs)]
        extra = {"request_configs": configs} if configs else {}
        if layerwise:  # a key, and a file, per layer of each chunk
            keys = [layer_key.to_string() for k in chunk_keys for layer_key in k.split_layers(LAYERS)]
            for _ in cache.store_layer(req["tokens"], kv=kv, req_id=req["name"], sync=True, **extra):
                pass
        else:
            keys = [k.to_string() for k in chunk_keys]
            cache.store(req["tokens"], kv=kv, req_id=req["name"], **extra)
        names = [key.replace("/", separator) + suffix for key in keys]
        sizes = {}
        for number, name in enumerate(names):
            if layerwise:  # [T, 2, H] of one layer
                chunk_number, layer = divmod(number, LAYERS)
                part = kv[:, layer, chunk_number * CHUNK : (chunk_number + 1) * CHUNK, :].permute(1, 0, 2)
            else:  # [2, L, T, H]
                part = kv[:, :, number * CHUNK : (number + 1) * CHUNK, :]
            data = part.contiguous().view(torch.uint16).numpy().tobytes()
            out["files"].setdefault(name, {"sha256": hashlib.sha256(data).hexdigest(), "shape": list(part.shape)})
            sizes[name] = len(data) + (28 if kind == "fs" else 0)  # fs: a header of 7 int32 words

        def landed():
            # local_disk writes the final file in place: whole once it has its size
            return all(
                os.path.exists(os.path.join(directory, n)) and os.path.getsize(os.path.join(directory, n)) == size
                for n, size in sizes.items()
            ) and not any(n.endswith(".tmp") for n in os.listdir(directory))

        deadline = time.monotonic() + WAIT_SECONDS
        while not landed():
            if time.monotonic() > deadline:
                sys.exit(f"{kind}: LMCache's files did not land in {WAIT_SECONDS} s")
            time.sleep(0.01)
        lookup = cache.lookup(req["tokens"], request_configs=configs)
        out["requests"].append({**req, "chunk_hashes": hashes, "keys": keys, "lookup": lookup})
    LMCacheEngineBuilder.destroy(kind)
    return out


def main(out_dir):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    reqs = requests()
    oracle = {
        "model": MODEL_NAME,
        "layers": LAYERS,
        "hidden": HIDDEN,
        "chunk_size": CHUNK,
        "kv_dtype": "bfloat16",
        "caches": {
            kind: write(kind, os.path.join(out_dir, kind), model, reqs) for kind in ("local_disk", "fs", "layerwise")
        },
    }
    with open(os.path.join(out_dir, "oracle.json"), "w") as f:
        json.dump(oracle, f)


if __name__ == "__main__":
    main(sys.argv[1])
