"""The naming conventions of the K/V safetensors files `hmem put` imports
(docs/cli.md, "Naming conventions and layouts").

A tensor name is matched case-insensitively (``K``, ``Keys``, ``VALUE``).
Each convention says which tensors pair up as one K/V pair (or, for
``all-layers``, which one tensor holds every layer's keys and values), and
whether the name carries the layer:

    kv            keys / values, k / v, key / value          one pair
    layer         layer.{i}.k / layer.{i}.v                   layer i
    numbered      k_{n} / v_{n}                               one pair per n
    hf            past_key_values.{i}.key / .value            layer i, bhtd
    hf-tuple      past_key_values.{i}.0 / .1                  layer i, bhtd
    model-layers  model.layers.{i}.self_attn.key_cache / ...  layer i, bhtd
    all-layers    kv, kv_cache, kv_chunk, past_key_values     [layers, 2, tokens, kv_heads, head_dim]

Where a pair's role word stands (``k`` above), any of ``k``, ``key``,
``keys``, ``k_cache``, ``key_cache`` names the keys and ``v``, ``value``,
``values``, ``v_cache``, ``value_cache`` the values.  The Hugging Face
conventions (hf, hf-tuple, model-layers) say their 4-D tensors are
[batch, kv_heads, tokens, head_dim] (bhtd), as transformers keeps a cache
layer; every other layout comes from the store's embed_dim or the caller
(hmem/store/kv_layouts.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from hmem.errors import AmbiguousLayoutError, BadFileError, InvalidArgumentError, InvalidTensorError
from hmem.store import kv_layouts

_KEY_WORDS = ("k", "key", "keys", "k_cache", "key_cache")
_VALUE_WORDS = ("v", "value", "values", "v_cache", "value_cache")
ROLE = {**dict.fromkeys(_KEY_WORDS, "k"), **dict.fromkeys(_VALUE_WORDS, "v")}
_WORD = "|".join(sorted(ROLE, key=len, reverse=True))

# short name -> an example, in the order entries of one file are stored
CONVENTIONS: dict[str, str] = {
    "kv": "keys / values",
    "layer": "layer.{i}.k / layer.{i}.v",
    "numbered": "k_{n} / v_{n}",
    "hf": "past_key_values.{i}.key / .value",
    "hf-tuple": "past_key_values.{i}.0 / .1",
    "model-layers": "model.layers.{i}.self_attn.key_cache / .value_cache",
    "all-layers": "kv [layers, 2, tokens, kv_heads, head_dim]",
}
CARRIES_LAYER = frozenset({"layer", "hf", "hf-tuple", "model-layers"})
# the layout a convention gives its tensors of a rank (the rest come from the shape)
SAYS_LAYOUT = {("hf", 4): "bhtd", ("hf-tuple", 4): "bhtd", ("model-layers", 4): "bhtd"}
ALL_LAYERS_NAMES = frozenset({"kv", "kv_cache", "kv_chunk", "past_key_values"})

_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("layer", re.compile(rf"^layers?[._](\d{{1,10}})[._]({_WORD})$")),
    ("numbered", re.compile(rf"^({_WORD})[._](\d{{1,18}})$")),
    ("hf", re.compile(rf"^past_key_values[._](\d{{1,10}})[._]({_WORD})$")),
    ("hf-tuple", re.compile(r"^past_key_values[._](\d{1,10})[._]([01])$")),
    ("model-layers", re.compile(rf"^model\.layers\.(\d{{1,10}})\.(?:[a-z0-9_]+\.)*?({_WORD})$")),
)


class Slot(NamedTuple):
    """What a tensor name says: its convention, the number in it (a layer
    for the conventions that carry one, an entry number for ``numbered``,
    else 0) and its role: "k", "v", or "kv" (an all-layers tensor)."""

    convention: str
    number: int
    role: str


def classify(name: str) -> Slot | None:
    """The slot a tensor name fills, or None when it follows no convention."""
    low = name.lower()
    if low in ROLE:
        return Slot("kv", 0, ROLE[low])
    if low in ALL_LAYERS_NAMES:
        return Slot("all-layers", 0, "kv")
    for convention, pattern in _PATTERNS:
        m = pattern.match(low)
        if m is None:
            continue
        if convention == "numbered":
            return Slot(convention, int(m.group(2)), ROLE[m.group(1)])
        if convention == "hf-tuple":
            return Slot(convention, int(m.group(1)), "k" if m.group(2) == "0" else "v")
        return Slot(convention, int(m.group(1)), ROLE[m.group(2)])
    return None


def order(group: tuple[str, int]) -> tuple[int, int]:
    """Sort key of a (convention, number) group: CONVENTIONS order, then number."""
    return list(CONVENTIONS).index(group[0]), group[1]


def describe(names: list[str], shown: int = 6) -> str:
    """The first tensor names of a file, for a refusal."""
    ordered = sorted(names)
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    return "tensors: " + (", ".join(ordered[:shown]) + more if ordered else "none")


def conventions() -> str:
    """The conventions by short name, each with its keys' name, for a refusal."""
    return "naming conventions: " + ", ".join(
        f"{short} ({example.split(' ')[0]})" for short, example in CONVENTIONS.items()
    )


def groups(names: list[str], layout: str | None) -> dict[tuple[str, int], dict[str, str]]:
    """The tensors of a file by (convention, number), each {"k": name, "v":
    name} (or {"kv": name}); refuses a file with none, a half pair, or two
    tensors for one place."""
    found: dict[tuple[str, int], dict[str, str]] = {}
    for name in sorted(names):
        slot = classify(name)
        if slot is None:
            continue
        group = found.setdefault((slot.convention, slot.number), {})
        if slot.role in group:
            what = {"k": "keys", "v": "values", "kv": "every layer's K/V"}[slot.role]
            raise BadFileError(
                f"tensors {group[slot.role]!r} and {name!r} both name the {what} of one entry "
                "(names are matched case-insensitively)"
            )
        group[slot.role] = name
    if not found and layout == "l2thd" and len(names) == 1:
        found[("all-layers", 0)] = {"kv": names[0]}  # the caller says what the only tensor is
    if not found:
        raise BadFileError(f"no K/V pair found ({describe(names)}); {conventions()}")
    for group in found.values():
        if "kv" not in group and len(group) < 2:
            role, have = next(iter(group.items()))
            raise BadFileError(f"tensor {have!r} has no {'values' if role == 'k' else 'keys'} partner")
    return found


def layout_of(name: str, shape: tuple[int, ...], convention: str, given: str | None, embed_dim: int | None) -> str:
    """The layout of a tensor: the caller's, else its convention's, else the
    one layout its shape fits for embed_dim (two fitting is refused)."""
    rank = len(shape)
    if convention == "all-layers":
        if given not in (None, "l2thd"):
            raise InvalidArgumentError(
                f"tensor {name!r} holds every layer's keys and values: its layout is "
                f"l2thd {kv_layouts.SHAPES['l2thd']}, not {given}"
            )
        if embed_dim is not None and rank == 5 and kv_layouts.row_width(shape, "l2thd") != embed_dim:
            raise InvalidTensorError(
                f"tensor {name!r} has shape {list(shape)}: as l2thd {kv_layouts.SHAPES['l2thd']} "
                f"its rows hold {kv_layouts.row_width(shape, 'l2thd')} values; the store's "
                f"embed_dim is {embed_dim}"
            )
        return "l2thd"
    if given == "l2thd":
        raise InvalidArgumentError(
            f"layout l2thd is for one tensor holding every layer (named kv); {name!r} is one side of a K/V pair"
        )
    chosen: str | None
    if given is not None:
        chosen, why = given, "as given"
    elif rank == 2:
        chosen, why = "td", "2-D"
    else:
        chosen, why = SAYS_LAYOUT.get((convention, rank)), f"as its naming convention {convention} says"
    if chosen is not None:
        if embed_dim is not None and rank == kv_layouts.RANKS[chosen]:
            width = kv_layouts.row_width(shape, chosen)
            if width != embed_dim and chosen == "td":
                raise InvalidTensorError(
                    f"tensor {name!r} has rows of {width} values; the store's embed_dim is {embed_dim}"
                )
            if width != embed_dim:
                raise InvalidTensorError(
                    f"tensor {name!r} has shape {list(shape)}: as {chosen} "
                    f"{kv_layouts.SHAPES[chosen]} ({why}) its rows hold {width} values; the "
                    f"store's embed_dim is {embed_dim}"
                )
        return chosen
    if rank not in (3, 4):
        raise InvalidTensorError(
            f"tensor {name!r} has shape {list(shape)}: K/V tensors must have shape "
            f"{kv_layouts.SHAPES['td']} (td), 3 dimensions (thd, htd) or 4 (bhtd, bthd); "
            f"one tensor of 5, {kv_layouts.SHAPES['l2thd']}, is named kv"
        )
    candidates = [x for x in kv_layouts.LAYOUTS if kv_layouts.RANKS[x] == rank]
    if embed_dim is None:
        raise InvalidArgumentError(
            f"tensor {name!r} has shape {list(shape)}: give its layout "
            f"({' or '.join(candidates)}) or the store's embed_dim"
        )
    fits = kv_layouts.fitting(shape, embed_dim)
    if not fits:
        a, b = candidates
        raise InvalidTensorError(
            f"tensor {name!r} has shape {list(shape)}, which makes no rows of the store's "
            f"embed_dim {embed_dim}: as {a} {kv_layouts.SHAPES[a]} its rows hold "
            f"{kv_layouts.row_width(shape, a)} values, as {b} {kv_layouts.SHAPES[b]} "
            f"{kv_layouts.row_width(shape, b)}"
        )
    if len(fits) > 1:
        heads = shape[1] if rank == 3 else shape[2]
        raise AmbiguousLayoutError(
            f"tensor {name!r} has shape {list(shape)}: it reads as "
            + " and as ".join(f"{x} {kv_layouts.SHAPES[x]}" for x in fits)
            + f" ({heads} heads, {heads} tokens) and no naming convention says which",
            layouts=fits,
            hint="give layout=" + " or layout=".join(repr(x) for x in fits),
        )
    return fits[0]
