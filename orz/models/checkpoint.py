"""Weights on disk: HF directories (config.json + safetensors, sharded or not) and Megatron
directories (one safetensors file per TP x PP rank, and for a MoE one per EP x ETP x PP rank of
the experts). Every write is atomic: a directory is
written beside its destination and renamed into place, so a crash never leaves a half
checkpoint that loads as complete.
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

from orz.models.arch import ModelArch, ModelConfigError, arch_from_dict, read_arch
from orz.models.convert import Layout

INDEX = "model.safetensors.index.json"
MEGATRON_META = "orz_megatron.json"
# Files of an HF directory that are not weights: carried over on export (tokenizer etc.).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_REWRITTEN = ("config.json", INDEX)


class HFCheckpoint:
    """An HF model directory, read lazily one tensor at a time."""

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

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise ModelConfigError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, "pt")
        return self._handles[file].get_tensor(name)


@contextmanager
def atomic_dir(dest: str | Path) -> Iterator[Path]:
    """Yields a fresh directory beside `dest`; on success it replaces `dest` in one rename.

    On failure the partial directory is removed and an existing `dest` is left untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            dest.rename(old)
        tmp.rename(dest)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
            for src in Path(extra_files_from).iterdir():
                if src.is_file() and src.name not in _REWRITTEN and not src.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(src, tmp / src.name)
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


def rank_dir(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """The directory of one rank's shard inside a Megatron checkpoint; with experts spread over
    EP ranks (a trainer's checkpoint), each EP rank's shard holds its own experts (Megatron's naming)."""
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + (f"_{ep_rank:03d}" if ep_rank is not None else "")


def rank_file(layout: Layout) -> str:
    return f"{rank_dir(layout.tp_rank, layout.pp_rank)}/model.safetensors"


def expert_file(layout: Layout) -> str:
    """The experts of one EP × ETP rank of one stage (experts follow their own grid, not TP's)."""
    return f"expert_rank_{layout.ep_rank:03d}_{layout.etp_rank:02d}_{layout.pp_rank:03d}/model.safetensors"


def megatron_meta(arch_config: dict, layout: Layout) -> dict:
    return {"hf_config": arch_config, "tp": layout.tp, "pp": layout.pp, "padded_vocab": layout.padded_vocab,
            "ep": layout.ep, "etp": layout.etp}


def read_megatron_meta(model_dir: str | Path) -> tuple[dict, ModelArch, Layout]:
    path = Path(model_dir) / MEGATRON_META
    if not path.is_file():
        raise ModelConfigError(f"{path}: missing (not a Megatron checkpoint written by orz)")
    try:
        meta = json.loads(path.read_text())
        layout = Layout(tp=int(meta["tp"]), pp=int(meta["pp"]), padded_vocab=meta.get("padded_vocab"),
                        ep=int(meta.get("ep", 1)), etp=int(meta.get("etp", 1)))
        config = meta["hf_config"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ModelConfigError(f"{path}: malformed ({err!r})") from None
    return config, arch_from_dict(config, path), layout


def load_rank_state(model_dir: str | Path, layout: Layout, experts: bool = False) -> dict[str, torch.Tensor]:
    """One rank's file: its TP shard, or (`experts`) its EP × ETP rank's experts."""
    path = Path(model_dir) / (expert_file(layout) if experts else rank_file(layout))
    if not path.is_file():
        raise ModelConfigError(f"{path}: missing shard for tp_rank={layout.tp_rank} pp_rank={layout.pp_rank}"
                               + (f" ep_rank={layout.ep_rank} etp_rank={layout.etp_rank}" if experts else ""))
    with safe_open(path, "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
