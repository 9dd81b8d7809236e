"""The shape of an LMCache chunk: what a file's header says (fs), or what
the caller gives (``--kv-shape``, a model's config.json), or, for a
layerwise local_disk cache only, what the sizes say (local_disk files hold
bytes and nothing else, so [2, layers, tokens, hidden] cannot be told from
the size alone: only layers x tokens x hidden)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from hmem.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class KVShape:
    """A model's K/V per chunk on one tensor-parallel rank: `layers` and
    `hidden` (kv heads x head dim of that rank); MLA models keep one latent
    plane instead of K and V.  `source` says where it came from."""

    layers: int
    hidden: int
    mla: bool = False
    source: str = "given"
    kv_heads: int | None = None  # from a model config: the hidden of a rank depends on the world size
    head_dim: int | None = None

    @property
    def planes(self) -> int:
        return 1 if self.mla else 2

    def hidden_for(self, world_size: int) -> int:
        """Per-rank hidden for `world_size` ranks: vLLM splits the kv heads
        between ranks (each rank keeps at least one)."""
        if self.kv_heads is None or self.head_dim is None or self.mla:
            return self.hidden
        return max(1, self.kv_heads // max(1, world_size)) * self.head_dim

    def to_dict(self) -> dict:
        return {"layers": self.layers, "hidden": self.hidden, "mla": self.mla, "source": self.source}


def parse_kv_shape(text: str) -> KVShape:
    """``LAYERS,HIDDEN`` (hidden per rank: kv heads x head dim), with
    ``,mla`` for a model keeping one latent plane."""
    parts = [p.strip() for p in text.split(",")]
    mla = parts[-1:] == ["mla"]
    if mla:
        parts = parts[:-1]
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InvalidArgumentError(
            f"--kv-shape {text!r}: give LAYERS,HIDDEN (hidden = kv heads x head dim of one rank), e.g. 32,1024"
        )
    return KVShape(int(parts[0]), int(parts[1]), mla, source=f"given as {text}")


def kv_shape_of_model(path: str | os.PathLike[str]) -> KVShape:
    """The K/V shape of a Hugging Face model: its config.json (or a
    directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read a model config from {p}: {exc}") from exc
    config = config.get("text_config", config)  # multimodal models keep the decoder's under text_config
    try:
        layers = int(config["num_hidden_layers"])
        if config.get("kv_lora_rank"):  # MLA: one latent plane of kv_lora_rank + rope dims
            hidden = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0))
            return KVShape(layers, hidden, True, source=f"MLA model config {p}")
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{p} is not a decoder's config: no {exc}") from exc
    return KVShape(layers, kv_heads * head_dim, source=f"model config {p}", kv_heads=kv_heads, head_dim=head_dim)
