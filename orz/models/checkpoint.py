"""Weights on disk: HF directories (config.json + safetensors, sharded or not), and what orz records
beside a Megatron checkpoint (orz_checkpoint.json; the checkpoint itself is Megatron's own format:
orz/models/dist_checkpoint.py). Every write is atomic: a directory is written beside its
destination and renamed into place, so a crash never leaves a half checkpoint that loads as complete.
"""
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from orz.models.arch import ModelConfigError, read_arch, wrapper_of
from orz.models.spec import Sizes, smallest_dp

INDEX = "model.safetensors.index.json"
# Files of an HF directory that are not weights: carried over on export (tokenizer etc.).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_REWRITTEN = ("config.json", INDEX)


# A vision-language wrapper keeps its language model's `model.` tensors under another prefix (its LM
# head stays `lm_head.weight`). Its other tensors, the vision tower (`model.visual.`) and any MTP
# layers (`mtp.`), are not trained: they go back unchanged on export (see `with_untrained`).
LANGUAGE_MODEL = "model.language_model."  # where every wrapper of arch.WRAPPERS keeps its `model.` tensors
UNTRAINED = "untrained.safetensors"  # hf2mcore's copy of a wrapper's untrained tensors, in HF_FILES


def saved_name(name: str, config: dict) -> str:
    """Where a checkpoint of `config` keeps the language model's tensor `name` (a CausalLM's name)."""
    wrapped = wrapper_of(config) is not None and name.startswith("model.")
    return LANGUAGE_MODEL + name.removeprefix("model.") if wrapped else name


class HFCheckpoint:
    """An HF model directory, read lazily one tensor at a time, by the language model's names."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.arch = read_arch(self.dir)
        self.config = json.loads((self.dir / "config.json").read_text())
        self._file_of = self._index()
        self._handles = {}

    def _index(self) -> dict[str, str]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ModelConfigError(f"{index}: malformed ({err!r}); expected a 'weight_map'") from None
            for file in set(weight_map.values()):
                if not (self.dir / file).is_file():
                    raise ModelConfigError(f"{index}: lists {file}, which is missing")
            return weight_map
        single = self.dir / "model.safetensors"
        if not single.is_file():
            raise ModelConfigError(f"{self.dir}: no model.safetensors or {INDEX} (only safetensors weights are read)")
        with safe_open(single, "pt") as f:
            return {name: single.name for name in f.keys()}

    def keys(self) -> list[str]:
        return list(self._file_of)

    def require(self, names: Iterable[str]) -> None:
        """Names the first of `names` the checkpoint lacks."""
        for name in names:
            if saved_name(name, self.config) not in self._file_of:
                raise ModelConfigError(f"{self.dir}: tensor {saved_name(name, self.config)!r} is missing "
                                       "from the checkpoint")

    def get(self, name: str) -> torch.Tensor:
        self.require([name])
        return self._read(saved_name(name, self.config))

    def _read(self, saved: str) -> torch.Tensor:
        file = self._file_of[saved]
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, "pt")
        return self._handles[file].get_tensor(saved)

    def untrained(self, trained: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors outside `trained` (the language model's names): a wrapper's vision tower, MTP layers."""
        saved = {saved_name(name, self.config) for name in trained}
        return ((name, self._read(name)) for name in self._file_of if name not in saved)


def with_untrained(tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
                   source: str | Path | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under the names a checkpoint of `config` keeps them, then, for a
    vision-language wrapper, its untrained tensors unchanged from `source`: an HF directory of the
    same model, or the HF files hf2mcore kept (their `untrained.safetensors`)."""
    names = set()
    for name, tensor in tensors:
        names.add(name)
        yield saved_name(name, config), tensor
    if wrapper_of(config) is None:
        return  # not a wrapper: the model is all there is
    kept = Path(source) / UNTRAINED if source is not None else None
    if kept is not None and kept.is_file():
        with safe_open(kept, "pt") as f:
            yield from ((name, f.get_tensor(name)) for name in f.keys())
    else:
        yield from HFCheckpoint(source).untrained(names)


def require_untrained_source(config: dict, source: str | Path | None, what: str) -> None:
    """Refuses, before anything is written, an export of a wrapper with nowhere to take its vision tower from."""
    if wrapper_of(config) is None:
        return
    if source is None or not ((Path(source) / UNTRAINED).is_file() or (Path(source) / "config.json").is_file()):
        raise ModelConfigError(f"{what}: a vision-language checkpoint ({config['architectures'][0]}), whose vision "
                               "tower and MTP layers the Megatron checkpoint does not hold: pass --like <the HF "
                               "directory it was trained from>")


@contextmanager
def atomic_dir(dest: str | Path) -> Iterator[Path]:
    """Yields a fresh directory beside `dest`; on success it replaces `dest` in one rename.

    On failure the partial directory is removed and an existing `dest` is left untouched.
    """
    tmp = fresh_beside(dest)
    try:
        yield tmp
        replace_with(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fresh_beside(dest: str | Path) -> Path:
    """A new hidden directory beside `dest`, to be written and then renamed into place (replace_with)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))


def replace_with(tmp: Path, dest: str | Path) -> None:
    """`tmp` becomes `dest` in one rename; an existing `dest` goes once it has."""
    dest = Path(dest)
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        dest.rename(old)
    tmp.rename(dest)
    if old is not None:
        shutil.rmtree(old)


def copy_hf_files(src_dir: str | Path, dst_dir: str | Path) -> None:
    """An HF directory's files besides its config and weights (tokenizer, generation config)."""
    for src in Path(src_dir).iterdir():
        if src.is_file() and src.name not in _REWRITTEN and not src.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, Path(dst_dir) / src.name)


def save_hf(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict,
    extra_files_from: str | Path | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Writes an HF directory (sharded above `max_shard_bytes`) that transformers and vLLM load."""
    shards, current, size = [], {}, 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.detach().contiguous().cpu()
        size += nbytes
    shards.append(current)
    with atomic_dir(out_dir) as tmp:
        if extra_files_from is not None:
            copy_hf_files(extra_files_from, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if len(shards) == 1:
            save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / file, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, file))
            (tmp / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return Path(out_dir)


# ---- Megatron checkpoints (written by orz/models/dist_checkpoint.py): what they hold ------------
# What orz records beside Megatron's files; read without Megatron (the trainer's process, the planner).
MEGATRON_META = "orz_checkpoint.json"
FAST, RESHARDABLE = "dp_reshardable", "fully_reshardable"  # Megatron's two cuts of the distributed optimizer
HF_FILES = "hf_files"  # hf2mcore's copy of the HF directory's tokenizer and other files, for the way back


def kept_hf_files(mcore_dir: str | Path) -> str | None:
    """Where the HF directory's files (tokenizer, generation config, chat template) were kept for a
    Megatron directory: hf2mcore's beside it, or, for a trainer checkpoint's role
    (<run>/checkpoints/iter_N/actor), the run's copy that its trainer_state.json names (keep_hf_files).
    None where neither exists (a trainer checkpoint written before 2026-12-07)."""
    mcore_dir = Path(mcore_dir)
    places = [mcore_dir / HF_FILES]
    state = mcore_dir.parent / "trainer_state.json"
    if state.is_file() and (kept := json.loads(state.read_text()).get(HF_FILES)):
        places.append(mcore_dir.parent / kept)
    return next((str(place) for place in places if place.is_dir()), None)


def keep_hf_files(model_dir: str | Path, run_dir: str | Path) -> Path:
    """The model's files besides its config and weights, copied once into run_dir/hf_files, which
    each checkpoint references (`"hf_files": "../../hf_files"` in its trainer_state.json): an
    export of any checkpoint is then a whole HF directory, tokenizer included."""
    kept = Path(run_dir) / HF_FILES
    if not kept.is_dir():
        with atomic_dir(kept) as tmp:
            copy_hf_files(model_dir, tmp)
    return kept


def weights_fingerprint(model_dir: str | Path, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """blake3 of an HF directory's weight files: each one's name, size and header (names, dtypes,
    shapes) and `samples` evenly spaced reads of its data. A fingerprint, not a digest: it tells
    two fine-tunes of one architecture apart (their values differ everywhere) at the cost of a
    few reads per file, where a digest of a 32B model would read 64 GB."""
    import blake3

    hasher = blake3.blake3()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        hasher.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            hasher.update(f.read(header))
            for i in range(samples):
                f.seek(8 + header + (size - 8 - header - sample_bytes) * i // max(samples - 1, 1))
                hasher.update(f.read(sample_bytes))
    return hasher.hexdigest()


class NeedsRecut(ModelConfigError):
    """A `dp_reshardable` checkpoint asked for at another TP/PP/EP/ETP: re-cut it first."""


def read_megatron_meta(directory: str | Path) -> dict:
    """orz_checkpoint.json; a directory in no format orz reads is refused, naming what it holds."""
    directory = Path(directory)
    path = directory / MEGATRON_META
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ModelConfigError(f"{path}: malformed ({err})") from None
    if not directory.is_dir():
        raise ModelConfigError(f"{directory}: no such directory")
    if is_earlier_format(directory):
        raise ModelConfigError(f"{directory}: a checkpoint in the format orz wrote until 2026-12-05 (a safetensors "
                               "file per rank); convert it once with `orz convert upgrade <run>/checkpoints/iter_N`")
    raise ModelConfigError(f"{directory}: not a Megatron checkpoint written by orz (no {MEGATRON_META}; expected "
                           "a directory written by the trainer or by `orz convert hf2mcore`)")


def is_earlier_format(directory: str | Path) -> bool:
    """A role directory in the format orz wrote until 2026-12-05 (`mp_rank_TT_PPP/` per rank), or
    an `orz convert hf2mcore` output of then (`orz_megatron.json`)."""
    directory = Path(directory)
    return any(directory.glob("mp_rank_*")) or (directory / "orz_megatron.json").is_file()


def model_parallel(sizes: dict) -> tuple[int, int, int, int]:
    """(tp, pp, ep, etp): what decides where a checkpoint's fast cut loads (DP does not)."""
    return sizes["tp"], sizes["pp"], sizes.get("ep", 1), sizes.get("etp", 1)


def describe(layout: dict) -> str:
    """A checkpoint's recorded layout as Sizes.label() writes it."""
    return Sizes(**{key: layout.get(key, 1) for key in ("tp", "pp", "cp", "dp", "ep", "etp")}).label()


def recut_dir(directory: str | Path) -> Path:
    """Where a role's checkpoint re-cut for any layout lies: `<role>.reshardable` beside it."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".reshardable")


def recut_layout(directory: str | Path, sizes: dict, distributed: bool) -> dict | None:
    """The layout (its smallest DP) at which `directory` must be re-cut before workers at `sizes`
    load it; None when it loads as it is, or its re-cut exists."""
    meta = read_megatron_meta(directory)
    saved = meta["layout"]
    if (not distributed or meta.get("optimizer_sharding") != FAST or model_parallel(saved) == model_parallel(sizes)
            or (recut_dir(directory) / MEGATRON_META).is_file()):
        return None
    tp, pp, ep, etp = model_parallel(saved)
    return {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "dp": smallest_dp(tp, ep, etp)}
